#!/usr/bin/env python
"""Plot training reward and validation accuracy per step from a run's metrics.jsonl.

    python tools/plot_metrics.py runs/hybrid_rl/arithmetic_grpo/metrics.jsonl -o docs/figures/run.png
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--title", default="GRPO")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(args.metrics)]
    train = [(r["step"], r["critic/score/mean"]) for r in rows if "critic/score/mean" in r]
    val = [(r["step"], r["val/score/mean"]) for r in rows if "val/score/mean" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="training reward (mean over samples)", color="tab:blue", alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation accuracy (greedy)", color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
