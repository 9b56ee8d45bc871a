"""Reward functions and the reward manager.

``default_compute_score`` dispatches on ``data_source`` to the built-in
rule-based scorers; ``load_custom_reward_fn`` loads a user function from a
file (``custom_reward_function.path`` / ``.name``); ``RewardManager`` turns
a batch of rollouts into a token-level reward tensor.
"""

from __future__ import annotations

from typing import Any, Callable

from . import arithmetic, countdown, gsm8k, math_answer, math_verified


def _score_arithmetic(solution_str, ground_truth, extra_info):
    answer_format = extra_info.get("answer_format") if isinstance(extra_info, dict) else None
    return arithmetic.compute_score(solution_str, ground_truth, answer_format or "number")


def _score_countdown(solution_str, ground_truth, extra_info):
    return countdown.compute_score(solution_str, ground_truth)


def _score_gsm8k(solution_str, ground_truth, extra_info):
    return gsm8k.compute_score(solution_str, ground_truth)


def _score_math_dapo(solution_str, ground_truth, extra_info):
    return math_answer.compute_score(solution_str, ground_truth)


def _score_math_latex(solution_str, ground_truth, extra_info):
    return math_verified.compute_score(solution_str, ground_truth)


# data_source -> scorer(solution_str, ground_truth, extra_info)
_BUILTIN_SCORERS: dict[str, Callable[[str, Any, Any], float]] = {
    "arithmetic": _score_arithmetic,
    "countdown": _score_countdown,
    "openai/gsm8k": _score_gsm8k,
    "gsm8k": _score_gsm8k,
    "math_dapo": _score_math_dapo,
    "DigitalLearningGmbH/MATH-lighteval": _score_math_latex,
    "lighteval/MATH": _score_math_latex,
    "HuggingFaceH4/MATH-500": _score_math_latex,
}

KNOWN_DATA_SOURCES: tuple[str, ...] = tuple(_BUILTIN_SCORERS)


def builtin_scorer(data_source) -> Callable[[str, Any, Any], float] | None:
    """The built-in scorer registered for ``data_source``, or for the part of it before the first
    "/" (``arithmetic/words`` is scored as ``arithmetic``); None when there is none."""
    name = str(data_source)
    return _BUILTIN_SCORERS.get(name) or _BUILTIN_SCORERS.get(name.split("/", 1)[0])


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict:
    """Score one response with the built-in scorer of its ``data_source`` (``builtin_scorer``)."""
    scorer = builtin_scorer(data_source)
    if scorer is None:
        raise UnknownDataSourceError(
            f"No built-in reward function for data_source={str(data_source)!r}. "
            f"Known data sources: {', '.join(KNOWN_DATA_SOURCES)}. "
            "To score other data, write a function "
            "compute_score(data_source, solution_str, ground_truth, extra_info) in a file and set "
            "custom_reward_function.path=/file.py custom_reward_function.name=fn"
        )
    return scorer(solution_str, ground_truth, extra_info)


from .custom import load_custom_reward_fn  # noqa: E402
from .manager import ON_ERROR_CHOICES, RewardFunctionError, RewardManager, UnknownDataSourceError  # noqa: E402

__all__ = [
    "KNOWN_DATA_SOURCES",
    "ON_ERROR_CHOICES",
    "RewardFunctionError",
    "RewardManager",
    "UnknownDataSourceError",
    "builtin_scorer",
    "default_compute_score",
    "load_custom_reward_fn",
]
