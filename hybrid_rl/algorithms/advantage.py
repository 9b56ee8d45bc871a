"""Advantage estimators.

Every registered estimator has the trainer-facing signature
``fn(token_level_rewards, response_mask, *, index=None, config=None, **extra) -> (advantages, returns)``
with (batch, response_len) tensors; ``index`` holds one hashable group id per row (the prompt's uid, so a
group is the n responses to one prompt), ``config`` is the ``algorithm.*`` mapping, and ``extra`` carries
estimator-specific tensors (values, reward_baselines, ...) that others ignore.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .functional import cfg_get
from .registry import Registry

ADV_ESTIMATORS = Registry("advantage estimator")


def group_ids(index: Sequence | np.ndarray | torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Dense group number per row (in order of first appearance) and the number of groups.

    Only hashing is required of the ids, so uid strings, ints and mixed types all work.
    """
    if torch.is_tensor(index):
        index = index.cpu().numpy()  # numpy scalars hash by value, 0-dim tensors by identity
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(g, len(dense)) for g in index]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)


def group_count_sum(scores: torch.Tensor, ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (count, Σ scores) of 1-D ``scores``."""
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    return count, torch.zeros_like(count).index_add_(0, ids, scores)


def group_mean_std(scores: torch.Tensor, ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (mean, unbiased std) of 1-D ``scores``; singleton groups get mean 0, std 1."""
    count, total = group_count_sum(scores, ids, num_groups)
    mean = total / count
    # Two-pass variance: E[s²]−E[s]² cancels catastrophically for near-equal rewards.
    sq_dev = torch.zeros_like(count).index_add_(0, ids, (scores - mean[ids]).square())
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
    singleton = count == 1
    return mean.masked_fill(singleton, 0.0), std.masked_fill(singleton, 1.0)


def _require_index(name: str, index) -> None:
    if index is None:
        raise ValueError(f"advantage estimator {name!r} needs index (one group id per row, e.g. the prompt uid)")


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage.

    s_i = Σ_t r_{i,t}; per group g(i): μ = mean, σ = unbiased std (N−1); singleton: μ=0, σ=1.
    A_i = (s_i − μ)/(σ + ε), or s_i − μ if not ``norm_adv_by_std_in_grpo`` (Dr. GRPO).
    advantages = returns = A_i·m_{i,t}.
    """
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"index has {len(index)} ids for {token_level_rewards.shape[0]} rows")
    scores = token_level_rewards.sum(-1)
    ids, num_groups = group_ids(index, scores.device)
    mean, std = group_mean_std(scores, ids, num_groups)
    adv = scores - mean[ids]
    if norm_adv_by_std_in_grpo:
        adv = adv / (std[ids] + epsilon)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@ADV_ESTIMATORS.register("grpo")
def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Registry entry for ``compute_grpo_outcome_advantage``; reads ``algorithm.norm_adv_by_std_in_grpo`` (default True)."""
    _require_index("grpo", index)
    norm = cfg_get(config, "norm_adv_by_std_in_grpo", True)
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=norm)


@ADV_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO leave-one-out baseline.

    s_i = Σ_t r_{i,t}; group size n > 1: A_i = s_i − (Σ_{j∈g} s_j − s_i)/(n − 1); singleton: A_i = s_i
    (verl's ``rloo``; its ``rloo_vectorized`` gives 0 instead). advantages = returns = A_i·m_{i,t}.
    """
    _require_index("rloo", index)
    scores = token_level_rewards.sum(-1)
    ids, num_groups = group_ids(index, scores.device)
    count, total = group_count_sum(scores, ids, num_groups)
    n = count[ids]
    baseline = torch.where(n > 1, (total[ids] - scores) / (n - 1).clamp_min(1), torch.zeros_like(scores))
    adv = (scores - baseline).unsqueeze(-1) * response_mask
    return adv, adv


def get_advantage_estimator(name: str):
    """The registered estimator ``name`` (``algorithm.adv_estimator``)."""
    return ADV_ESTIMATORS.get(name)
