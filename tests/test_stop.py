"""Stopping a run with SIGINT (Ctrl-C) or SIGTERM (`kill`, SLURM's `scancel`), through the real
command line: the first signal lets the step in progress finish, writes a checkpoint, shuts the
workers and Ray down and exits with 128 + the signal's number; a second one abandons the step at
once. No process of the run may remain, and a stopped run resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hybrid_rl.checkpoint import CheckpointManager
from hybrid_rl.export import export_checkpoint
from hybrid_rl.main import REPO_ROOT
from tests.test_resume import STEPS, command, final_weights, run, step_metrics

pytestmark = pytest.mark.slow


def session_processes(sid: int) -> list[str]:
    """Names of the live processes in session `sid` (the driver's children stay in its session)."""
    names = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
            names.append(name)
    return names


def start(cmd, run_dir: Path) -> tuple[subprocess.Popen, Path]:
    log = run_dir.parent / f"{run_dir.name}.log"  # a file: an unread pipe could fill and stall the run
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return proc, log


def wait_for_step(proc: subprocess.Popen, run_dir: Path, log: Path, step: int) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and f'"step": {step},' in metrics.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"the run never logged step {step}: {log.read_text()[-3000:]}")


def stop_run(proc: subprocess.Popen, log: Path, signals: list[int]) -> str:
    """Send `signals` to the driver alone (as `kill` and `scancel` do), each once the run has
    acknowledged the one before (two signals that arrive while the main thread is inside a C call
    reach Python's handler as one: a fixed gap of 0.1 s merged them on a loaded CI machine);
    returns the run's output."""
    assert "raylet" in session_processes(proc.pid), "Ray should be running under the driver"
    for index, signum in enumerate(signals):
        if index:
            wait_for_acknowledgement(proc, log)
        os.kill(proc.pid, signum)
    try:
        proc.wait(timeout=120)  # a hang detector, not a speed claim: docs/benchmarks.md has the times
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the run ignored {signals}: {log.read_text()[-3000:]}")
    deadline = time.time() + 10  # Ray's daemons exit right after the driver's shutdown call returns
    while session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert session_processes(proc.pid) == [], f"processes left behind: {session_processes(proc.pid)}"
    return log.read_text()


def wait_for_acknowledgement(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + 60
    while "stopping after the current step" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, f"the first signal was not handled: {log.read_text()[-3000:]}"
        time.sleep(0.02)


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(straight_run, tiny_model_dir, arithmetic_files, tmp_path):
    straight, stopped = straight_run("vllm", "fsdp"), tmp_path / "stopped"
    # Checkpoints every 100 steps: only the stop writes one.
    cmd = command(tiny_model_dir, arithmetic_files, stopped, "vllm") + ["trainer.save_freq=100"]
    proc, log = start(cmd, stopped)
    wait_for_step(proc, stopped, log, 1)
    output = stop_run(proc, log, [signal.SIGTERM])
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output
    last = max(step_metrics(stopped))
    assert 1 <= last < STEPS
    assert CheckpointManager(str(stopped)).latest().name == f"global_step_{last}"
    from transformers import AutoModelForCausalLM

    exported = export_checkpoint(str(stopped), str(tmp_path / "exported"))  # the stop's checkpoint is whole
    assert AutoModelForCausalLM.from_pretrained(exported).num_parameters() > 0

    # The same command resumes from the stop's checkpoint and finishes. Its capacity block ends
    # within the hour, which esi_redundant_time spares: a checkpoint after each step, though
    # save_freq is 100 (verl's checkpoint before a capacity block ends).
    block = {**os.environ, "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP": str(time.time() + 3600)}
    run([*cmd, "trainer.esi_redundant_time=3600"], env=block)
    assert [p.name for p in CheckpointManager(str(stopped)).completed()] == [
        f"global_step_{step}" for step in range(last, STEPS + 1)]
    expected, got = step_metrics(straight), step_metrics(stopped)
    assert sorted(got) == sorted(expected)
    for step, row in expected.items():
        # The stopped step skips its validation (to stop sooner) unless the signal came after it
        # had run; everything else is equal.
        skipped = {key for key in row if key.startswith("val") and step == last and key not in got[step]}
        assert got[step].keys() == row.keys() - skipped, step
        for key, value in got[step].items():
            assert value == pytest.approx(row[key], rel=1e-6, abs=1e-6), (step, key)
    a, b = final_weights(straight), final_weights(stopped)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def run_until_signalled(model_dir, files, run_dir: Path, signals: list[int],
                        overrides: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """A 200-step run that checkpoints every 100 steps, sent `signals` once step 1 is logged."""
    cmd = command(model_dir, files, run_dir, "vllm") + ["trainer.save_freq=100", "trainer.total_training_steps=200",
                                                        *overrides]
    proc, log = start(cmd, run_dir)
    wait_for_step(proc, run_dir, log, 1)
    return proc, stop_run(proc, log, signals)


SLOW_REWARD = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.25)
    return 0.0
"""


def test_second_sigint_abandons_the_step(tiny_model_dir, arithmetic_files, tmp_path):
    # A reward that makes each step last 2 s (8 samples), so that the second signal, sent once the
    # first is acknowledged, lands inside the same step: with the tiny model's sub-second steps, the
    # step and its checkpoint could be done before it arrived. No validation, which would score too.
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD)
    run_dir = tmp_path / "run"
    proc, output = run_until_signalled(tiny_model_dir, arithmetic_files, run_dir, [signal.SIGINT, signal.SIGINT],
                                       (f"custom_reward_function.path={reward}", "trainer.val_before_train=false",
                                        "trainer.test_freq=-1"))
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    # The first Ctrl-C asked for a graceful stop (as SIGTERM does), the second abandoned the step.
    assert "SIGINT: stopping after the current step" in output and "Stopped by SIGINT" in output
    # Abandoned, not half-written: no checkpoint and no temporary folder left.
    assert list(run_dir.glob("global_step_*")) == [] and list(run_dir.glob(".tmp_*")) == []
