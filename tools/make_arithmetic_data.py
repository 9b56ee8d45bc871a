#!/usr/bin/env python
"""Write the synthetic arithmetic RL data set (verl schema) as parquet.

    python tools/make_arithmetic_data.py --out-dir ~/data/arithmetic

Produces ``train.parquet`` and ``test.parquet``; test problems never appear in
train (compared by ``(a, op, b)``). Train with
``data.train_files=<out>/train.parquet data.val_files=<out>/test.parquet``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid_rl.data.arithmetic import DEFAULT_HI, DEFAULT_LO, write_arithmetic_dataset  # noqa: E402
from hybrid_rl.data.dataset import read_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/data/arithmetic")
    ap.add_argument("--train-size", type=int, default=600)
    ap.add_argument("--test-size", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min", dest="lo", type=int, default=DEFAULT_LO, help="smallest operand")
    ap.add_argument("--max", dest="hi", type=int, default=DEFAULT_HI, help="largest operand")
    ap.add_argument("--ops", default="+-", help="operators to use, a subset of '+-*'")
    args = ap.parse_args(argv)

    train_path, test_path = write_arithmetic_dataset(
        os.path.expanduser(args.out_dir), args.train_size, args.test_size, args.seed,
        args.lo, args.hi, args.ops)
    for path in (train_path, test_path):
        print(f"wrote {path}")
    first = read_rows(train_path)[0]
    print(f"example prompt: {first['prompt'][0]['content']!r} -> {first['reward_model']['ground_truth']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
