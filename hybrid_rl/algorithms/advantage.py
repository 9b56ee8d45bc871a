"""Advantage estimators.

Every registered estimator has the trainer-facing signature
``fn(token_level_rewards, response_mask, *, index=None, config=None, **extra) -> (advantages, returns)``
with (batch, response_len) tensors; ``index`` holds one hashable group id per row (the prompt's uid, so a
group is the n responses to one prompt), ``config`` is the ``algorithm.*`` mapping, and ``extra`` carries
estimator-specific tensors (values, reward_baselines, step_mask, reward_components) that others ignore. Scalars come from
``config`` under verl's key names (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``, ...) with verl's defaults.
s_i = Σ_t r_{i,t} below is a response's sequence score; "×m" broadcasts a per-row value over its tokens and
zeroes the positions outside ``response_mask``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .functional import cfg_get, masked_whiten
from .registry import Registry

ADV_ESTIMATORS = Registry("advantage estimator")
# Estimators whose baseline compares the n responses to one prompt (n=1 leaves them no baseline).
GROUP_ESTIMATORS = ("grpo", "rloo", "grpo_passk", "opo", "gpg", "reinforce_plus_plus_baseline", "grpo_process",
                    "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo")


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


def _grouping(name: str, index, rows: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """``group_ids`` after checking that ``index`` is given and has one id per row."""
    _require_index(name, index)
    if len(index) != rows:
        raise ValueError(f"index has {len(index)} ids for {rows} rows")
    return group_ids(index, device)


def _require_extra(name: str, key: str, value, what: str, shape: torch.Size | None = None) -> torch.Tensor:
    """The estimator-specific tensor ``key``, with an error that says what the trainer must supply."""
    if value is None:
        raise ValueError(f"advantage estimator {name!r} needs extra {key!r}: {what}")
    if shape is not None and value.shape != shape:
        raise ValueError(f"{name}: {key} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """y_t = Σ_{u≥t} x_u along the last dim."""
    return x.flip(-1).cumsum(-1).flip(-1)


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
    scores = token_level_rewards.sum(-1)
    ids, num_groups = _grouping("grpo", index, scores.shape[0], scores.device)
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
    scores = token_level_rewards.sum(-1)
    ids, num_groups = _grouping("rloo", index, scores.shape[0], scores.device)
    count, total = group_count_sum(scores, ids, num_groups)
    n = count[ids]
    baseline = torch.where(n > 1, (total[ids] - scores) / (n - 1).clamp_min(1), torch.zeros_like(scores))
    adv = (scores - baseline).unsqueeze(-1) * response_mask
    return adv, adv


@ADV_ESTIMATORS.register("gae")
@torch.no_grad()
def gae_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    values: torch.Tensor | None = None,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (PPO with a critic); extra ``values`` = V (B, T).

    Backward over t with V_next = a_next = 0 at the end:
        δ_t = r_t + γ·V_next − V_t,    a_t = δ_t + γλ·a_next,
    and only where m_t = 1 do V_next ← V_t and a_next ← a_t; a masked token (a tool observation
    inside a multi-turn response, or padding) carries both over, so it is skipped entirely: its
    reward and value are never read and the TD chain bridges it. a_t at a masked token is the
    carried value.
    returns = a + V (before whitening; unmasked, like verl; only their masked entries are meaningful).
    advantages = masked_whiten(a, m)·m, whitened over the whole batch. γ = ``gamma``, λ = ``lam`` (1.0).
    Deviation: verl does not re-mask after whitening, leaving −μ/σ-like junk on masked tokens; we zero it.
    """
    values = _require_extra("gae", "values", values, "the critic's per-token values V (B, T)", token_level_rewards.shape)
    gamma = float(cfg_get(config, "gamma", 1.0))
    lam = float(cfg_get(config, "lam", 1.0))
    valid = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(token_level_rewards.shape[1])):
        adv_t = token_level_rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        # where(), not a mask blend: NaN/inf in a skipped token's value must not leak into the chain.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        columns.append(next_adv)
    adv = torch.stack(columns[::-1], dim=1)
    returns = adv + values
    return masked_whiten(adv, response_mask) * response_mask, returns


@ADV_ESTIMATORS.register("grpo_passk")
@torch.no_grad()
def grpo_passk_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    epsilon: float = 1e-6,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (arXiv 2503.19595): only each group's best response is credited.

    Per group (n ≥ 2 required): i* = argmax_i s_i (first row on ties),
    A_{i*} = (s_max − s_2nd)/(σ + ε) with σ the unbiased group std, or s_max − s_2nd if not
    ``norm_adv_by_std_in_grpo`` (default True); every other response gets 0. advantages = returns = A_i·m.
    """
    scores = token_level_rewards.sum(-1)
    ids, num_groups = _grouping("grpo_passk", index, scores.shape[0], scores.device)
    count, _ = group_count_sum(scores, ids, num_groups)
    if (count < 2).any():
        raise ValueError(f"grpo_passk needs at least 2 responses per group (rollout.n >= 2), "
                         f"got a group of size {int(count.min())}")
    _, std = group_mean_std(scores, ids, num_groups)
    # Rows grouped together, each group sorted best-first: its first two entries are the top two.
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort(ids[order], stable=True)]
    start = count.long().cumsum(0) - count.long()
    best, second = order[start], order[start + 1]
    gap = scores[best] - scores[second]
    if cfg_get(config, "norm_adv_by_std_in_grpo", True):
        gap = gap / (std + epsilon)
    adv = torch.zeros_like(scores).index_put_((best,), gap)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@ADV_ESTIMATORS.register("gdpo")
@torch.no_grad()
def gdpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    reward_components: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242): each reward component normalised in its group on its own, then
    summed, so that a component with a wide spread does not drown the others.

    Extra ``reward_components`` c (B, K): the K scores the reward function returned per response
    (``algorithm.gdpo_reward_keys``); w_k = ``algorithm.gdpo_reward_weights`` (default 1 each).
    A^k_i = (c_{i,k} − μ_g(c_k))/(σ_g(c_k) + ε), or c_{i,k} − μ_g(c_k) if not
    ``norm_adv_by_std_in_grpo`` (GRPO on component k alone); a_i = Σ_k w_k A^k_i;
    advantages = returns = masked_whiten(a·m, m)·m over the batch. ``token_level_rewards`` is not read.
    """
    rows = response_mask.shape[0]
    components = _require_extra("gdpo", "reward_components", reward_components,
                                "the reward components named by algorithm.gdpo_reward_keys, one column each")
    if components.ndim != 2 or components.shape[0] != rows:
        raise ValueError(f"gdpo: reward_components has shape {tuple(components.shape)}, expected ({rows}, K)")
    ids, num_groups = _grouping("gdpo", index, rows, response_mask.device)
    weights = cfg_get(config, "gdpo_reward_weights", [1.0] * components.shape[1])
    if len(weights) != components.shape[1]:
        raise ValueError(f"gdpo: {len(weights)} weights (algorithm.gdpo_reward_weights) for "
                         f"{components.shape[1]} reward components")
    norm = cfg_get(config, "norm_adv_by_std_in_grpo", True)
    components = components.to(device=response_mask.device,
                               dtype=components.dtype if components.is_floating_point() else torch.float32)
    combined = torch.zeros(rows, dtype=components.dtype, device=components.device)
    for k, weight in enumerate(weights):
        scores = components[:, k]
        mean, std = group_mean_std(scores, ids, num_groups)
        centred = scores - mean[ids]
        combined += float(weight) * (centred / (std[ids] + epsilon) if norm else centred)
    adv = combined.unsqueeze(-1) * response_mask
    adv = masked_whiten(adv, response_mask) * response_mask
    return adv, adv


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline.

    a_{i,t} = (s_i − μ_g)·m (singleton: μ = 0); advantages = returns = masked_whiten(a, m)·m,
    whitened over the whole batch (the std normalisation is batch-level, not per group).
    """
    scores = token_level_rewards.sum(-1)
    ids, num_groups = _grouping("reinforce_plus_plus_baseline", index, scores.shape[0], scores.device)
    mean, _ = group_mean_std(scores, ids, num_groups)
    adv = (scores - mean[ids]).unsqueeze(-1) * response_mask
    adv = masked_whiten(adv, response_mask) * response_mask
    return adv, adv


@ADV_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over the batch.

    Backward over t: G_t = r_t + γ·m_{t+1}·G_{t+1} with G_T = 0, i.e. the discounted sum restarts
    before every masked token, so padding and observation tokens cut the chain.
    advantages = masked_whiten(G, m)·m; returns = G (unmasked, like verl). γ = ``gamma`` (1.0).
    """
    gamma = float(cfg_get(config, "gamma", 1.0))
    valid = response_mask.bool()
    running = torch.zeros_like(token_level_rewards[:, 0])
    columns = []
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        columns.append(running)
        running = torch.where(valid[:, t], running, torch.zeros_like(running))
    returns = torch.stack(columns[::-1], dim=1)
    return masked_whiten(returns, response_mask) * response_mask, returns


@ADV_ESTIMATORS.register("remax")
@torch.no_grad()
def remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    reward_baselines: torch.Tensor | None = None,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the greedy response's reward as baseline; extra ``reward_baselines`` b (B,).

    G_t = Σ_{u≥t} r_u·m_u; advantages = (G_t − b)·m_t; returns = G. No whitening.
    Deviation: verl masks only the baseline (G − b·m), so G leaks onto masked tokens that precede
    valid ones (multi-turn); we mask the whole advantage. Identical for right-padded responses.
    """
    rows = token_level_rewards.shape[0]
    baselines = _require_extra(
        "remax", "reward_baselines", reward_baselines,
        "one reward per row from a greedy (do_sample=False) rollout of the same prompt; the trainer must "
        "run that greedy baseline rollout and score it before computing advantages")
    if baselines.numel() != rows:
        raise ValueError(f"remax: reward_baselines has {baselines.numel()} values for {rows} rows")
    returns = _reverse_cumsum(token_level_rewards * response_mask)
    adv = (returns - baselines.reshape(rows, 1)) * response_mask
    return adv, returns


@ADV_ESTIMATORS.register("opo")
@torch.no_grad()
def opo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv 2505.23585): length-weighted group baseline, no std.

    L_i = Σ_t m_{i,t}; b_g = Σ_{i∈g} L_i·s_i / Σ_{i∈g} L_i (singleton, or a group of empty
    responses: b = 0); A_i = s_i − b_g; advantages = returns = A_i·m.
    """
    scores = token_level_rewards.sum(-1)
    ids, num_groups = _grouping("opo", index, scores.shape[0], scores.device)
    lengths = response_mask.sum(-1).to(scores.dtype)
    count, weighted = group_count_sum(lengths * scores, ids, num_groups)
    _, total_len = group_count_sum(lengths, ids, num_groups)
    has_baseline = (count > 1) & (total_len > 0)
    baseline = torch.where(has_baseline, weighted / torch.where(has_baseline, total_len, 1.0), 0.0)
    adv = (scores - baseline[ids]).unsqueeze(-1) * response_mask
    return adv, adv


@ADV_ESTIMATORS.register("gpg")
@torch.no_grad()
def gpg_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv 2504.02546): group-mean baseline rescaled by the fraction of rewarded responses.

    α = B / max(#{i : s_i ≠ 0}, 1) over the whole batch; A_i = α·(s_i − μ_g)/f (singleton: μ = 0),
    f = ``gpg_f_norm`` (1.0); no std. advantages = returns = A_i·m.
    """
    scores = token_level_rewards.sum(-1)
    ids, num_groups = _grouping("gpg", index, scores.shape[0], scores.device)
    mean, _ = group_mean_std(scores, ids, num_groups)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    f_norm = float(cfg_get(config, "gpg_f_norm", 1.0))
    adv = (alpha * (scores - mean[ids]) / f_norm).unsqueeze(-1) * response_mask
    return adv, adv


@ADV_ESTIMATORS.register("grpo_process")
@torch.no_grad()
def grpo_process_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    step_mask: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO with process supervision (DeepSeekMath §4.1.3); extra ``step_mask`` (B, T) marks step ends.

    r_{i,k} = token_level_rewards at the end token e_{i,k} of step k of response i. All step rewards
    of all responses of a group are normalised together: r̃ = (r − μ_g)/(σ_g + ε), μ_g / σ_g the
    mean / unbiased std over those rewards (a group with one step reward: μ = 0, σ = 1; without the
    division if not ``norm_adv_by_std_in_grpo``). A_{i,t} = Σ_{k : e_{i,k} ≥ t} r̃_{i,k}, ×m, so tokens
    after the last step end get 0. Step ends outside ``response_mask`` are ignored.
    advantages = returns.
    """
    step_mask = _require_extra(
        "grpo_process", "step_mask", step_mask,
        "a (B, T) bool mask of step-end tokens, each carrying its step's reward in token_level_rewards",
        token_level_rewards.shape)
    ids, num_groups = _grouping("grpo_process", index, token_level_rewards.shape[0], token_level_rewards.device)
    rows, cols = (step_mask.bool() & response_mask.bool()).nonzero(as_tuple=True)
    step_rewards = token_level_rewards[rows, cols]
    mean, std = group_mean_std(step_rewards, ids[rows], num_groups)
    normed = step_rewards - mean[ids[rows]]
    if cfg_get(config, "norm_adv_by_std_in_grpo", True):
        normed = normed / (std[ids[rows]] + epsilon)
    dense = torch.zeros_like(token_level_rewards).index_put_((rows, cols), normed)
    adv = _reverse_cumsum(dense) * response_mask
    return adv, adv


def _otb_inputs(name: str, token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                rollout_is_weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The optimal token baseline's returns G, cumulative path weights W (both (B, T)) and
    dense group ids."""
    shape = token_level_rewards.shape
    ids, num_groups = _grouping(name, index, shape[0], token_level_rewards.device)
    what = "set actor_rollout_ref.actor.calculate_sum_pi_squared=true, so that the actor's log-prob pass returns them"
    old_log_probs = _require_extra(name, "old_log_probs", old_log_probs, what, shape)
    sum_pi_squared = _require_extra(name, "sum_pi_squared", sum_pi_squared, what, shape)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _reverse_cumsum(token_level_rewards * mask)
    # ||score of token j||² ≈ 1 − 2π_j + Σ_v π_v², scaled by ρ̄_j² under truncated importance sampling.
    weight = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        weight = weight * rollout_is_weights.square()
    return returns, (weight * mask).cumsum(-1), ids, num_groups


def _otb_baselines(returns: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor,
                   num_groups: int, zero_tail: bool, epsilon: float) -> torch.Tensor:
    """B_{g,k} = Σ_{i∈g} G_{i,k} W_{i,k} / (Σ_{i∈g} W_{i,k} + ε) over rows laid out so that
    column k is comparable across a group (past a row's `lengths`, G = W = 0); 0 for a group of
    one. With `zero_tail`, a group's single longest row gets B = 0 past the second-longest length."""
    numerator = returns.new_zeros(num_groups, returns.shape[1]).index_add_(0, ids, returns * path)
    denominator = returns.new_zeros(num_groups, returns.shape[1]).index_add_(0, ids, path)
    count, _ = group_count_sum(lengths.to(returns.dtype), ids, num_groups)
    baselines = (numerator / (denominator + epsilon))[ids] * (count[ids] > 1).unsqueeze(-1)
    if zero_tail:
        columns = torch.arange(returns.shape[1], device=returns.device)
        for group in range(num_groups):
            rows = (ids == group).nonzero(as_tuple=True)[0]
            if len(rows) < 2:
                continue
            group_lengths, order = lengths[rows].sort(descending=True)
            if group_lengths[0] > group_lengths[1]:
                baselines[rows[order[0]]] *= columns < group_lengths[1]
    return baselines


@ADV_ESTIMATORS.register("optimal_token_baseline")
@torch.no_grad()
def optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
    epsilon: float = 1e-8,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (verl's OTB): a baseline per group and position, weighted by each
    path's accumulated variance; extra ``old_log_probs`` and ``sum_pi_squared`` (B, T), the
    actor's log-prob of each sampled token and Σ_v π_v² of its next-token distribution, and
    ``rollout_is_weights`` ρ̄ (B, T) when rollout importance sampling is on.

    G_{i,t} = Σ_{u≥t} r_{i,u}·m_{i,u}; w_{i,t} = (1 − 2·exp(old_{i,t}) + Σπ²_{i,t})·ρ̄²_{i,t};
    W_{i,t} = Σ_{u≤t} w_{i,u}·m_{i,u}; B_{g,t} = Σ_{i∈g} G_{i,t} W_{i,t} m_{i,t} / (Σ_{i∈g} W_{i,t}
    m_{i,t} + ε) (a group of one: B = 0; with ``handle_zero_tail`` a group's unique longest
    response gets B = 0 past the second-longest length); advantages = (G − B)·m, returns = G.
    """
    returns, path, ids, num_groups = _otb_inputs("optimal_token_baseline", token_level_rewards, response_mask,
                                                 index, old_log_probs, sum_pi_squared, rollout_is_weights)
    mask = response_mask.to(returns.dtype)
    baselines = _otb_baselines(returns * mask, path * mask, mask.sum(-1), ids, num_groups, handle_zero_tail, epsilon)
    return (returns - baselines) * mask, returns


@ADV_ESTIMATORS.register("tir_optimal_token_baseline")
@torch.no_grad()
def tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    config: Mapping[str, Any] | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline for multi-turn rollouts (verl's TIR variant), whose responses
    hold tool outputs outside the mask: as ``optimal_token_baseline``, but the group compares its
    responses at their k-th *trained* token, not at the k-th position. Each row's G and W at its
    masked-in positions are packed to the left, B_{g,k} computed on the packed rows (with
    ``handle_zero_tail`` on by default), and A = G − B put back at those positions (0 elsewhere;
    rows with no trained token are left out of their group). returns = G.
    """
    returns, path, ids, num_groups = _otb_inputs("tir_optimal_token_baseline", token_level_rewards, response_mask,
                                                 index, old_log_probs, sum_pi_squared, rollout_is_weights)
    trained = response_mask.bool()
    lengths = trained.sum(-1)
    # Packed column of each trained token: its rank among its row's trained tokens.
    column = trained.long().cumsum(-1) - 1
    rows, cols = trained.nonzero(as_tuple=True)
    width = int(lengths.max()) if len(lengths) else 0
    packed_returns = returns.new_zeros(len(lengths), width).index_put_((rows, column[rows, cols]), returns[rows, cols])
    packed_path = returns.new_zeros(len(lengths), width).index_put_((rows, column[rows, cols]), path[rows, cols])
    # Rows with nothing trained join no group.
    present = lengths > 0
    kept_ids, kept_groups = group_ids(ids[present].tolist(), ids.device)
    baselines = returns.new_zeros(len(lengths), width)
    baselines[present] = _otb_baselines(packed_returns[present], packed_path[present], lengths[present], kept_ids,
                                        kept_groups, handle_zero_tail, epsilon)
    advantages = torch.zeros_like(returns)
    advantages[rows, cols] = packed_returns[rows, column[rows, cols]] - baselines[rows, column[rows, cols]]
    return advantages, returns


def get_advantage_estimator(name: str):
    """The registered estimator ``name`` (``algorithm.adv_estimator``)."""
    return ADV_ESTIMATORS.get(name)
