"""Reward and advantage shaping around the advantage estimator (the options ROLL offers).

The trainer applies them in this order:

    sequence scores ─ shape_scores: clip (``reward_clip``), then normalise (``reward_norm.mean/std``)
                    ─ token-level rewards ─ advantage estimator
                    ─ shape_advantages: whiten (``whiten_advantages``), then clip (``advantage_clip``)

All keys live under ``algorithm.*`` and are off by default; both entry points then return their
input tensor itself. Clipping the rewards first keeps outliers out of the normalisation statistics.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .advantage import group_ids, group_mean_std
from .functional import cfg_get, masked_whiten

NORM_MODES = ("batch", "group", "running", "none")


class RunningMoments:
    """Count, mean and unbiased std of every value passed to ``update`` so far.

    Each batch is reduced to (n, mean, M2 = Σ(x − mean)²) with two passes and merged with Chan et al.'s
    parallel rule, which is stable where a running Σx² is not. Stored as Python floats (float64) so
    fp32 batches do not accumulate rounding error and the state is plain numbers in a checkpoint.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    @torch.no_grad()
    def update(self, x: torch.Tensor | np.ndarray | Sequence[float]) -> None:
        x = torch.as_tensor(x).detach().reshape(-1).to(torch.float64)
        n = x.numel()
        if n == 0:
            return
        batch_mean = x.mean().item()
        batch_m2 = (x - batch_mean).square().sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def var(self) -> float:
        """Unbiased variance M2/(N − 1); 1.0 until two values have been seen (so dividing is a no-op)."""
        return self.m2 / (self.count - 1) if self.count > 1 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])

    def __repr__(self) -> str:
        return f"RunningMoments(count={self.count}, mean={self.mean:.6g}, std={self.std:.6g})"


def _symmetric_clip(x: torch.Tensor, clip: float | None, key: str) -> torch.Tensor:
    """x clamped to [−clip, clip]; unchanged (the same tensor) for clip None or 0."""
    if not clip:
        return x
    if clip < 0:
        raise ValueError(f"{key} must be positive (or null/0 to disable), got {clip}")
    return x.clamp(-clip, clip)


def clip_rewards(scores: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Sequence scores clamped to [−clip, clip] (``algorithm.reward_clip``); None/0 disables."""
    return _symmetric_clip(scores, clip, "reward_clip")


def clip_advantages(adv: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Advantages clamped to [−clip, clip] (``algorithm.advantage_clip``); None/0 disables."""
    return _symmetric_clip(adv, clip, "advantage_clip")


def whiten_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """masked_whiten(A, m)·m: zero mean and unit unbiased variance over all valid tokens of the batch."""
    return masked_whiten(adv, mask) * mask


def _norm_mode(mode: str | None, key: str) -> str:
    mode = "none" if mode is None else str(mode).lower()
    if mode not in NORM_MODES:
        raise ValueError(f"Unknown {key} mode {mode!r}. Valid: {', '.join(NORM_MODES)} (or null)")
    return mode


@torch.no_grad()
def normalize_rewards(
    scores: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor | None = None,
    mean_over: str | None = None,
    std_over: str | None = None,
    running: RunningMoments | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """(s − μ)/(σ + ε) for sequence scores s (B,), μ and σ each chosen independently:

    ``batch``   mean / unbiased std of this batch (σ = 1 for a single score);
    ``group``   mean / unbiased std of the row's group given by ``index`` (singleton: μ = 0, σ = 1);
    ``running`` ``running.mean`` / ``running.std`` after ``running.update(scores)`` (once per call);
    ``none``    μ = 0, and no division at all for σ (so ε is not applied either).
    """
    mean_mode = _norm_mode(mean_over, "reward_norm.mean")
    std_mode = _norm_mode(std_over, "reward_norm.std")
    modes = (mean_mode, std_mode)
    if "running" in modes:
        if running is None:
            raise ValueError("reward_norm 'running' needs a RunningMoments object kept across steps")
        running.update(scores)
    if "group" in modes:
        if index is None or len(index) != scores.shape[0]:
            raise ValueError("reward_norm 'group' needs index with one group id per score (the prompt uid)")
        ids, num_groups = group_ids(index, scores.device)
        group_mean, group_std = group_mean_std(scores, ids, num_groups)

    def statistic(mode: str, kind: str):
        if mode == "batch":
            if kind == "mean":
                return scores.mean()
            return scores.std() if scores.numel() > 1 else 1.0
        if mode == "group":
            return (group_mean if kind == "mean" else group_std)[ids]
        if mode == "running":
            return running.mean if kind == "mean" else running.std
        return None

    mean, std = statistic(mean_mode, "mean"), statistic(std_mode, "std")
    out = scores if mean is None else scores - mean
    return out if std is None else out / (std + eps)


@torch.no_grad()
def shape_scores(
    scores: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor | None,
    config: Mapping[str, Any] | None,
    running: RunningMoments | None = None,
) -> torch.Tensor:
    """Sequence-score shaping from ``algorithm.*``: clip by ``reward_clip``, then normalise with
    ``reward_norm.mean`` / ``reward_norm.std``. Returns ``scores`` itself when all are off."""
    scores = clip_rewards(scores, cfg_get(config, "reward_clip"))
    norm = cfg_get(config, "reward_norm")
    mean_over, std_over = cfg_get(norm, "mean"), cfg_get(norm, "std")
    if _norm_mode(mean_over, "reward_norm.mean") == _norm_mode(std_over, "reward_norm.std") == "none":
        return scores
    return normalize_rewards(scores, index, mean_over, std_over, running)


@torch.no_grad()
def shape_advantages(adv: torch.Tensor, mask: torch.Tensor, config: Mapping[str, Any] | None) -> torch.Tensor:
    """Advantage shaping from ``algorithm.*``: whiten if ``whiten_advantages``, then clip by
    ``advantage_clip``. Returns ``adv`` itself when both are off."""
    if cfg_get(config, "whiten_advantages", False):
        adv = whiten_advantages(adv, mask)
    return clip_advantages(adv, cfg_get(config, "advantage_clip"))


@torch.no_grad()
def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``), per response:

        penalty(L) = min(0, −(L − (L_max − L_buf)) / L_buf · factor)

    zero up to ``L_max − L_buf`` tokens, then falling linearly to ``−factor`` at ``L_max``
    (``data.max_response_length``); ``lengths`` are the responses' valid token counts (B,).
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"the overlong buffer ({buffer_length} tokens) must be in 1..max_response_length "
                         f"({max_length})")
    exceed = lengths.to(torch.float32) - (max_length - buffer_length)
    return (-exceed / buffer_length * factor).clamp(max=0.0)


@torch.no_grad()
def groups_with_variance(values: torch.Tensor, index: Sequence | np.ndarray | torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: True for each row whose group (rows sharing an ``index``
    id) has std(values) > 0, or has a single row; False for the rows of groups whose values are all
    equal (every response right, or every one wrong), which carry no GRPO advantage."""
    ids, num_groups = group_ids(index, values.device)
    _, std = group_mean_std(values.to(torch.float64), ids, num_groups)
    return (std > 0)[ids]
