"""Per-step metrics computed on the driver, named as verl names them."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch

from hybrid_rl.algorithms import groups_with_variance
from hybrid_rl.protocol import Batch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def compute_data_metrics(batch: Batch) -> dict[str, float]:
    mask = batch["response_mask"].bool()
    response_length = batch.response_lengths().float()
    prompt_length = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float()
    valid_adv = batch["advantages"][mask]
    scores = batch["token_level_scores"].sum(-1)
    metrics = {
        **_stats("critic/score", scores),
        **_stats("critic/rewards", batch["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", valid_adv if valid_adv.numel() else torch.zeros(1)),
        **_stats("response_length", response_length),
        **_stats("prompt_length", prompt_length),
        "response_length/clip_ratio": float((response_length == mask.shape[1]).float().mean()),
    }
    # Lengths of right and wrong answers apart (a score above zero is right under the built-in 0/1
    # and +-1 scorers): GRPO's per-response length normalisation lets wrong answers grow (Dr. GRPO).
    right = scores > 0
    for name, chosen in (("correct", right), ("incorrect", ~right)):
        if chosen.any():
            metrics[f"response_length/{name}_mean"] = float(response_length[chosen].mean())
    metrics.update(multi_turn_metrics(batch))
    if "uid" in batch:  # the share of groups whose responses all scored the same: no advantage to learn from
        varied = groups_with_variance(scores, batch["uid"])
        metrics["critic/score/zero_variance_groups"] = 1.0 - float(varied.float().mean())
    return metrics


def multi_turn_metrics(batch: Batch, prefix: str = "") -> dict[str, float]:
    """verl's `num_turns/*` (chat messages per trajectory) where agent loops ran; turns, tool calls
    and tool errors per trajectory of the tool loop, and the share of trajectories that called a
    tool (with interactions, their turns and errors too); nothing for a single-turn batch."""
    metrics = _stats(f"{prefix}num_turns", batch["num_turns"]) if "num_turns" in batch else {}
    if "multi_turn_tool_calls" not in batch:
        return metrics
    calls = batch["multi_turn_tool_calls"].float()
    metrics |= {f"{prefix}multi_turn/assistant_turns/mean": float(batch["multi_turn_assistant_turns"].float().mean()),
               f"{prefix}multi_turn/assistant_turns/max": float(batch["multi_turn_assistant_turns"].max()),
               f"{prefix}multi_turn/tool_calls/mean": float(calls.mean()),
               f"{prefix}multi_turn/tool_call_share": float((calls > 0).float().mean()),
               f"{prefix}multi_turn/tool_errors/mean": float(batch["multi_turn_tool_errors"].float().mean())}
    if "multi_turn_interaction_turns" in batch:
        metrics[f"{prefix}multi_turn/interaction_turns/mean"] = float(
            batch["multi_turn_interaction_turns"].float().mean())
        metrics[f"{prefix}multi_turn/interaction_errors/mean"] = float(
            batch["multi_turn_interaction_errors"].float().mean())
    return metrics


def reduce_values(key: str, values: list[float]) -> float:
    """One value of a metric from several (ranks, mini-batches): max for *_max, min for *_min,
    else the mean."""
    if key.endswith("_max"):
        return max(values)
    return min(values) if key.endswith("_min") else sum(values) / len(values)


def reduce_worker_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """`reduce_values` over ranks (per-rank losses are already scaled so that the mean is exact)."""
    merged: dict[str, list[float]] = defaultdict(list)
    for metrics in per_rank:
        for key, value in metrics.items():
            merged[key].append(value)
    return {key: reduce_values(key, values) for key, values in merged.items()}


class Timer:
    """Collects `timing_s/<phase>` durations for one step."""

    def __init__(self):
        self.timings: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[f"timing_s/{name}"] = self.timings.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def throughput_metrics(batch: Batch, step_seconds: float, n_ranks: int) -> dict[str, float]:
    tokens = float(batch["attention_mask"].sum())
    return {"perf/total_num_tokens": tokens, "perf/time_per_step": step_seconds,
            "perf/throughput": tokens / (step_seconds * n_ranks)}


def per_source_means(data_sources, values: dict, n: int) -> dict[str, float]:
    """Validation per data source (verl's ``val-core/<source>/<name>/mean@<n>``) of the samples'
    ``reward``, and of the values a scorer reports beside its score: ``acc``, and each mixture
    source's ``reward/<name>`` (so a source at weight 0, such as the rule beside a reward model,
    is seen per data set); in a multi-turn validation also ``tool_call`` (1 for a trajectory that
    called a tool). Samples a value is missing for (None: failed or abstained) are left out."""
    grouped: dict[str, list[float]] = defaultdict(list)
    for key, column in values.items():
        if (key not in ("reward", "acc", "tool_call") and not key.startswith("reward/")) or \
                len(column) != len(data_sources):
            continue
        for source, value in zip(data_sources, column):
            if isinstance(value, (bool, int, float)):
                grouped[f"val-core/{source}/{key}/mean@{n}"].append(float(value))
    return {name: float(np.mean(v)) for name, v in grouped.items()}


def reward_source_metrics(reward_extra: dict, sandbox_failures: dict[str, int], prefix: str = "") -> dict[str, float]:
    """Per source of a reward mixture: its mean score over the samples it scored (abstentions and
    failed samples left out), and the samples whose sandbox run timed out or crashed."""
    metrics = {}
    for key, values in reward_extra.items():
        if key.startswith("reward/"):
            scored = [float(v) for v in values if v is not None]
            if scored:
                metrics[f"{prefix}{key}/mean"] = sum(scored) / len(scored)
    for name, count in sandbox_failures.items():
        metrics[f"{prefix}reward/{name}/sandbox_failures"] = float(count)
    return metrics
