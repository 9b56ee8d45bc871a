"""Several reward sources combined with weights (TRL's ``reward_funcs`` / ``reward_weights``).

``reward.funcs`` lists the sources, ``reward.weights`` their weights (null: all 1.0). A source is

* ``rule``: the built-in scorer chosen by the row's data source (as without a mixture);
* ``think_format``: R1-Zero's format reward, 1.0 for a ``<think>...</think><answer>...</answer>``
  response (``hybrid_rl.rewards.think_answer``); ``think_tags``: its soft form, 0.25 per tag
  written exactly once;
* ``code_tests``: the response's program run in the sandbox against the row's unit tests
  (``hybrid_rl.rewards.code``; limits in ``reward.sandbox``);
* ``reward_model``: the reward model's score (``reward_model.enable``; computed on the workers
  and read from the batch's ``rm_scores``); a process reward model's step rewards mix with no
  other source yet, which may only be logged beside them (weight 0);
* a function: ``{path: file.py, name: fn, reward_kwargs: {...}}`` or the string ``"file.py:fn"``,
  called like ``custom_reward_function``; it may return None for a sample to abstain.

Without ``reward.funcs`` the single source of verl's keys is used: the reward model when
``reward_model.enable`` (alone, as in verl), else ``custom_reward_function``, else ``rule``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["RewardSource", "combine", "sources_from_config"]

BUILTIN_SOURCES = ("rule", "think_format", "think_tags", "code_tests", "reward_model")
RM_SCORES = "rm_scores"  # the batch's tensor of reward-model scores (workers/reward_model.py)
RM_STEPS = ("rm_step_scores", "rm_step_mask")  # a process reward model's (B, T) step rewards and step ends


@dataclass
class RewardSource:
    """``fn`` scores one sample like a reward function; ``batch_fn(responses, ground_truths)``
    scores a whole batch and returns ``(scores, failed)``; ``batch_key`` names a (B,) tensor of
    the batch that holds the scores. Exactly one of them is set. ``step_keys``: the batch also holds
    (B, T) step rewards and a bool mask of the step-end tokens that carry them (a process reward
    model), which then stand in for the outcome reward."""

    name: str
    weight: float
    fn: Callable | None = None
    batch_fn: Callable | None = None
    batch_key: str | None = None
    step_keys: tuple[str, str] | None = None



def combine(values: Sequence[float | None], weights: Sequence[float]) -> float:
    """One sample's reward: ``r = sum_i w_i * r_i`` over the sources that did not abstain
    (``r_i`` is None), as TRL's ``nansum`` does; 0.0 when every source abstains."""
    return math.fsum(w * v for v, w in zip(values, weights) if v is not None)


def _unique(name: str, taken: set) -> str:
    candidate, k = name, 2
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate


def sources_from_config(reward_cfg: Any, config_error: type[Exception],
                        reward_model: bool = False, process: bool = False,
                        provided: tuple[str, ...] = ()) -> list[RewardSource] | None:
    """The configured mixture, or None when ``reward.funcs`` is empty (a single source).
    ``reward_model``: whether ``reward_model.enable`` is on; ``process``: whether it is a process
    reward model (``reward_model.process.enable``), whose step rewards are the only source with
    a weight (others are logged at weight 0); ``provided``: the keyword arguments a served reward
    model gives the functions."""
    from . import default_compute_score, load_custom_reward_fn
    from .custom import load_function_ref
    from .code import CodeTestsScorer
    from .sandbox import Sandbox
    from .think_answer import format_score, tag_count_score

    per_sample = {"rule": default_compute_score, "think_format": format_score, "think_tags": tag_count_score}
    funcs = list(reward_cfg.funcs or [])
    steps = RM_STEPS if reward_model and process else None
    if not funcs:
        return [RewardSource("reward_model", 1.0, batch_key=RM_SCORES, step_keys=steps)] if reward_model else None
    if reward_model and "reward_model" not in funcs:
        raise config_error("reward_model.enable=true, but reward.funcs does not list reward_model; add it (e.g. "
                           "reward.funcs=[reward_model,rule]) or set reward_model.enable=false.")
    if funcs.count("reward_model") > 1:
        raise config_error("reward.funcs lists reward_model more than once; give it one entry.")
    weights = reward_cfg.weights
    if weights is None:
        weights = [1.0] * len(funcs)
    weights = list(weights)
    if len(weights) != len(funcs):
        raise config_error(f"reward.weights has {len(weights)} entries but reward.funcs has {len(funcs)}; give "
                           "one weight per source, or set reward.weights=null to weigh every source 1.0.")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise config_error(f"reward.weights[{i}]={w!r} is not a finite number.")
    sources, taken = [], set()
    for i, (entry, weight) in enumerate(zip(funcs, weights)):
        key = f"reward.funcs[{i}]"
        if isinstance(entry, str) and entry in per_sample:
            sources.append(RewardSource(_unique(entry, taken), float(weight), fn=per_sample[entry]))
        elif entry == "reward_model":
            if not reward_model:
                raise config_error(f"{key}=reward_model needs reward_model.enable=true and reward_model.model.path "
                                   "(a sequence-classification model folder; tools/train_reward_model.py trains one).")
            sources.append(RewardSource(_unique("reward_model", taken), float(weight), batch_key=RM_SCORES,
                                        step_keys=steps))
        elif entry == "code_tests":
            sandbox = Sandbox(**dict(reward_cfg.sandbox)).start()
            sources.append(RewardSource(_unique("code_tests", taken), float(weight), batch_fn=CodeTestsScorer(sandbox)))
        elif isinstance(entry, str) and ":" in entry and entry.rsplit(":", 1)[0].endswith(".py"):
            fn = load_function_ref(entry, key, provided)
            sources.append(RewardSource(_unique(entry.rsplit(":", 1)[1], taken), float(weight), fn=fn))
        elif hasattr(entry, "get") and entry.get("path"):
            name = entry.get("name") or "compute_score"
            fn = load_custom_reward_fn(entry["path"], name, entry.get("reward_kwargs"), key=key, provided=provided)
            sources.append(RewardSource(_unique(name, taken), float(weight), fn=fn))
        else:
            raise config_error(
                f"{key}={entry!r} is not a reward source. Use one of {', '.join(BUILTIN_SOURCES)}, "
                "'path/to/file.py:function', or {path: file.py, name: function, reward_kwargs: {}}.")
    mixed = [source.name for source in sources if steps and source.step_keys is None and source.weight != 0]
    if mixed:
        raise config_error(f"reward.funcs={funcs}: a process reward model (reward_model.process.enable=true) gives step "
                           f"rewards, which cannot be mixed with other sources yet; give {', '.join(mixed)} weight 0 "
                           "in reward.weights to log them beside it, or set reward_model.process.enable=false for an "
                           "outcome reward model.")
    return sources
