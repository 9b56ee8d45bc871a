#!/usr/bin/env python
"""Plot metrics per step from one or more runs' metrics.jsonl, one panel per metric.

    python tools/plot_metrics.py runs/hybrid_rl/arithmetic_grpo/metrics.jsonl -o docs/figures/run.png
    python tools/plot_metrics.py runs/a/metrics.jsonl:GRPO runs/b/metrics.jsonl:DAPO -o cmp.png \\
        --metrics actor/entropy critic/score/zero_variance_groups 'val-core/*'

A file may carry a label after a colon. Metrics are names or shell-style patterns (`val-core/*`:
every validation score per data source); by default the training reward and the validation score.
Validation metrics, logged every few steps, are drawn with markers.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os

DEFAULT_METRICS = ("critic/score/mean", "val/score/mean")


def read_run(spec: str) -> tuple[str, list[dict]]:
    """(label, rows) of `file[:label]`; the label defaults to the run folder's name."""
    path, _, label = spec.partition(":") if not os.path.exists(spec) else (spec, "", "")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return label or os.path.basename(os.path.dirname(os.path.abspath(path))), rows


def expand(patterns: list[str], runs: list[tuple[str, list[dict]]]) -> list[str]:
    """The metric names the patterns match in any run, in the patterns' order."""
    names = list(dict.fromkeys(key for _, rows in runs for row in rows for key in row))
    found = []
    for pattern in patterns:
        found += [name for name in names if fnmatch.fnmatchcase(name, pattern) and name not in found]
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics_files", nargs="+", metavar="metrics.jsonl[:label]")
    ap.add_argument("-o", "--output", default=None, help="the image (default: metrics.png beside the first file)")
    ap.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(spec) for spec in args.metrics_files]
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(args.metrics_files[0].split(":")[0])),
                                         "metrics.png")
    metrics = expand(args.metrics, runs)
    if not metrics:
        raise SystemExit(f"error: no metric matches {args.metrics} in {args.metrics_files}")
    columns = min(3, len(metrics))
    rows = math.ceil(len(metrics) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for i, (label, run) in enumerate(runs):  # one colour per run in every panel
            points = [(row["step"], row[metric]) for row in run if metric in row]
            sparse = len(points) < len([row for row in run if "step" in row]) / 2
            if points:
                ax.plot(*zip(*points), "o-" if sparse else "-", color=f"C{i % 10}", label=label, alpha=0.85,
                        markersize=4)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    # Every run in the legend, also those without the first panel's metric.
    from matplotlib.lines import Line2D

    axes.flat[0].legend(handles=[Line2D([], [], color=f"C{i % 10}", label=label) for i, (label, _) in enumerate(runs)],
                        fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
