"""Synthetic arithmetic problems in verl's RL data schema.

``make_arithmetic_rows`` is used by ``tools/data/arithmetic.py`` to
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
PLAIN_QUESTION = "Calculate {a} {op} {b}."
PROMPT_TEMPLATE = f"{PLAIN_QUESTION} Reply with only the final number."

# How the answer is asked for. "number": as above (the other phrasings ask nothing more), scored by
# the last integer of the response. "tags": every phrasing ends with an R1-Zero-style instruction to
# reason inside <think> and answer inside <answer>; the scorer then reads only the <answer> (and
# the format itself is a reward source of its own, ``reward.funcs=[rule,think_format]``).
TAGS_INSTRUCTION = "Think it through inside <think> </think>, then write only the final number inside <answer> </answer>."
ANSWER_FORMATS = ("number", "tags")

# Other ways to ask the same problems, for training on several phrasings or measuring how far
# what was learnt carries over. Per phrasing and operator, templates drawn at random per row;
# ``{name}`` and ``{item}`` are drawn from NAMES and ITEMS. Subtraction can go below zero, so its
# stories are about quantities that can.
PHRASINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "plain": {op: (PLAIN_QUESTION,) for op in "+-*"},
    "question": {
        "+": ("What is {a} plus {b}?", "How much is {a} added to {b}?"),
        "-": ("What is {a} minus {b}?", "How much is {b} subtracted from {a}?"),
        "*": ("What is {a} times {b}?", "How much is {a} multiplied by {b}?"),
    },
    "words": {
        "+": ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
              "A box holds {a} {item}. {name} puts {b} more {item} into it. How many {item} are in the box now?"),
        "-": ("The temperature was {a} degrees in the morning and fell by {b} degrees by night. What was the "
              "temperature at night?",
              "{name}'s bank balance was {a} dollars. {name} paid a bill of {b} dollars. What is the balance now?"),
        "*": ("There are {a} bags with {b} {item} in each bag. How many {item} are there in all?",
              "{name} buys {a} packs of {item}, each with {b} {item} inside. How many {item} does {name} buy?"),
    },
}
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana")
ITEMS = ("apples", "marbles", "stickers", "pencils", "coins", "shells")

# Held-out sets that differ from the built-in training problems (operands 1-20, plain phrasing)
# in operand range, phrasing or both; each row's data_source is "arithmetic/<name>", so a
# validation over them reports each set on its own. Scored by the arithmetic scorer.
SHIFTED_SETS: dict[str, dict] = {
    "wide": {"lo": 21, "hi": 99, "phrasing": "plain"},
    "question": {"lo": 1, "hi": 99, "phrasing": "question"},
    "words": {"lo": 1, "hi": 99, "phrasing": "words"},
}

# Operand range of the built-in data set: SmolLM2-135M-Instruct solves about a third of these
# greedily, and sampled groups often mix right and wrong answers, which GRPO needs to learn.
DEFAULT_LO, DEFAULT_HI = 1, 20

_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def _template(phrasing: str, op: str, answer_format: str) -> tuple[str, ...]:
    """The templates of one phrasing and operator, with the answer format's instruction."""
    if answer_format == "tags":
        return tuple(f"{t} {TAGS_INSTRUCTION}" for t in PHRASINGS[phrasing][op])
    return (PROMPT_TEMPLATE,) if phrasing == "plain" else PHRASINGS[phrasing][op]


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
    phrasing: str = "plain",
    data_source: str = DATA_SOURCE,
    answer_format: str = "number",
) -> list[dict]:
    """Return ``n`` distinct problems ``a op b`` with operands in ``[lo, hi]``, asked in one of
    the ``PHRASINGS``, the answer asked for in one of the ``ANSWER_FORMATS``.

    Problems whose ``(a, op, b)`` is in ``exclude`` are never produced, so a
    test split can be made disjoint from a train split. Deterministic in
    ``seed``.
    """
    if phrasing not in PHRASINGS:
        raise ValueError(f"phrasing must be one of {', '.join(PHRASINGS)}, got {phrasing!r}")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")
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
    # A generator of its own, so the plain phrasing's problems do not depend on it.
    wording = random.Random(f"{seed}-{phrasing}")
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
        template = wording.choice(_template(phrasing, op, answer_format))
        text = template.format(a=a, op=op, b=b, name=wording.choice(NAMES), item=wording.choice(ITEMS))
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": text}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(result)},
                "extra_info": {"split": split, "index": len(rows), "a": a, "b": b, "op": op, "phrasing": phrasing,
                               "answer_format": answer_format},
            }
        )
    return rows


def write_rows(path: str, rows: list[dict]) -> str:
    """Write rows as parquet under a temporary name and rename it, so an interrupted write never
    leaves a truncated file that a later run would read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
    return path


def write_arithmetic_dataset(out_dir: str, train_size: int = 600, test_size: int = 200, seed: int = 0,
                             lo: int = DEFAULT_LO, hi: int = DEFAULT_HI, ops: str = "+-",
                             phrasing: str = "plain", answer_format: str = "number") -> tuple[str, str]:
    """Write disjoint ``train.parquet`` / ``test.parquet`` splits; returns their paths."""
    test = make_arithmetic_rows(test_size, seed=seed + 1, lo=lo, hi=hi, ops=ops, split="test", phrasing=phrasing,
                                answer_format=answer_format)
    train = make_arithmetic_rows(train_size, seed=seed, lo=lo, hi=hi, ops=ops, phrasing=phrasing,
                                 exclude={problem_key(r) for r in test}, split="train", answer_format=answer_format)
    return (write_rows(os.path.join(out_dir, "train.parquet"), train),
            write_rows(os.path.join(out_dir, "test.parquet"), test))


def shifted_rows(size: int, seed: int, ops: str = "+-", exclude: Iterable[tuple[int, str, int]] = frozenset(),
                 answer_format: str = "number") -> list[dict]:
    """``size`` problems of each of the ``SHIFTED_SETS``, none of them in ``exclude``."""
    rows = []
    for i, (name, spec) in enumerate(SHIFTED_SETS.items()):
        rows += make_arithmetic_rows(size, seed=seed + 100 + i, ops=ops, exclude=exclude, split="test",
                                     data_source=f"{DATA_SOURCE}/{name}", answer_format=answer_format, **spec)
    return rows
