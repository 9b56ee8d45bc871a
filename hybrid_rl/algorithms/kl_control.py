"""KL-in-reward: controllers for the penalty coefficient β and the reward shaping that uses it.

Config: ``algorithm.kl_ctrl = {type: fixed|adaptive, kl_coef, horizon, target_kl}`` and
``algorithm.kl_penalty`` (the per-token estimator name).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .functional import cfg_get, masked_mean
from .kl import kl_penalty

# Ziegler et al.: the proportional error is clipped so one step moves β by at most 20%·n_steps/horizon.
ADAPTIVE_ERROR_CLIP = 0.2


class FixedKLController:
    """β = kl_coef, never updated."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Adaptive β (Ziegler et al. 2019): e = clip(current/target − 1, −0.2, 0.2); β ← β·(1 + e·n_steps/horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not horizon > 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        super().__init__(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon


def get_kl_controller(kl_ctrl_cfg: Mapping[str, Any] | None) -> FixedKLController:
    """Controller from ``algorithm.kl_ctrl`` (defaults: fixed, kl_coef 0.001, horizon 10000, target_kl 0.1)."""
    kind = cfg_get(kl_ctrl_cfg, "type", "fixed")
    kl_coef = cfg_get(kl_ctrl_cfg, "kl_coef", 0.001)
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, cfg_get(kl_ctrl_cfg, "target_kl", 0.1), cfg_get(kl_ctrl_cfg, "horizon", 10000))
    raise ValueError(f"Unknown KL controller type {kind!r}. Valid: adaptive, fixed")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController,
    kl_penalty_kind: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores − β·kld, kld = kl_penalty(old, ref, kind)·m, β = the controller value *before* this
    batch's update; then ``kl_ctrl.update(current_kl, n_steps=B)`` with current_kl = mean_i masked_mean_t(kld).

    Metrics: actor/reward_kl_penalty (current_kl), actor/reward_kl_penalty_coeff (β).
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_kind) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
