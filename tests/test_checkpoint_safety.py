"""A crash in the middle of writing a checkpoint leaves the previous one complete and pointed to;
a step's metrics are logged before its checkpoint is the latest; a non-finite gradient norm skips the
optimizer step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hybrid_rl.checkpoint import (CheckpointError, CheckpointManager, CheckpointMirrorError, mirror_checkpoint,
                                  read_trainer_state)
from hybrid_rl.engines import ModelSpec, Output, build_engine
from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.main import REPO_ROOT, compose_config
from hybrid_rl.protocol import Batch

CRASHING_SAVE = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    from hybrid_rl.checkpoint import CheckpointManager

    manager = CheckpointManager(sys.argv[1], max_to_keep=2)
    def parts(folder):
        Path(folder, "actor").mkdir()
        Path(folder, "actor", "shard.bin").write_bytes(b"x" * 1000)
    manager.save(1, parts, {"global_step": 1})
    def crash(folder):
        Path(folder, "actor").mkdir()
        Path(folder, "actor", "shard.bin").write_bytes(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)  # power cut in the middle of step 2's save
    manager.save(2, crash, {"global_step": 2})
''')


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-c", CRASHING_SAVE, str(tmp_path)], cwd=REPO_ROOT)
    assert done.returncode == -9
    manager = CheckpointManager(str(tmp_path), max_to_keep=2)
    latest = manager.latest()
    assert latest.name == "global_step_1" and read_trainer_state(latest)["global_step"] == 1
    assert (latest / "actor" / "shard.bin").read_bytes() == b"x" * 1000
    assert [p.name for p in manager.completed()] == ["global_step_1"]
    leftovers = list(tmp_path.glob(".tmp_global_step_2_*"))
    assert leftovers  # the interrupted save is hidden, never mistaken for a checkpoint
    manager.save(2, lambda folder: None, {"global_step": 2})  # the next save cleans it up
    assert not list(tmp_path.glob(".tmp_global_step_*"))
    assert json.loads((manager.latest() / "trainer_state.json").read_text())["global_step"] == 2


def test_rotation_keeps_the_newest(tmp_path):
    manager = CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in range(1, 5):
        manager.save(step, lambda folder: None, {"global_step": step})
    assert [p.name for p in manager.completed()] == ["global_step_3", "global_step_4"]


def test_older_checkpoints_lose_the_critic_beyond_max_critic_to_keep(tmp_path):
    def write_parts(folder):
        for part in ("actor", "critic"):
            os.makedirs(os.path.join(folder, part))

    manager = CheckpointManager(str(tmp_path), max_to_keep=3, max_critic_to_keep=2)
    for step in range(1, 5):
        manager.save(step, write_parts, {"global_step": step})
    kept = manager.completed()
    assert [p.name for p in kept] == ["global_step_2", "global_step_3", "global_step_4"]
    assert [(p / "actor").is_dir() for p in kept] == [True, True, True]
    assert [(p / "critic").is_dir() for p in kept] == [False, True, True]
    assert manager.critic_folder(kept[-1]) == kept[-1] / "critic"
    with pytest.raises(CheckpointError, match=r"global_step_2 holds no critic.*\['global_step_3', 'global_step_4'\]"):
        manager.critic_folder(kept[0])


def test_the_step_is_logged_before_its_checkpoint_becomes_the_latest(tmp_path):
    """The trainer logs a step's metrics in `before_commit`: a run killed once checkpoint N is the
    latest has logged step N (tests/test_resume.py kills runs right then)."""
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, lambda folder: None, {"global_step": 1})
    seen = []
    manager.save(2, lambda folder: None, {"global_step": 2}, before_commit=lambda: seen.append(manager.latest().name))
    assert seen == ["global_step_1"] and manager.latest().name == "global_step_2"


def files_of(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_default_hdfs_dir_gets_a_whole_copy_of_each_checkpoint_and_the_pointer(tmp_path):
    """verl's trainer.default_hdfs_dir: each complete checkpoint copied whole under its own name,
    the latest pointer beside it; a step saved again replaces its copy; the copies are kept."""
    def parts(folder):
        os.makedirs(os.path.join(folder, "actor", "shards"))
        with open(os.path.join(folder, "actor", "shards", "0.distcp"), "wb") as f:
            f.write(os.urandom(4096))

    manager, mirror = CheckpointManager(str(tmp_path / "run"), max_to_keep=1), tmp_path / "mirror"
    for step in (1, 2, 2):
        folder = manager.save(step, parts, {"global_step": step})
        assert mirror_checkpoint(folder, str(mirror)) == str(mirror / folder.name)
        assert files_of(mirror / folder.name) == files_of(folder)
    assert sorted(p.name for p in mirror.iterdir()) == ["global_step_1", "global_step_2",
                                                        "latest_checkpointed_iteration.txt"]
    assert (mirror / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert [p.name for p in manager.completed()] == ["global_step_2"]  # rotation is local only
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(CheckpointMirrorError, match=r"trainer.default_hdfs_dir: copying checkpoint .*global_step_2 "
                                                    r"to .*file failed .* The checkpoint is complete in its own folder"):
        mirror_checkpoint(folder, str(tmp_path / "file"))
    assert files_of(folder) == files_of(mirror / "global_step_2")
    with pytest.raises(ConfigError, match=r"trainer.default_hdfs_dir=nosuch://bucket/run: no file system for it"):
        validate_config(compose_config(["trainer.default_hdfs_dir=nosuch://bucket/run"]))


def test_non_finite_gradient_skips_the_step(tiny_model_dir):
    cfg = compose_config(["actor_rollout_ref.actor.ppo_mini_batch_size=4",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                          "actor_rollout_ref.actor.use_dynamic_bsz=false"])
    actor_cfg = cfg.actor_rollout_ref.actor
    engine = build_engine(ModelSpec("actor", tiny_model_dir, cfg.actor_rollout_ref.model, optim_cfg=actor_cfg.optim),
                          actor_cfg, torch.device("cpu"))
    before = [p.detach().clone() for p in engine.hf_module().parameters()]
    ids = torch.randint(10, 100, (4, 5))
    batch = Batch(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                           "position_ids": torch.arange(5).expand(4, -1), "responses": ids[:, 2:],
                           "response_mask": torch.ones(4, 3)})

    def nan_loss(out, micro, agg):
        return out["log_probs"].sum() * float("nan"), {}

    metrics = engine.update(batch, actor_cfg, rollout_n=1, seed=0, output=Output.LOG_PROBS_ENTROPY,
                            temperature=1.0, loss_fn=nan_loss)
    assert metrics["actor/skipped_steps"] == 1 and not math.isfinite(metrics["actor/grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, engine.hf_module().parameters()))
