"""Synthetic arithmetic problems in verl's RL data schema.

``make_arithmetic_rows`` is used by ``tools/make_arithmetic_data.py`` to
write parquet files, and by tests / smoke jobs to build data on the fly.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Iterable

DATA_SOURCE = "arithmetic"

# The instruction given to the model; ``{a}``, ``{op}`` and ``{b}`` are filled in.
# Kept in one place so it can be tuned without touching the generator.
PROMPT_TEMPLATE = "Calculate {a} {op} {b}. Reply with only the final number."

# Operand range of the built-in data set: SmolLM2-135M-Instruct solves about a third of these
# greedily, and sampled groups often mix right and wrong answers, which GRPO needs to learn.
DEFAULT_LO, DEFAULT_HI = 1, 20

_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def dataset_tag(lo: int = DEFAULT_LO, hi: int = DEFAULT_HI, ops: str = "+-") -> str:
    """A name that changes whenever the generated problems would, for cache folders."""
    digest = hashlib.sha1(f"{PROMPT_TEMPLATE}|{lo}|{hi}|{ops}".encode()).hexdigest()[:8]
    return f"arithmetic-{lo}-{hi}-{digest}"


def problem_key(row: dict) -> tuple[int, str, int]:
    """``(a, op, b)`` of a generated row; use it to build ``exclude`` sets."""
    info = row["extra_info"]
    return (int(info["a"]), str(info["op"]), int(info["b"]))


def make_arithmetic_rows(
    n: int,
    seed: int = 0,
    lo: int = 10,
    hi: int = 99,
    ops: Iterable[str] | str = "+-",
    exclude: Iterable[tuple[int, str, int]] = frozenset(),
    split: str = "train",
    prompt_template: str = PROMPT_TEMPLATE,
) -> list[dict]:
    """Return ``n`` distinct problems ``a op b`` with operands in ``[lo, hi]``.

    Problems whose ``(a, op, b)`` is in ``exclude`` are never produced, so a
    test split can be made disjoint from a train split. Deterministic in
    ``seed``.
    """
    ops = list(dict.fromkeys(ops))  # keep order, drop duplicates
    bad = [o for o in ops if o not in _OPS]
    if not ops or bad:
        raise ValueError(f"ops must be a non-empty subset of {''.join(_OPS)!r}, got {''.join(ops)!r}")
    if lo > hi:
        raise ValueError(f"operand range is empty: min={lo} > max={hi}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    exclude = set(exclude)
    width = hi - lo + 1
    space = width * width * len(ops)
    excluded_in_space = sum(
        1 for (a, op, b) in exclude if op in ops and lo <= a <= hi and lo <= b <= hi
    )
    available = space - excluded_in_space
    if n > available:
        raise ValueError(
            f"cannot make {n} distinct problems: operands {lo}..{hi} with ops {''.join(ops)!r} give "
            f"{space} problems, {excluded_in_space} of them excluded. Widen --min/--max, add ops, "
            "or ask for fewer rows."
        )

    rng = random.Random(seed)
    # Sample problem indices without replacement (range() is not materialised).
    picks = rng.sample(range(space), min(space, n + excluded_in_space))
    rows: list[dict] = []
    for flat in picks:
        if len(rows) == n:
            break
        op_i, rest = divmod(flat, width * width)
        a, b = lo + rest // width, lo + rest % width
        op = ops[op_i]
        if (a, op, b) in exclude:
            continue
        result = _OPS[op](a, b)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": prompt_template.format(a=a, op=op, b=b)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(result)},
                "extra_info": {"split": split, "index": len(rows), "a": a, "b": b, "op": op},
            }
        )
    return rows


def write_arithmetic_dataset(out_dir: str, train_size: int = 600, test_size: int = 200, seed: int = 0,
                             lo: int = DEFAULT_LO, hi: int = DEFAULT_HI, ops: str = "+-") -> tuple[str, str]:
    """Write disjoint ``train.parquet`` / ``test.parquet`` splits; returns their paths.

    Files are written under a temporary name and renamed, so an interrupted write never leaves a
    truncated file that a later run would read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    test = make_arithmetic_rows(test_size, seed=seed + 1, lo=lo, hi=hi, ops=ops, split="test")
    train = make_arithmetic_rows(train_size, seed=seed, lo=lo, hi=hi, ops=ops,
                                 exclude={problem_key(r) for r in test}, split="train")
    paths = []
    for name, rows in (("train", train), ("test", test)):
        path = os.path.join(out_dir, f"{name}.parquet")
        tmp = f"{path}.tmp{os.getpid()}"
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]
