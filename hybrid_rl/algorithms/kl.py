"""KL between the policy and the reference policy: per-token estimators (Schulman's k1/k2/k3) on the
sampled tokens' log-probs, and the exact full-vocabulary KL from logits."""

from __future__ import annotations

from typing import Callable

import torch
import torch.utils.checkpoint

from .registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = d, d = logp − ref (unbiased, high variance, can be negative)."""
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """|d|."""
    return (logprob - ref_logprob).abs()


# The "+" spellings of k2 are k2 itself: its gradient already is the k2 gradient.
@KL_ESTIMATORS.register("k2", "mse", "k2+", "mse+")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = ½d²; ∇k2 = d·∇logp, an unbiased estimate of ∇KL(π‖π_ref) when sampled from π."""
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = eˣ − x − 1 with x = clamp(ref − logp, −20, 20), then clamped to [0, 10] (≥ 0, low variance).

    Computed as expm1(x) − x: eˣ − 1 − x cancels catastrophically for small |x| and can round below 0 in
    fp32. verl clamps to [−10, 10]; the lower bound 0 only removes such rounding negatives.
    """
    x = (ref_logprob - logprob).clamp(-20, 20)
    return (torch.expm1(x) - x).clamp(0, 10)


def _straight_through(estimator: Callable) -> Callable:
    def straight_through(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        k2 = kl_k2(logprob, ref_logprob)
        return estimator(logprob, ref_logprob).detach() + (k2 - k2.detach())

    straight_through.__name__ = straight_through.__qualname__ = f"{estimator.__name__}_plus"
    straight_through.__doc__ = (
        f"Straight-through {estimator.__name__}: sg(k) + ½d² − sg(½d²), the value of k with the gradient of k2.\n"
        "(verl documents these names but never strips the '+', so it cannot run them.)"
    )
    return straight_through


kl_k1_plus = KL_ESTIMATORS.register("k1+", "kl+")(_straight_through(kl_k1))
kl_k3_plus = KL_ESTIMATORS.register("k3+", "low_var_kl+")(_straight_through(kl_k3))


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (batch, response_len) by estimator name (see ``KL_ESTIMATORS``)."""
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)


@KL_ESTIMATORS.register("full")
def kl_full(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """Exact KL over the vocabulary: registered so configs may name it, but it cannot be computed from the
    sampled tokens' log-probs alone; see ``full_kl_from_logits``."""
    raise ValueError("full KL needs the full logits; the worker computes it with full_kl_from_logits")


def _full_kl_chunk(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # fp32 at least: the Σ π·(log π − log π_ref) cancellation is too lossy in bf16.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    ref_logp = torch.log_softmax(ref_logits.to(dtype) / temperature, dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def full_kl_from_logits(
    logits: torch.Tensor, ref_logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """Exact per-position KL(π‖π_ref) = Σ_v π(v)·(log π(v) − log π_ref(v)), (B, T) from (B, T, V) logits.

    Both distributions are softmax(logits / temperature). Positions are processed in chunks of
    ``chunk_size`` so at most chunk_size×V log-probabilities per model exist at once; each chunk is
    recomputed in the backward (activation checkpointing), so the graph only keeps the logits themselves.
    Differentiable w.r.t. ``logits``; ``ref_logits`` is detached. Result is in ≥ fp32 and clamped at 0
    (a true KL is ≥ 0; only rounding can make it negative).
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} differ in shape")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    *lead, vocab = logits.shape
    flat = logits.reshape(-1, vocab)
    ref_flat = ref_logits.detach().reshape(-1, vocab)
    checkpoint = torch.is_grad_enabled() and flat.requires_grad
    chunks = []
    for start in range(0, flat.shape[0], chunk_size):
        piece, ref_piece = flat[start : start + chunk_size], ref_flat[start : start + chunk_size]
        if checkpoint:
            kl = torch.utils.checkpoint.checkpoint(_full_kl_chunk, piece, ref_piece, temperature, use_reentrant=False)
        else:
            kl = _full_kl_chunk(piece, ref_piece, temperature)
        chunks.append(kl)
    if not chunks:
        return flat.new_zeros(lead, dtype=torch.promote_types(logits.dtype, torch.float32))
    return torch.cat(chunks).clamp_min(0.0).reshape(lead)
