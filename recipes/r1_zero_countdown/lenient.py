"""The arithmetic answer read leniently: the response's last integer, wherever it is written
(tags or not). Used with `tools/evaluate.py --reward` to tell how much of a gain in the strict,
tags-only score is the format and how much the arithmetic."""

from hybrid_rl.rewards.arithmetic import compute_score


def last_integer(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return compute_score(solution_str, ground_truth)
