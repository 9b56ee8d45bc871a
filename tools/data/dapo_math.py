#!/usr/bin/env python
"""DAPO's math data: DAPO-Math-17k (training) and AIME 2024 (evaluation), as the DAPO authors
publish them, already in verl's schema (data source math_dapo, scored by the built-in
`math_answer` scorer: the response's last "Answer:" line).

    python tools/data/dapo_math.py --out-dir ~/data/dapo                   # from the hub (network)
    python tools/data/dapo_math.py --out-dir ~/data/dapo --train-file dapo-math-17k.parquet --test-file aime-2024.parquet

Writes dapo-math-17k.parquet and aime-2024.parquet. --unique keeps one row per distinct prompt
(the published training file repeats its prompts).
"""

from __future__ import annotations

import argparse
import json
import os

from common import source_rows, write_rows

FILES = {"train": ("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet", "dapo-math-17k.parquet"),
         "test": ("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet", "aime-2024.parquet")}
COLUMNS = ("prompt", "data_source", "reward_model")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="~/data/dapo")
    ap.add_argument("--train-file", default=None)
    ap.add_argument("--test-file", default=None)
    ap.add_argument("--unique", action="store_true", help="one row per distinct prompt")
    args = ap.parse_args(argv)
    for split, local in (("train", args.train_file), ("test", args.test_file)):
        repo_id, hub_file, name = FILES[split]
        rows = source_rows(local, repo_id, hub_file)
        missing = [column for column in COLUMNS if column not in rows[0]]
        if missing:
            raise SystemExit(f"error: {local or repo_id} has no {', '.join(missing)} column: it is not in verl's schema "
                             f"(columns: {', '.join(rows[0])}).")
        if args.unique:
            rows = list({json.dumps(row["prompt"], sort_keys=True, default=str): row for row in rows}.values())
        path = write_rows(os.path.join(os.path.expanduser(args.out_dir), name), rows)
        print(f"wrote {path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
