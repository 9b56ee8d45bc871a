"""Crash-safe checkpoints and exact resume, through the real command line.

Run A trains 4 steps without interruption, with a checkpoint after each. Run B is the same
command, killed with SIGKILL as soon as its step-2 checkpoint is complete, then started again: it
resumes from that checkpoint and must reproduce A's per-step metrics and final weights. For the
other engines and rollouts B starts from a copy of A's folder as it stood after checkpoint 2
(what a run stopped there leaves), which tests the same resume with one run fewer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybrid_rl.checkpoint import POINTER, CheckpointError, CheckpointManager
from hybrid_rl.main import REPO_ROOT
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

STEPS = 4


# The Megatron engine with two pipeline stages on two ranks (its dist-checkpoints, the schedule);
# FSDP with LoRA, PPO with the critic's LoRA too (checkpoints of the adapters alone, and the
# critic's head; the entropy bonus gives the actor a gradient, as the random model earns no reward).
ENGINES = {"fsdp": [], "megatron": ["--config-name=ppo_megatron_trainer", "trainer.n_gpus_per_node=2",
                                    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                    "actor_rollout_ref.actor.megatron.dtype=fp32"],
           "lora": ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.entropy_coeff=0.01",
                    "algorithm.adv_estimator=gae", "critic.model.lora_rank=8"]}


def command(model_dir, files, run_dir, rollout: str, engine: str = "fsdp") -> list[str]:
    return [sys.executable, "-m", "hybrid_rl.main", *ENGINES[engine],
            *run_overrides(model_dir, files, run_dir, response=12),
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=2",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-3",
            f"actor_rollout_ref.rollout.name={rollout}", "trainer.cpus_per_worker=1",
            "trainer.checkpoint_callback_class=tests.checkpoint_callbacks.RecordSaves"]


def run(cmd, env: dict | None = None) -> None:
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def run_and_kill_after(cmd, run_dir: Path, step: int) -> None:
    """Start the run in its own process group and SIGKILL all of it once checkpoint `step` is complete."""
    log = run_dir.parent / f"{run_dir.name}.log"  # a file: an unread pipe could fill and stall the run
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + 600
    pointer = run_dir / POINTER
    while time.time() < deadline and proc.poll() is None:
        if pointer.is_file() and pointer.read_text().strip() == str(step):
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"run ended before checkpoint {step}: {log.read_text()[-3000:]}"
    # The driver leads its own process group; Ray's daemons share its fate and exit with it.
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def step_metrics(run_dir: Path) -> dict[int, dict]:
    """Last record of each step (a killed run may have logged a step it then repeated)."""
    rows = {}
    for line in open(run_dir / "metrics.jsonl"):
        row = json.loads(line)
        rows[row["step"]] = {k: v for k, v in row.items()
                             if not k.startswith(("timing_s/", "perf/")) and k not in ("time", "step")}
    return rows


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trained actor as the run exported it (trainer.final_model_dir), either engine."""
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted((run_dir / "final_model").glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def copy_as_stopped_after(straight: Path, resumed: Path, step: int) -> None:
    """`straight`'s folder as it stood right after checkpoint `step`: no later checkpoint, metric
    or final model."""
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns(
        "final_model", *(f"global_step_{later}" for later in range(step + 1, STEPS + 1))))
    (resumed / POINTER).write_text(str(step))
    lines = (straight / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))


def test_kill_and_resume_is_exact(straight_run, tiny_model_dir, arithmetic_files, tmp_path):
    straight, resumed = straight_run("vllm", "fsdp"), tmp_path / "resumed"
    run_and_kill_after(command(tiny_model_dir, arithmetic_files, resumed, "vllm"), resumed, step=2)
    # The killed run left a complete checkpoint 2 and possibly a half-written one, never a broken pointer.
    assert CheckpointManager(str(resumed)).latest().name == "global_step_2"
    run(command(tiny_model_dir, arithmetic_files, resumed, "vllm"))
    assert_same_run(straight, resumed)
    # The checkpoint callback ran once per checkpoint, each complete and the latest by then.
    saves = [json.loads(line) for line in open(straight / "saves.jsonl")]
    assert saves == [{"step": step, "folder": str(straight / f"global_step_{step}"), "latest": step,
                      "async_save": False, "complete": True, "trainer_step": step} for step in range(1, STEPS + 1)]
    assert [row["step"] for row in map(json.loads, open(resumed / "saves.jsonl"))][-2:] == [3, 4]


@pytest.mark.parametrize("rollout, engine", [("hf", "fsdp"), ("vllm", "megatron"), ("vllm", "lora")])
def test_resume_is_exact(rollout, engine, straight_run, tiny_model_dir, arithmetic_files, tmp_path):
    straight, resumed = straight_run(rollout, engine), tmp_path / "resumed"
    copy_as_stopped_after(straight, resumed, step=2)
    run(command(tiny_model_dir, arithmetic_files, resumed, rollout, engine))
    a = assert_same_run(straight, resumed)
    if engine == "megatron":  # the offline export reads the dist-checkpoint to the same weights
        from safetensors.torch import load_file

        from hybrid_rl.export import export_checkpoint

        exported = load_file(Path(export_checkpoint(str(straight), str(tmp_path / "exported"))) / "model.safetensors")
        assert exported.keys() == a.keys() and all(torch.equal(exported[k], a[k]) for k in a)
    if engine == "lora":
        assert_lora_exports_match(straight, a, tiny_model_dir, tmp_path)


def assert_same_run(straight: Path, resumed: Path) -> dict[str, torch.Tensor]:
    """The resumed run logged every step as the straight one did and ended with its weights
    (returned)."""
    expected, got = step_metrics(straight), step_metrics(resumed)
    assert sorted(got) == sorted(expected) == list(range(STEPS + 1))
    for step in range(STEPS + 1):
        assert got[step].keys() == expected[step].keys(), step
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-6), (step, key)
    a, b = final_weights(straight), final_weights(resumed)
    assert a and a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    return a


def assert_lora_exports_match(run_dir: Path, final: dict, base_dir: str, tmp_path: Path) -> None:
    """The checkpoint holds the adapter alone; exported merged, it is the run's final model, and
    exported alone it loads with peft onto the base model to the same merged weights."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from hybrid_rl.export import export_checkpoint

    actor = CheckpointManager(str(run_dir)).latest() / "actor"
    assert (actor / "adapter_config.json").is_file()
    merged = load_file(Path(export_checkpoint(str(run_dir), str(tmp_path / "merged"))) / "model.safetensors")
    assert merged.keys() == final.keys()
    assert max((merged[k] - final[k]).abs().max().item() for k in final) <= 1e-6
    adapter = export_checkpoint(str(run_dir), str(tmp_path / "adapter"), adapter_only=True)
    assert (Path(adapter) / "adapter_model.safetensors").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter).merge_and_unload()
    state = model.state_dict()
    assert max((state[k] - final[k]).abs().max().item() for k in final) <= 1e-6
    assert any((state[k] - load_file(Path(base_dir) / "model.safetensors")[k]).abs().max() > 0 for k in final
               if "proj" in k)  # the adapter moved the weights
    # The critic's: its adapter and head, exported merged as a token classifier.
    critic = CheckpointManager(str(run_dir)).latest() / "critic"
    assert json.loads((critic / "adapter_config.json").read_text())["task_type"] == "TOKEN_CLS"
    exported = Path(export_checkpoint(str(run_dir), str(tmp_path / "critic"), role="critic"))
    value_model = AutoModelForTokenClassification.from_pretrained(exported)
    assert value_model.num_labels == 1 and not any(".lora_" in k for k in value_model.state_dict())


def test_resume_errors(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    assert manager.resume_folder("auto", None) is None
    with pytest.raises(CheckpointError, match="does not exist"):
        manager.resume_folder("resume_path", str(tmp_path / "nope"))
    (tmp_path / "global_step_3").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.resume_folder("resume_path", str(tmp_path / "global_step_3"))
    (tmp_path / POINTER).write_text("3")
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        manager.latest()
    with pytest.raises(CheckpointError, match="auto, disable, resume_path"):
        manager.resume_folder("sometimes", None)
