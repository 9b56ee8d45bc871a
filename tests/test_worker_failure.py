"""A worker process killed mid-run: with trainer.max_restarts the driver restarts the workers from
the last checkpoint; once the restarts are spent it names the worker, node and step and exits
non-zero within a minute."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hybrid_rl.checkpoint import POINTER
from hybrid_rl.main import REPO_ROOT
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

STEPS = 6  # the second kill, after checkpoint 3, lands with steps still to run


def start(model_dir, files, run_dir, max_restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hybrid_rl.main", *run_overrides(model_dir, files, run_dir, response=12),
           f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.val_before_train=false",
           "trainer.test_freq=-1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
           "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
           "actor_rollout_ref.rollout.name=hf", "trainer.n_gpus_per_node=2", "trainer.cpus_per_worker=1",
           f"trainer.max_restarts={max_restarts}"]
    # Output to a file: a pipe nobody reads while the test waits could fill up and stall the run.
    log = open(run_dir / "run.log", "w")
    return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def is_live_worker(process: psutil.Process) -> bool:
    try:
        return (process.status() != psutil.STATUS_ZOMBIE
                and any("ray::Colocated" in part for part in process.cmdline()))
    except psutil.NoSuchProcess:
        return False


def kill_a_worker_after_checkpoint(proc: subprocess.Popen, run_dir, step: int) -> float:
    """SIGKILL one worker process (a descendant of the driver) once checkpoint `step` exists and
    the group's two workers are alive (after a restart, the killed group's processes may linger)."""
    deadline = time.time() + 600
    pointer, workers = run_dir / POINTER, []
    while time.time() < deadline and proc.poll() is None:
        if pointer.is_file() and int(pointer.read_text() or 0) >= step:
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if is_live_worker(p)]
            if len(workers) == 2:
                break
        time.sleep(0.05)
    assert proc.poll() is None and len(workers) == 2, (run_dir / "run.log").read_text()[-3000:]
    workers[-1].send_signal(signal.SIGKILL)
    return time.time()


def test_a_dead_worker_is_restarted_once_then_stops_the_run_with_a_clear_error(tiny_model_dir, arithmetic_files,
                                                                              tmp_path):
    """trainer.max_restarts=1: the first dead worker restarts the group from the last checkpoint and
    training goes on; the second one ends the run, within a minute, with one line naming the
    worker, its node and the step."""
    proc = start(tiny_model_dir, arithmetic_files, tmp_path, max_restarts=1)
    kill_a_worker_after_checkpoint(proc, tmp_path, step=1)
    killed_at = kill_a_worker_after_checkpoint(proc, tmp_path, step=3)  # written by the restarted workers
    proc.wait(timeout=120)
    assert time.time() - killed_at < 60
    output = (tmp_path / "run.log").read_text()
    assert proc.returncode == 1, output[-3000:]
    assert output.count("Restarting the workers (1 of trainer.max_restarts=1)") == 1, output[-3000:]
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert {1, 2, 3} <= set(steps) and max(steps) < STEPS
    (error,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: worker rank") and "on node" in error and "failed during step" in error, error
    assert "rerun the same command to resume" in error


def test_a_worker_that_cannot_start_stops_the_run_with_one_clear_line(tiny_model_dir, arithmetic_files, tmp_path):
    """An engine argument vLLM takes but that clashes with one set here fails inside the worker:
    the run ends with one error line naming it, not a traceback."""
    cmd = [sys.executable, "-m", "hybrid_rl.main", *run_overrides(tiny_model_dir, arithmetic_files, tmp_path),
           "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=4", "trainer.cpus_per_worker=1"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: the workers failed to start:" in done.stderr and "max_num_seqs" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_killed_for_memory_gets_the_settings_that_need_less(tiny_model_dir, arithmetic_files, tmp_path):
    """Ray's memory monitor, told the node is full at 1 % use, kills a worker as it starts: the one
    error line says so and names the settings that make a rank hold less, minus those already set."""
    cmd = [sys.executable, "-m", "hybrid_rl.main", *run_overrides(tiny_model_dir, arithmetic_files, tmp_path),
           "trainer.cpus_per_worker=1", "actor_rollout_ref.model.enable_gradient_checkpointing=true"]
    env = {**os.environ, "RAY_memory_usage_threshold": "0.01", "RAY_memory_monitor_refresh_ms": "100"}
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: the workers failed to start:") and "OutOfMemoryError" in error, error
    assert "The node ran out of memory. To need less per rank:" in error
    assert "actor_rollout_ref.model.lora_rank=16" in error and "actor_rollout_ref.rollout.name=hf" in error
    assert "enable_gradient_checkpointing" not in error  # already on


def test_memory_advice_names_only_settings_not_yet_made():
    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.trainer import out_of_memory_advice

    default = out_of_memory_advice(compose_config([]))
    for key in ("lora_rank=16", "enable_gradient_checkpointing=true", "cpu_in_place_sync=false", "kv_cache_gib",
                "rollout.name=hf"):
        assert key in default, key
    lean = out_of_memory_advice(compose_config([
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.rollout.name=hf"]))
    assert "lora_rank" not in lean and "checkpointing" not in lean and "cpu_in_place_sync" not in lean
    assert "with every memory-saving setting on" in lean
    # `auto` that chose vLLM's reload: nothing left to turn off there.
    assert "cpu_in_place_sync" not in out_of_memory_advice(compose_config([]), {"cpu_in_place_sync": False})
    megatron = compose_config([], config_name="ppo_megatron_trainer")
    assert "actor_rollout_ref.model.lora.rank=16" in out_of_memory_advice(megatron)
    megatron_lean = compose_config(["actor_rollout_ref.model.lora.rank=8"], config_name="ppo_megatron_trainer")
    assert "lora" not in out_of_memory_advice(megatron_lean)
    two_ranks = out_of_memory_advice(compose_config(["trainer.n_gpus_per_node=2"]))
    assert "trainer.n_gpus_per_node=2" in two_ranks
    gpu = out_of_memory_advice(compose_config(["trainer.device=cuda"]))
    assert "param_offload" in gpu and "rollout.name=hf" not in gpu
