#!/usr/bin/env python
"""Time each phase of a GRPO step (generate, reward, old log-prob, reference, update, sync).

    python tools/bench/step_phases.py [--steps 4] [--json out.json] [dotted overrides ...]

Runs the default job (or the one the overrides describe) for a few steps without validation and
prints the mean time of each phase over the steps after the first (which includes warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from hybrid_rl.main import build_trainer, compose_config

    run_dir = tempfile.mkdtemp(prefix="bench_steps_")
    cfg = compose_config([f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false",
                          "trainer.test_freq=-1", "data.val_files=null", "trainer.logger=[jsonl]",
                          f"trainer.default_local_dir={run_dir}", "trainer.progress_bar=false", *args.overrides])
    # The built-in data set brings its own validation split: keep the timing free of it.
    cfg.data.val_max_samples = 1
    trainer = build_trainer(cfg)
    trainer.val_dataset = None
    trainer.fit()
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    measured = rows[1:] if len(rows) > 1 else rows
    result = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "steps_measured": len(measured),
        "sequences_per_step": cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n,
        "phase_seconds": {p: sum(r.get(f"timing_s/{p}", 0.0) for r in measured) / len(measured) for p in PHASES},
        "tokens_per_second": sum(r["perf/throughput"] for r in measured) / len(measured),
    }
    step = result["phase_seconds"]["step"]
    print(f"{'phase':<16}{'seconds':>10}{'share':>8}")
    for phase, seconds in result["phase_seconds"].items():
        print(f"{phase:<16}{seconds:>10.2f}{seconds / step:>8.1%}")
    print(f"tokens/s per rank: {result['tokens_per_second']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    trainer.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
