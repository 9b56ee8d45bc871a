#!/usr/bin/env python
"""Write the countdown task (TinyZero's R1-Zero reproduction) in verl's schema; needs no network.

    python tools/data/countdown.py --out-dir ~/data/countdown [--counts 3 4 --min 1 --max 100]

Writes ``train.parquet`` and ``test.parquet`` (no (numbers, target) pair in both), every problem
built from a random equation so it has a solution. Scored by the built-in ``countdown`` scorer:
1 when the last <answer> block holds an equation that uses each number once and hits the target
(combine it with the format rewards ``think_format`` / ``think_tags`` in ``reward.funcs``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hybrid_rl.data.arithmetic import write_rows  # noqa: E402
from hybrid_rl.data.countdown import make_countdown_rows, problem_key  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/data/countdown")
    ap.add_argument("--train-size", type=int, default=10000)
    ap.add_argument("--test-size", type=int, default=500)
    ap.add_argument("--counts", type=int, nargs="+", default=[3, 4], help="how many numbers a problem gives")
    ap.add_argument("--min", dest="lo", type=int, default=1, help="smallest number")
    ap.add_argument("--max", dest="hi", type=int, default=100, help="largest number")
    ap.add_argument("--max-target", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    out = os.path.expanduser(args.out_dir)
    spec = dict(counts=tuple(args.counts), lo=args.lo, hi=args.hi, max_target=args.max_target)
    try:
        test = make_countdown_rows(args.test_size, seed=args.seed + 1, split="test", **spec)
        train = make_countdown_rows(args.train_size, seed=args.seed, exclude={problem_key(r) for r in test}, **spec)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    for name, rows in (("train", train), ("test", test)):
        print(f"wrote {write_rows(os.path.join(out, f'{name}.parquet'), rows)}")
    print(f"example prompt: {train[0]['prompt'][0]['content']!r} (one solution: {train[0]['extra_info']['solution']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
