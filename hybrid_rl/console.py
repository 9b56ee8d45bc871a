"""What a person sees on the terminal: third-party noise held back, and the summary that ends a
run.

Held back by default (each variable can still be set by the user): vLLM's warnings
(`VLLM_LOGGING_LEVEL=ERROR`: Triton, tcmalloc, thread-binding advice), transformers' per-load
progress bars and advice, torch's C++ warnings (NUMA binding) and the deprecation warnings that
libraries raise about each other. Errors always come through.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field

PLOT_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "plot_metrics.py")

QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}
THIRD_PARTY = r"(vllm|torch|transformers|ray|tensordict|triton|hydra|omegaconf|accelerate|gguf)(\.|$)"


def quiet_env() -> dict[str, str]:
    """QUIET_ENV, where the user has not set the variable already."""
    return {key: os.environ.get(key, value) for key, value in QUIET_ENV.items()}


def quiet_third_party_output() -> None:
    """Apply `quiet_env` to this process (before the libraries read it) and drop the deprecation
    warnings that third-party modules raise; a user's own code still gets its warnings."""
    from hybrid_rl.controller.worker import set_env

    set_env(quiet_env())
    # vLLM configures its logger on first use; a warning raised while it is being imported would
    # bypass the level above.
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY)


@dataclass
class RunSummary:
    """What `Trainer.fit` did, for the closing lines."""

    steps_done: int = 0
    total_steps: int = 0
    first_step: int = 1  # 1, or the step after the checkpoint a run resumed from
    wall_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)  # timing_s/<phase> summed over steps
    val_scores: list[tuple[int, float]] = field(default_factory=list)  # (step, val/score/mean)
    stopped_by: str | None = None  # "SIGINT" / "SIGTERM" when a signal ended the run early
    metrics_file: str | None = None
    checkpoint: str | None = None  # the newest complete checkpoint
    final_model: str | None = None

    def add_step(self, metrics: dict[str, float]) -> None:
        self.steps_done += 1
        for key, value in metrics.items():
            if key.startswith("timing_s/"):
                name = key.removeprefix("timing_s/")
                self.phase_s[name] = self.phase_s.get(name, 0.0) + float(value)

    def add_validation(self, step: int, metrics: dict[str, float]) -> None:
        if "val/score/mean" in metrics:
            self.val_scores.append((step, float(metrics["val/score/mean"])))

    def lines(self) -> list[str]:
        last = self.first_step + self.steps_done - 1
        head = (f"stopped by {self.stopped_by} after step {last} of {self.total_steps}" if self.stopped_by
                else f"finished {self.total_steps} steps" if last == self.total_steps
                else f"ran steps {self.first_step}-{last} of {self.total_steps}")
        out = [f"Run summary: {head} ({self.steps_done} this run) in {_duration(self.wall_s)}"]
        steps = self.phase_s.get("step")
        if steps is not None and self.steps_done:
            parts = [f"{name} {seconds / self.steps_done:.2f}" for name, seconds in self.phase_s.items()
                     if name not in ("step", "validate", "save_checkpoint")]
            out.append(f"  time per step: {steps / self.steps_done:.2f} s ({', '.join(parts)})")
        extra = [f"{name} {_duration(self.phase_s[name])}" for name in ("validate", "save_checkpoint")
                 if name in self.phase_s]
        if extra:
            out.append(f"  also: {', '.join(extra)} in all")
        if self.val_scores:
            first, final = self.val_scores[0], self.val_scores[-1]
            best = max(self.val_scores, key=lambda s: s[1])
            out.append(f"  validation score (val/score/mean): {first[1]:.3f} at step {first[0]} -> best "
                       f"{best[1]:.3f} at step {best[0]} -> final {final[1]:.3f} at step {final[0]}")
        if self.metrics_file:
            # The plotting tool lives in a checkout's tools/, not in an installed package.
            plot = f" (plot: python tools/plot_metrics.py {self.metrics_file})" if os.path.isfile(PLOT_TOOL) else ""
            out.append(f"  metrics:     {self.metrics_file}{plot}")
        if self.checkpoint:
            out.append(f"  checkpoint:  {self.checkpoint} (rerun the same command to resume; export: "
                       f"hybrid-rl-export {self.checkpoint} <out_dir>)")
        if self.final_model:
            out.append(f"  final model: {self.final_model} (Hugging Face folder; serve: vllm serve "
                       f"{self.final_model})")
        elif not self.checkpoint:
            why = ("the run stopped before its last step" if self.stopped_by or last < self.total_steps
                   else "trainer.final_model_dir=null")
            out.append(f"  no model was saved: {why} and checkpointing is off (set trainer.save_freq to keep "
                       "checkpoints)")
        return out


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{seconds:.1f} s"
