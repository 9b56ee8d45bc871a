"""RL algorithm core: advantage estimators, KL estimators, policy losses and loss aggregation.

Pure functions on (batch, response_len) tensors, selected by config name through registries.
"""

from .advantage import ADV_ESTIMATORS, GROUP_ESTIMATORS, compute_grpo_outcome_advantage, get_advantage_estimator, group_ids, group_mean_std
from .aggregation import LOSS_AGG_MODES, aggregate_loss
from .functional import (
    entropy_from_logits, masked_mean, masked_sum, masked_var, masked_whiten, sum_pi_squared_from_logits, token_log_probs,
)
from .kl import KL_ESTIMATORS, kl_penalty
from .policy_filtration import PF_PPO_WEIGHTS, pf_ppo_resample
from .policy_loss import POLICY_LOSSES, get_policy_loss
from .registry import Registry
from .shaping import (
    RunningMoments,
    clip_advantages,
    clip_rewards,
    groups_with_variance,
    normalize_rewards,
    overlong_penalty,
    shape_advantages,
    shape_scores,
    whiten_advantages,
)
from .kl import full_kl_from_logits
from .kl_control import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller
from .rollout_correction import (
    BYPASS_LOSS_TYPES, ROLLOUT_RS_MODES, compute_rollout_correction, correction_settings, mismatch_metrics,
)
from .value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "BYPASS_LOSS_TYPES",
    "GROUP_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "PF_PPO_WEIGHTS",
    "POLICY_LOSSES",
    "ROLLOUT_RS_MODES",
    "Registry",
    "RunningMoments",
    "aggregate_loss",
    "apply_kl_penalty",
    "clip_advantages",
    "clip_rewards",
    "compute_grpo_outcome_advantage",
    "compute_rollout_correction",
    "correction_settings",
    "compute_value_loss",
    "entropy_from_logits",
    "full_kl_from_logits",
    "get_advantage_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "group_ids",
    "group_mean_std",
    "groups_with_variance",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "normalize_rewards",
    "overlong_penalty",
    "pf_ppo_resample",
    "shape_advantages",
    "shape_scores",
    "sum_pi_squared_from_logits",
    "token_log_probs",
    "whiten_advantages",
]
