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

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from hybrid_rl.data.arithmetic import make_arithmetic_rows, problem_key  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/data/arithmetic")
    ap.add_argument("--train-size", type=int, default=2000)
    ap.add_argument("--test-size", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min", dest="lo", type=int, default=10, help="smallest operand")
    ap.add_argument("--max", dest="hi", type=int, default=99, help="largest operand")
    ap.add_argument("--ops", default="+-", help="operators to use, a subset of '+-*'")
    args = ap.parse_args(argv)

    out_dir = os.path.expanduser(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    test = make_arithmetic_rows(args.test_size, seed=args.seed + 1, lo=args.lo, hi=args.hi,
                                ops=args.ops, split="test")
    train = make_arithmetic_rows(args.train_size, seed=args.seed, lo=args.lo, hi=args.hi,
                                 ops=args.ops, exclude={problem_key(r) for r in test}, split="train")
    for name, rows in (("train", train), ("test", test)):
        path = os.path.join(out_dir, f"{name}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
        print(f"wrote {len(rows)} rows to {path}")
    print(f"example prompt: {train[0]['prompt'][0]['content']!r} -> {train[0]['reward_model']['ground_truth']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
