"""Clipped value-function loss for the critic."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .aggregation import aggregate_loss
from .functional import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss with the prediction clipped around the rollout-time values.

    v̂_clip = clip(v̂, V_old − c, V_old + c); ℓ = max((v̂ − R)², (v̂_clip − R)²); loss = ½·aggregate(ℓ).
    Metrics: vf_clipfrac = mean[(v̂_clip − R)² > (v̂ − R)²], vpred_mean = mean(v̂) (masked, detached).
    """
    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss_unclipped = (vpreds - returns).square()
    loss_clipped = (vpred_clipped - returns).square()
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    loss = 0.5 * aggregate_loss(loss_mat, response_mask, loss_agg_mode, **(agg_kwargs or {}))
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(loss_mat.dtype), response_mask),
            "vpred_mean": masked_mean(vpreds, response_mask),
        }
    return loss, metrics
