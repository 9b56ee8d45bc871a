#!/usr/bin/env python
"""GSM8K in verl's schema (data source openai/gsm8k, scored by the built-in GSM8K scorer).

    python tools/data/gsm8k.py --out-dir ~/data/gsm8k                      # from the hub (network)
    python tools/data/gsm8k.py --out-dir ~/data/gsm8k --train-file train.jsonl --test-file test.jsonl

Local files are the dataset's own rows (question, answer; parquet or JSON Lines). Each prompt is
the question and an instruction to end with "#### <answer>", the format the strict scorer reads;
the ground truth is the number after the reference solution's "####".
"""

from __future__ import annotations

import argparse
import os

from common import source_rows, write_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
HUB_FILES = {"train": "main/train-00000-of-00001.parquet", "test": "main/test-00000-of-00001.parquet"}


def convert(rows: list[dict], split: str) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        if "####" not in row.get("answer", ""):
            raise SystemExit(f"error: {split} row {index} has no '#### <answer>' in its answer column: {row!r:.200}")
        truth = row["answer"].split("####")[-1].strip().replace(",", "")
        out.append({"data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
                    "extra_info": {"split": split, "index": index, "question": row["question"],
                                   "answer": row["answer"]}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/data/gsm8k")
    ap.add_argument("--train-file", default=None)
    ap.add_argument("--test-file", default=None)
    args = ap.parse_args(argv)
    for split, local in (("train", args.train_file), ("test", args.test_file)):
        rows = convert(source_rows(local, "openai/gsm8k", HUB_FILES[split]), split)
        print(f"wrote {write_rows(os.path.join(os.path.expanduser(args.out_dir), f'{split}.parquet'), rows)} "
              f"({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
