#!/usr/bin/env python
"""MATH (Hendrycks et al. 2021) to train on and MATH-500 to evaluate on, in verl's schema, scored by
the built-in LaTeX math scorer (math-verify; hybrid_rl/rewards/math_verified.py).

    python tools/data/hendrycks_math.py --out-dir ~/data/math                        # from the hub (network)
    python tools/data/hendrycks_math.py --out-dir ~/data/math --levels 3 4 5 --template qwen-math
    python tools/data/hendrycks_math.py --out-dir ~/data/math --train-file train.parquet --test-file math500.jsonl

Training rows come from the hub dataset DigitalLearningGmbH/MATH-lighteval (or a local file with
its columns problem, solution, level, type: the ground truth is the solution's last \\boxed{}),
test rows from HuggingFaceH4/MATH-500 (columns problem, answer, level, subject; a file with a
solution column instead of answer works too). --levels keeps the problems of those difficulty
levels (Dr. GRPO trains on levels 3-5). --template picks how the problem is asked: `verl` appends
verl's instruction to the question; `qwen-math` puts the Qwen2.5-Math system prompt before it.
Writes train.parquet and test.parquet.
"""

from __future__ import annotations

import argparse
import os
import re

from common import source_rows, write_rows

from hybrid_rl.rewards.math_verified import last_boxed

SOURCES = {"train": ("DigitalLearningGmbH/MATH-lighteval", "data/train-00000-of-00001.parquet"),
           "test": ("HuggingFaceH4/MATH-500", "test.jsonl")}
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def level_of(row: dict) -> int | None:
    """The difficulty level 1-5 of a row ("Level 3" in MATH, 3 in MATH-500; None when unknown)."""
    found = re.search(r"\d", str(row.get("level", "")))
    return int(found.group()) if found else None


def prompt_of(problem: str, template: str) -> list[dict]:
    if template == "qwen-math":
        return [{"role": "system", "content": QWEN_MATH_SYSTEM}, {"role": "user", "content": problem}]
    return [{"role": "user", "content": f"{problem} {INSTRUCTION}"}]


def convert(rows: list[dict], split: str, data_source: str, levels: set[int] | None, template: str) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        if "problem" not in row:
            raise SystemExit(f"error: {split} row {index} has no problem column (columns: {', '.join(row)}); "
                             "expected MATH's columns problem and solution (or answer).")
        level = level_of(row)
        if levels is not None and level not in levels:
            continue
        truth = row.get("answer") or last_boxed(row.get("solution") or "")
        if not truth:
            raise SystemExit(f"error: {split} row {index} has neither an answer nor a \\boxed{{}} answer in its "
                             f"solution: {row!r:.200}")
        out.append({"data_source": data_source, "prompt": prompt_of(row["problem"], template), "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": truth},
                    "extra_info": {"split": split, "index": index, "level": level,
                                   "type": row.get("type") or row.get("subject")}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/data/math")
    ap.add_argument("--train-file", default=None)
    ap.add_argument("--test-file", default=None)
    ap.add_argument("--levels", type=int, nargs="+", choices=range(1, 6), default=None,
                    help="keep only training problems of these levels (default: all)")
    ap.add_argument("--template", choices=("verl", "qwen-math"), default="verl")
    args = ap.parse_args(argv)
    for split, local in (("train", args.train_file), ("test", args.test_file)):
        data_source, hub_file = SOURCES[split]
        levels = set(args.levels) if args.levels and split == "train" else None
        rows = convert(source_rows(local, data_source, hub_file), split, data_source, levels, args.template)
        if not rows:
            raise SystemExit(f"error: no {split} problem is of level {' or '.join(map(str, sorted(levels)))}.")
        path = write_rows(os.path.join(os.path.expanduser(args.out_dir), f"{split}.parquet"), rows)
        print(f"wrote {path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
