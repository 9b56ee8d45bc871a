"""Masked reductions and other small tensor helpers shared by the algorithms."""

from __future__ import annotations

from typing import Any, Mapping

import torch

# verl's epsilons: keeps masked_mean finite on an empty mask and whitening finite on constant input.
MEAN_EPS = 1e-8
WHITEN_EPS = 1e-8


def cfg_get(config: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    """``config[key]`` for a dict or OmegaConf DictConfig, ``default`` if absent, null or no config."""
    if config is None:
        return default
    value = config.get(key, default)
    return default if value is None else value


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m. Values outside the mask are zeroed first, so NaN/inf padding cannot leak in."""
    masked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)) * mask
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m / (Σ m + 1e-8); 0 for an empty mask."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / (count + MEAN_EPS)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (N−1 denominator if ``unbiased``)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(f"unbiased masked variance needs at least 2 masked elements, got {count.item():g}")
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + 1e-8), μ and unbiased σ² over all masked elements of the whole tensor.

    Positions outside the mask are transformed too, not zeroed; callers multiply by the mask.
    """
    mean = masked_mean(x, mask)
    return (x - mean) * torch.rsqrt(masked_var(x, mask) + WHITEN_EPS)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) − Σ softmax(z)·z over the last dim."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Σ_v softmax(z)_v² = exp(logsumexp(2z) − 2·logsumexp(z)) over the last dim."""
    return torch.exp(torch.logsumexp(2 * logits, dim=-1) - 2 * torch.logsumexp(logits, dim=-1))


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[token] = z[token] − logsumexp(z) over the last dim."""
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
