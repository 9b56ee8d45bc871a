"""Metric loggers: console, a JSON Lines file in the run folder, and TensorBoard."""

from __future__ import annotations

import json
import math
import os
import time

from tqdm import tqdm

# Shown on the console line of each step (every metric goes to the files).
CONSOLE_KEYS = (
    "critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
    "response_length/mean", "timing_s/step", "perf/throughput",
)


class Tracker:
    def __init__(self, loggers: list[str], run_dir: str, total_steps: int, progress_bar: bool = True):
        self.loggers = set(loggers)
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if "jsonl" in self.loggers else None
        self.tb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self.bar = tqdm(total=total_steps, desc="GRPO", unit="step", dynamic_ncols=True,
                        disable=not progress_bar)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if "console" in self.loggers:
            keys = [k for k in CONSOLE_KEYS if k in metrics] + sorted(k for k in metrics if k.startswith("val"))
            tqdm.write(f"step {step}: " + " | ".join(f"{k}={_fmt(metrics[k])}" for k in keys))

    def advance(self, score: float | None = None) -> None:
        if score is not None:
            self.bar.set_postfix(score=f"{score:.3f}")
        self.bar.update(1)

    def advance_to(self, step: int) -> None:
        """Resume the progress bar at `step` (after loading a checkpoint)."""
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def _fmt(value: float) -> str:
    if isinstance(value, float) and (abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3)) and math.isfinite(value):
        return f"{value:.3e}"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
