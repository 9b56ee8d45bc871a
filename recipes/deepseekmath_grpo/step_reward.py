"""A rule-checked process reward for the arithmetic task: on a 2-core CPU it stands in for
DeepSeekMath's trained process reward model, which scores each reasoning step.

The response is split into steps at newlines (``hybrid_rl.rewards.steps``). Each step is scored
on what it claims: every equation ``x op y = z`` in it must hold, and in the last step the final
answer (the response's last integer) must equal the ground truth. A step scores the share of its
checks that pass; a step with nothing to check scores 0. ``acc`` is the outcome (the final answer
alone), for comparison with outcome supervision.

    custom_reward_function.path=recipes/deepseekmath_grpo/step_reward.py algorithm.adv_estimator=grpo_process
"""

from __future__ import annotations

import re

from hybrid_rl.rewards.arithmetic import compute_score as outcome_score
from hybrid_rl.rewards.steps import step_ends

_EQUATION = re.compile(r"(?<![\d.])(-?\d+)\s*([-+*×])\s*(-?\d+)\s*=\s*(-?\d+)(?![\d.])")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "×": lambda a, b: a * b}


def equation_checks(step: str) -> list[bool]:
    """Whether each ``x op y = z`` written in ``step`` holds."""
    return [_APPLY[op](int(a), int(b)) == int(c) for a, op, b, c in _EQUATION.findall(step)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    ends = step_ends(solution_str, "\n")
    correct = outcome_score(solution_str, ground_truth) == 1.0
    rewards, start = [], 0
    for k, end in enumerate(ends):
        checks = equation_checks(solution_str[start:end]) + ([correct] if k == len(ends) - 1 else [])
        rewards.append(sum(checks) / len(checks) if checks else 0.0)
        start = end
    return {"score": float(correct), "acc": float(correct), "step_rewards": rewards, "step_ends": ends}
