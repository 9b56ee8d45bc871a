"""The countdown task (TinyZero's R1-Zero reproduction) in verl's RL data schema: reach a target
number with an equation that uses each of 3 or 4 given numbers exactly once.

Every problem is built from an equation drawn at random (numbers, their order, + - * /, exact
divisions only, any bracketing), so it has at least one solution. Scored by
``hybrid_rl.rewards.countdown``; the ground truth is ``{"target", "numbers"}`` as in TinyZero.
"""

from __future__ import annotations

import operator
import random
from fractions import Fraction

DATA_SOURCE = "countdown"
PROMPT_TEMPLATE = (
    "Using the numbers {numbers}, write an equation that equals {target}. You may use +, -, *, / and brackets, "
    "and each number exactly once. Think it through inside <think> </think>, then write only the equation "
    "inside <answer> </answer>, for example <answer> (1 + 2) / 3 </answer>."
)
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _random_equation(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction] | None:
    """Combine the numbers, in random order, two sub-equations at a time until one is left."""
    parts = [(str(n), Fraction(n)) for n in numbers]
    rng.shuffle(parts)
    while len(parts) > 1:
        i, j = rng.sample(range(len(parts)), 2)
        (left, a), (right, b) = parts[i], parts[j]
        op = rng.choice("+-*/")
        if op == "/" and (b == 0 or (a / b).denominator != 1):
            return None
        parts = [p for k, p in enumerate(parts) if k not in (i, j)] + [(f"({left} {op} {right})", _APPLY[op](a, b))]
    return parts[0]


def make_countdown_rows(n: int, seed: int = 0, counts: tuple[int, ...] = (3, 4), lo: int = 1, hi: int = 100,
                        max_target: int = 1000, split: str = "train", exclude: frozenset | set = frozenset()
                        ) -> list[dict]:
    """``n`` distinct solvable problems (target in 1..max_target), none with a ``(numbers, target)``
    key in ``exclude``. Deterministic in ``seed``."""
    if not 1 <= lo <= hi or max_target < 1 or not counts or min(counts) < 2:
        raise ValueError(f"countdown needs 1 <= min <= max, max_target >= 1 and counts >= 2 "
                         f"(got min={lo}, max={hi}, max_target={max_target}, counts={counts})")
    rng, rows, seen = random.Random(seed), [], set(exclude)
    for _ in range(200 * n + 1000):
        if len(rows) == n:
            break
        numbers = [rng.randint(lo, hi) for _ in range(rng.choice(counts))]
        drawn = _random_equation(rng, numbers)
        if drawn is None or drawn[1].denominator != 1 or not 1 <= drawn[1] <= max_target:
            continue
        target = int(drawn[1])
        key = _key(numbers, target)
        if key in seen:
            continue
        seen.add(key)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(numbers=numbers, target=target)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
            "extra_info": {"split": split, "index": len(rows), "solution": drawn[0][1:-1]},
        })
    if len(rows) < n:
        raise ValueError(f"could only make {len(rows)} of {n} distinct countdown problems from numbers {lo}..{hi} "
                         f"with targets up to {max_target}; widen the ranges or ask for fewer")
    return rows


def _key(numbers, target) -> tuple[tuple[int, ...], int]:
    return tuple(sorted(int(x) for x in numbers)), int(target)


def problem_key(row: dict) -> tuple[tuple[int, ...], int]:
    """``(sorted numbers, target)`` of a row; use it to build ``exclude`` sets."""
    truth = row["reward_model"]["ground_truth"]
    return _key(truth["numbers"], truth["target"])
