"""Three-digit sums and differences for the tool-calling recipe (recipes/retool), in verl's schema;
needs no network.

    python tools/data/tool_calculator.py --out-dir ~/data/tool_calculator

Writes ``train.parquet`` (512 problems) and ``test.parquet`` (64 held-out problems), operands
100-999, each asked with an example of the calculator call that solves it; ``train_mixed.parquet``,
the same training problems with every other one asked plainly, without the example; and
``plain.parquet``: the test problems asked plainly (data source ``arithmetic/plain``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hybrid_rl.data.arithmetic import make_arithmetic_rows, problem_key, write_rows  # noqa: E402

HINT = ('Calculate {a} {op} {b}. Use the calculator: write <tool_call>{{"name": "calculator", "arguments": '
        '{{"expression": "{a} {op} {b}"}}}}</tool_call>, read its answer, then reply with only the final number.')


def with_hint(row: dict) -> dict:
    return {**row, "prompt": [{"role": "user", "content": HINT.format(**row["extra_info"])}]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/data/tool_calculator")
    ap.add_argument("--train-size", type=int, default=512)
    ap.add_argument("--test-size", type=int, default=64)
    args = ap.parse_args(argv)
    out = os.path.expanduser(args.out_dir)
    test = make_arithmetic_rows(args.test_size, seed=1, lo=100, hi=999, split="test")
    plain = make_arithmetic_rows(args.test_size, seed=1, lo=100, hi=999, split="test", data_source="arithmetic/plain")
    train = make_arithmetic_rows(args.train_size, seed=0, lo=100, hi=999, exclude={problem_key(r) for r in test})
    hinted = [with_hint(row) for row in train]
    mixed = [with_hint(row) if i % 2 == 0 else row for i, row in enumerate(train)]
    for name, rows in (("train", hinted), ("train_mixed", mixed), ("test", [with_hint(row) for row in test]),
                       ("plain", plain)):
        print(f"wrote {write_rows(os.path.join(out, f'{name}.parquet'), rows)}")
    print(f"example prompt: {hinted[0]['prompt'][0]['content']!r} -> {hinted[0]['reward_model']['ground_truth']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
