"""Reward of the calculator recipe: the last integer of the model's own final turn must be the
answer. The number the calculator wrote does not count: a trajectory that calls the tool and then
says nothing (or something else) scores 0.

Responses reach the reward decoded without special tokens, so a tool turn reads
``...</tool_call>\\ntool\\n635\\nassistant\\n635``; the final turn is what follows the last
``\\nassistant\\n`` after a tool turn, else the whole response.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def final_turn(solution_str: str) -> str:
    head, sep, tail = solution_str.rpartition("\nassistant\n")
    return tail if sep and "\ntool\n" in head else solution_str


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    numbers = _INTEGER.findall(final_turn(solution_str).replace(",", ""))
    right = bool(numbers) and numbers[-1] == str(ground_truth).strip()
    return {"score": float(right), "acc": float(right), "called": float("<tool_call>" in solution_str)}
