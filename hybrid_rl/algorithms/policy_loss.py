"""Policy-gradient losses.

Every registered loss has the signature
``fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", config=None,
agg_kwargs=None, rollout_is_weights=None) -> (loss, metrics)`` with (batch, response_len) tensors.
``config`` is the ``actor_rollout_ref.actor`` mapping, ``agg_kwargs`` is forwarded to ``aggregate_loss``
(global_num_tokens, global_num_seqs, dp_size, loss_scale_factor) and ``rollout_is_weights`` are detached
per-token importance weights. Metrics are detached 0-dim tensors (no host sync inside the step).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .aggregation import aggregate_loss
from .functional import cfg_get, masked_mean
from .registry import Registry

POLICY_LOSSES = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0  # keeps exp(logp − old) finite


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO.

    r = exp(clamp(logp − old, −20, 20)); L1 = −A·r; L2 = −A·clip(r, 1−ε_low, 1+ε_high); Lc = max(L1, L2);
    L3 = −A·c; per token L = min(L3, Lc) if A < 0 else Lc; L ×= IS weight; then aggregated.
    Config: clip_ratio (0.2), clip_ratio_low / clip_ratio_high (default clip_ratio), clip_ratio_c (3.0, > 1).
    Metrics: pg_clipfrac = mean[L2 > L1], pg_clipfrac_lower = mean[(Lc > L3) ∧ (A < 0)], ppo_kl = mean(old − logp).
    """
    clip_ratio = cfg_get(config, "clip_ratio", 0.2)
    eps_low = cfg_get(config, "clip_ratio_low", clip_ratio)
    eps_high = cfg_get(config, "clip_ratio_high", clip_ratio)
    clip_c = cfg_get(config, "clip_ratio_c", 3.0)
    if not clip_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO (it bounds the loss at −A·c for A < 0), got {clip_c}")

    neg_log_ratio = old_log_prob - log_prob
    ratio = torch.exp((-neg_log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    # Dual clip: for A < 0 a huge ratio would otherwise give an unbounded loss.
    loss_dual = -advantages * clip_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(loss_dual, loss_ppo), loss_ppo)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights

    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode, **(agg_kwargs or {}))
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(loss_mat.dtype), response_mask),
            "pg_clipfrac_lower": masked_mean(((loss_ppo > loss_dual) & negative).to(loss_mat.dtype), response_mask),
            "ppo_kl": masked_mean(neg_log_ratio, response_mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def reinforce_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Unclipped REINFORCE: L = −A·logp·w (w = IS weight, 1 if absent), aggregated. Metric: ppo_kl = mean(old − logp)."""
    loss_mat = -advantages * log_prob
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode, **(agg_kwargs or {}))
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask)}
    return loss, metrics


def get_policy_loss(name: str):
    """The registered policy loss ``name`` (``actor.policy_loss.loss_mode``)."""
    return POLICY_LOSSES.get(name)
