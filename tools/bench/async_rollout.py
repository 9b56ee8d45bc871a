#!/usr/bin/env python
"""Asynchronous training against the colocated trainer on the same work: steps per hour and the
learning curve of each.

    python tools/bench/async_rollout.py [--staleness 1] [--json out.json] [dotted overrides ...]

Runs the default job (or the one the overrides describe) twice through the driver, with the same
seeds: colocated (`actor_rollout_ref.hybrid_engine=true`) and with a rollout pool of its own
(`hybrid_engine=false rollout.max_staleness=S`), one after the other, each in a fresh process.
Reports per run the wall time of the training steps (the sum of `timing_s/step`, validation
excluded), steps per hour, the mean of each phase over the steps after the first, the
validation scores, and the mean training score per 10 steps (the curve per sample: both runs
train on the same number of samples per step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PHASES = ("gen", "reward", "ref", "adv", "update_actor", "update_weights", "step")


def run(name: str, overrides: list[str], folder: str) -> dict:
    run_dir = os.path.join(folder, name)
    cmd = [sys.executable, "-m", "hybrid_rl.main", *overrides, f"trainer.default_local_dir={run_dir}",
           "trainer.final_model_dir=null", "trainer.progress_bar=false", "trainer.logger=[jsonl]"]
    subprocess.run(cmd, cwd=common.REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    steps = [line for line in lines if "timing_s/step" in line]
    later = steps[1:]
    seconds = sum(line["timing_s/step"] for line in steps)
    scores = [line["critic/score/mean"] for line in steps]
    return {
        "overrides": overrides,
        "steps": len(steps),
        "train_seconds": round(seconds, 2),
        "steps_per_hour": round(3600 * len(steps) / seconds, 1),
        "phase_means_s": {phase: round(sum(line.get(f"timing_s/{phase}", 0.0) for line in later) / len(later), 3)
                          for phase in PHASES},
        "staleness_mean": (sum(line.get("async/staleness", 0.0) for line in steps) / len(steps)),
        "validation": {line["step"]: round(line["val/score/mean"], 4) for line in lines if "val/score/mean" in line},
        "train_score_per_10_steps": [round(sum(scores[i:i + 10]) / len(scores[i:i + 10]), 4)
                                     for i in range(0, len(scores), 10)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--json")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as folder:
        results = {
            "colocated": run("colocated", overrides, folder),
            f"pool_staleness_{args.staleness}": run(
                "pool", [*overrides, "actor_rollout_ref.hybrid_engine=false",
                         f"rollout.max_staleness={args.staleness}"], folder),
        }
    for name, result in results.items():
        print(f"{name}: {result['steps_per_hour']} steps/h ({result['train_seconds']} s for {result['steps']} steps), "
              f"phases {result['phase_means_s']}, validation {result['validation']}, "
              f"train score per 10 steps {result['train_score_per_10_steps']}")
    common.write_json(args.json, {**common.header({"staleness": args.staleness, "overrides": overrides}),
                                  "results": results})


if __name__ == "__main__":
    main()
