"""The closing summary and the third-party quieting, without running a job."""

from __future__ import annotations

import warnings

from hybrid_rl import console


def summary_of(steps: int, total: int, **kwargs) -> console.RunSummary:
    summary = console.RunSummary(total_steps=total, metrics_file="run/metrics.jsonl", **kwargs)
    summary.add_validation(0, {"val/score/mean": 0.25})
    for step in range(1, steps + 1):
        summary.add_step({"timing_s/step": 2.0, "timing_s/gen": 0.5, "timing_s/update_actor": 1.0,
                          "timing_s/validate": 3.0 if step == 2 else 0.0, "actor/pg_loss": 0.1})
        if step % 2 == 0:
            summary.add_validation(step, {"val/score/mean": 0.25 + 0.1 * step})
    summary.wall_s = 75.4
    return summary


def test_finished_run_reports_phases_scores_and_paths():
    summary = summary_of(4, 4, final_model="run/final_model")
    lines = summary.lines()
    assert lines[0] == "Run summary: finished 4 steps (4 this run) in 1 min 15 s"
    assert lines[1] == "  time per step: 2.00 s (gen 0.50, update_actor 1.00)"
    assert lines[2] == "  also: validate 3.0 s in all"
    assert lines[3] == ("  validation score (val/score/mean): 0.250 at step 0 -> best 0.650 at step 4 -> "
                        "final 0.650 at step 4")
    assert any("run/metrics.jsonl" in line and "plot_metrics.py" in line for line in lines)
    assert any("final model: run/final_model" in line and "vllm serve" in line for line in lines)


def test_stopped_run_without_checkpoints_says_why_nothing_was_kept():
    summary = summary_of(2, 30, stopped_by="SIGINT")
    lines = summary.lines()
    assert lines[0].startswith("Run summary: stopped by SIGINT after step 2 of 30")
    assert "no model was saved: the run stopped before its last step" in lines[-1]


def test_resumed_run_counts_from_its_checkpoint():
    summary = summary_of(2, 6, first_step=5, checkpoint="run/global_step_6")
    assert summary.lines()[0].startswith("Run summary: finished 6 steps (2 this run)")
    assert any("checkpoint:  run/global_step_6" in line and "hybrid-rl-export run/global_step_6" in line for line in summary.lines())


def test_quiet_env_keeps_the_users_settings(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    env = console.quiet_env()
    assert env["VLLM_LOGGING_LEVEL"] == "INFO" and env["TRANSFORMERS_VERBOSITY"] == "error"


def test_third_party_deprecations_are_dropped_and_the_users_kept(monkeypatch):
    for key in console.QUIET_ENV:
        monkeypatch.setenv(key, console.QUIET_ENV[key])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_third_party_output()
        warnings.warn_explicit("old API", FutureWarning, "x.py", 1, module="vllm.triton_utils.dispatcher")
        warnings.warn_explicit("my own", FutureWarning, "y.py", 1, module="my_reward")
    assert [str(w.message) for w in caught] == ["my own"]


class RecordingEnviron(dict):
    """os.environ that lists the variables written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.written = []

    def __setitem__(self, key, value):
        self.written.append(key)
        super().__setitem__(key, value)


def test_a_ray_worker_writes_no_environment_variable_at_run_time(monkeypatch):
    """The worker group sets what the worker's set-up and its vLLM engine need before the process
    starts: writing it at run time could race a read in Ray's metrics thread."""
    import os

    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.controller.worker import set_env
    from hybrid_rl.trainer import worker_env
    from hybrid_rl.workers.rollout import engine_env

    for device in ("cpu", "cuda"):
        cfg = compose_config([f"trainer.device={device}",
                              "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"])
        environ = RecordingEnviron(worker_env(cfg, 2.0))
        monkeypatch.setattr(os, "environ", environ)
        console.quiet_third_party_output()
        set_env(engine_env(cfg.actor_rollout_ref.rollout, device))
        assert environ.written == []
        set_env({"VLLM_LOGGING_LEVEL": "ERROR", "NEW_SETTING": "1"})
        assert environ.written == ["NEW_SETTING"]
