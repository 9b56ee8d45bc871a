"""RL algorithm core: advantage estimators, KL estimators, policy losses and loss aggregation.

Pure functions on (batch, response_len) tensors, selected by config name through registries.
"""

from .advantage import ADV_ESTIMATORS, compute_grpo_outcome_advantage, get_advantage_estimator, group_ids, group_mean_std
from .aggregation import LOSS_AGG_MODES, aggregate_loss
from .functional import entropy_from_logits, masked_mean, masked_sum, masked_var, masked_whiten
from .kl import KL_ESTIMATORS, kl_penalty
from .policy_loss import POLICY_LOSSES, get_policy_loss
from .registry import Registry

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "Registry",
    "aggregate_loss",
    "compute_grpo_outcome_advantage",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_ids",
    "group_mean_std",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
