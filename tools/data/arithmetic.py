#!/usr/bin/env python
"""Write the synthetic arithmetic RL data set (verl's schema) as parquet; needs no network.

    python tools/data/arithmetic.py --out-dir ~/data/arithmetic [--min 1 --max 20 --ops +- --phrasing plain]

Writes ``train.parquet`` and ``test.parquet`` (test problems never appear in train, compared by
``(a, op, b)``) and ``shifted.parquet``: held-out problems that differ from the built-in
training problems in operand range or phrasing (``hybrid_rl.data.arithmetic.SHIFTED_SETS``; data
sources ``arithmetic/wide``, ``arithmetic/question``, ``arithmetic/words``), none of them in
train. Train with ``data.train_files=<out>/train.parquet data.val_files=<out>/test.parquet``;
validate on both with ``data.val_files='[<out>/test.parquet,<out>/shifted.parquet]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hybrid_rl.data.arithmetic import (  # noqa: E402
    ANSWER_FORMATS, DEFAULT_HI, DEFAULT_LO, PHRASINGS, problem_key, shifted_rows, write_arithmetic_dataset, write_rows,
)
from hybrid_rl.data.dataset import read_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/data/arithmetic")
    ap.add_argument("--train-size", type=int, default=600)
    ap.add_argument("--test-size", type=int, default=200)
    ap.add_argument("--shifted-size", type=int, default=64, help="problems in each held-out shifted set (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min", dest="lo", type=int, default=DEFAULT_LO, help="smallest operand")
    ap.add_argument("--max", dest="hi", type=int, default=DEFAULT_HI, help="largest operand")
    ap.add_argument("--ops", default="+-", help="operators to use, a subset of '+-*'")
    ap.add_argument("--phrasing", default="plain", choices=sorted(PHRASINGS), help="how the problems are asked")
    ap.add_argument("--answer-format", default="number", choices=ANSWER_FORMATS,
                    help="number: reply with the number; tags: reason in <think>, answer in <answer> (R1-Zero)")
    args = ap.parse_args(argv)

    out = os.path.expanduser(args.out_dir)
    paths = list(write_arithmetic_dataset(out, args.train_size, args.test_size, args.seed, args.lo, args.hi,
                                          args.ops, args.phrasing, args.answer_format))
    if args.shifted_size:
        train = {problem_key(row) for row in read_rows(paths[0])}
        paths.append(write_rows(os.path.join(out, "shifted.parquet"),
                                shifted_rows(args.shifted_size, args.seed, args.ops, exclude=train,
                                             answer_format=args.answer_format)))
    for path in paths:
        print(f"wrote {path}")
    first = read_rows(paths[0])[0]
    print(f"example prompt: {first['prompt'][0]['content']!r} -> {first['reward_model']['ground_truth']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
