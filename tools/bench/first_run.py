#!/usr/bin/env python
"""The default job as a user starts it: time to the first finished step, with cold and warm
caches, and the run's step breakdown.

    python tools/bench/first_run.py [--runs cold,warm] [--engine eager|compiled] [--stop-after STEP]
                                    [--signal INT|TERM] [--json out.json] [dotted overrides ...]

Each run is `python -m hybrid_rl.main` in a fresh process (its own run folder); every figure is
the time at which a line of its output appeared, counted from the process start:

- `driver_ready_s`: the `compute dtype ...` line (config checked, dtype resolved);
- `first_validation_s`: the `step 0:` line (workers, engine and the validation before training);
- `first_step_s`: the `step 1:` line, the first finished training step;
- `total_s`: the process's exit.

`cold` starts with empty caches in a fresh temporary folder: hybrid-rl's (the GGUF model is
converted, the data set written), vLLM's and inductor's; `warm` runs again on the caches the cold
run filled (a `warm` with no `cold` before it uses the user's own caches). The OS page cache is not dropped (that needs the host), so `cold` still finds the
Python packages in memory. From `metrics.jsonl` come the median of each phase over the steps
after the first, and the validation scores.

`--stop-after STEP` sends SIGINT (or `--signal TERM`) to the driver `--stop-delay` seconds (1 by
default, so the next step has begun) after step STEP is logged, and reports `stop_s`, the time
from the signal to the process's exit: the rest of the step in progress, a checkpoint when
`trainer.save_freq > 0`, and the shutdown.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MARKS = {"driver_ready_s": "compute dtype ", "first_validation_s": "step 0: ", "first_step_s": "step 1: "}


def timed_run(overrides: list[str], cache_root: str | None, run_dir: str, stop_after: int | None = None,
              signum: int = signal.SIGINT, stop_delay: float = 1.0) -> dict:
    env = dict(os.environ)
    if cache_root is not None:
        env.update(HYBRID_RL_CACHE=os.path.join(cache_root, "hybrid_rl"), VLLM_CACHE_ROOT=os.path.join(cache_root, "vllm"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_root, "inductor"))
    cmd = [sys.executable, "-m", "hybrid_rl.main", f"trainer.default_local_dir={run_dir}", *overrides]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=common.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    marks: dict[str, float] = {}
    lines: list[str] = []
    stop_mark = f"step {stop_after}: " if stop_after is not None else None

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            for key, text in MARKS.items():
                if key not in marks and text in line:
                    marks[key] = time.perf_counter() - start
            if stop_mark and stop_mark in line and not stopper_started:
                stopper_started.append(True)
                stopper.start()

    def stop() -> None:
        marks["signal_s"] = time.perf_counter() - start
        proc.send_signal(signum)

    stopper, stopper_started = threading.Timer(stop_delay, stop), []

    reader = threading.Thread(target=read)
    reader.start()
    proc.wait()
    reader.join()
    if stopper_started:
        stopper.join()
    total = time.perf_counter() - start
    result = {"returncode": proc.returncode, **{k: round(v, 1) for k, v in marks.items()},
              "total_s": round(total, 1), "output_lines": len(lines)}
    if "signal_s" in marks:
        result["stop_s"] = round(total - marks["signal_s"], 1)
    if proc.returncode != (128 + signum if stop_after is not None else 0):
        result["output_tail"] = lines[-30:]
        return result
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if r["step"] > 0]
    later = steps[1:] or steps
    phases = sorted({k for r in later for k in r if k.startswith("timing_s/")})
    result["steps"] = len(steps)
    result["median_phase_s"] = {k.removeprefix("timing_s/"): round(statistics.median(r[k] for r in later if k in r), 2)
                                for k in phases}
    result["val_scores"] = {r["step"]: round(r["val/score/mean"], 4) for r in rows if "val/score/mean" in r}
    result["summary"] = lines[next((i for i, line in enumerate(lines) if line.startswith("Run summary:")), len(lines)):]
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="cold,warm", help="comma-separated: cold (fresh caches), warm (reuse them)")
    ap.add_argument("--engine", choices=("default", "eager", "compiled"), default="default",
                    help="rollout.enforce_eager: the default (eager on CPU), true or false")
    ap.add_argument("--stop-after", type=int, help="signal the driver once this step is logged")
    ap.add_argument("--signal", choices=("INT", "TERM"), default="INT", help="the signal --stop-after sends")
    ap.add_argument("--stop-delay", type=float, default=1.0, help="seconds between the step's line and the signal")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, as for hybrid_rl.main")
    args = ap.parse_args(argv)
    overrides = list(args.overrides)
    if args.engine != "default":
        overrides.append(f"actor_rollout_ref.rollout.enforce_eager={args.engine == 'eager'}")
    signum = getattr(signal, f"SIG{args.signal}")
    result = common.header({"runs": args.runs, "engine": args.engine, "overrides": overrides,
                            "stop_after": args.stop_after, "signal": args.signal, "stop_delay": args.stop_delay})
    result["runs"] = []
    with tempfile.TemporaryDirectory(prefix="first_run_") as tmp:
        cache_root = None  # the user's caches, until a cold run asks for fresh ones
        for i, kind in enumerate(args.runs.split(",")):
            if kind == "cold":
                cache_root = os.path.join(tmp, f"cache{i}")
            run = {"kind": kind, **timed_run(overrides, cache_root, os.path.join(tmp, f"run{i}"), args.stop_after,
                                             signum, args.stop_delay)}
            result["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "summary"}))
            for line in run.get("summary", []):
                print("   ", line)
    common.write_json(args.json, result)
    expected = 128 + signum if args.stop_after is not None else 0
    return 0 if all(r["returncode"] == expected for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
