"""Rule-based scorer for the countdown task (TinyZero's R1-Zero reproduction): reach the target
with an equation that uses each given number exactly once and only + - * / and brackets.

The equation is read from the response's last ``<answer>`` block (``think_answer``); a trailing
``= target`` is allowed. It is evaluated exactly (fractions, so 7 / 2 * 2 is 7), by walking its
syntax tree, never by ``eval``. The ground truth is ``{"target": int, "numbers": [int, ...]}``,
TinyZero's schema, so its parquet files score here unchanged.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction

from .think_answer import answer_text

_ALLOWED = re.compile(r"[\d+\-*/().\s]+")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> Fraction | None:
    """The exact value of an expression of integers, + - * / and brackets; None when it is
    anything else, does not parse, or divides by zero."""
    if not _ALLOWED.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not an arithmetic expression")

    try:
        return value(tree.body)
    except (ValueError, ZeroDivisionError):
        return None


def _ground_truth(ground_truth) -> tuple[int, list[int]]:
    try:
        return int(ground_truth["target"]), [int(n) for n in ground_truth["numbers"]]
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"countdown ground_truth must be {{'target': int, 'numbers': [int, ...]}}, got "
                         f"{ground_truth!r}; check the reward_model.ground_truth column of the data file "
                         "(tools/data/countdown.py writes it)") from exc


def compute_score(solution_str: str, ground_truth) -> float:
    """1.0 when the last ``<answer>`` holds an equation that uses exactly the given numbers, each
    once, and equals the target; else 0.0."""
    target, numbers = _ground_truth(ground_truth)
    equation = answer_text(solution_str)
    if equation is None:
        return 0.0
    left, _, right = equation.partition("=")
    if right.strip() and right.strip() != str(target):
        return 0.0
    if Counter(int(n) for n in re.findall(r"\d+", left)) != Counter(numbers):
        return 0.0
    return 1.0 if evaluate(left) == target else 0.0
