"""verl's `checkpoint.async_save` on both engines: the shards are written while training goes on (the
FSDP engine copies them to host memory when the save starts; the Megatron engine's forked writer
holds them as they were); the checkpoint holds the state of that moment, and it becomes the latest
only once every part is on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybrid_rl.checkpoint import POINTER
from tests.engine_helpers import actor_config, make_engine, step, two_rank_results, weights
from tests.test_checkpoint_safety import files_of
from tests.test_resume import STEPS, assert_same_run, command, run


def _background_save_rank_main(rank, world, init_file, model_dir, strategy, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = actor_config(strategy, tp=2 if strategy == "megatron" else 1)
    engine = make_engine(cfg, model_dir)
    step(engine, cfg, 1)
    saved = weights(engine)
    folder = os.path.join(out_dir, "ckpt")
    engine.save_checkpoint(folder, background=True)
    assert engine.pending_save is not None
    after_save = step(engine, cfg, 2)  # the collectives of an update while the write runs
    moved = weights(engine)
    engine.finish_checkpoint()
    resumed = make_engine(cfg, model_dir)
    resumed.load_checkpoint(folder)
    loaded = weights(resumed)
    torch.save({"saved": saved, "moved": moved, "loaded": loaded, "after_save": after_save,
                "resumed_step": step(resumed, cfg, 2), "resumed_weights": weights(resumed)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["fsdp2", "megatron"])
def test_a_background_save_holds_the_state_when_it_started_and_resumes_exactly(strategy, tiny_model_dir, tmp_path):
    for result in two_rank_results(_background_save_rank_main, tmp_path, tiny_model_dir, strategy):
        saved, moved, loaded = result["saved"], result["moved"], result["loaded"]
        assert any(not torch.equal(saved[k], moved[k]) for k in saved)  # the update went on meanwhile
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
        # Optimizer, schedule and RNG states came back too: the resumed update is the one made.
        assert result["resumed_step"] == result["after_save"]
        assert all(torch.equal(moved[k], result["resumed_weights"][k]) for k in moved)


def test_a_checkpoint_being_written_is_not_the_latest_and_a_failed_write_leaves_the_previous(tmp_path):
    from hybrid_rl.checkpoint import CheckpointManager

    manager = CheckpointManager(str(tmp_path))
    manager.save(1, lambda folder: None, {"global_step": 1})
    pending = manager.begin(2, lambda folder: open(os.path.join(folder, "shard"), "w").close(), {"global_step": 2})
    # Until it is committed (its writes waited for), a crash resumes from checkpoint 1.
    assert manager.latest().name == "global_step_1" and [p.name for p in manager.completed()] == ["global_step_1"]
    assert manager.commit(pending, wait=lambda: None).name == "global_step_2"
    assert manager.latest().name == "global_step_2"

    def failed_write():
        raise OSError("No space left on device")

    pending = manager.begin(3, lambda folder: None, {"global_step": 3})
    with pytest.raises(OSError, match="No space left"):
        manager.commit(pending, wait=failed_write)
    assert manager.latest().name == "global_step_2" and not pending.folder.exists()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_checkpoints_written_in_the_background_hold_the_same_run(engine, straight_run, tiny_model_dir,
                                                                arithmetic_files, tmp_path):
    """actor.checkpoint.async_save=true: step for step the run that saves before going on; each
    checkpoint became the latest only when complete (so the callback saw it, and
    trainer.default_hdfs_dir got a whole copy of it) and holds that run's tensors. The Megatron
    engine (two pipeline stages) forks its writers from workers that hold a vLLM engine."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    straight, background, mirror = straight_run("vllm", engine), tmp_path / "background", tmp_path / "mirror"
    run(command(tiny_model_dir, arithmetic_files, background, "vllm", engine) + [
        "actor_rollout_ref.actor.checkpoint.async_save=true", f"trainer.default_hdfs_dir={mirror}"])
    assert_same_run(straight, background)
    saves = [json.loads(line) for line in open(background / "saves.jsonl")]
    assert [(s["step"], s["latest"], s["complete"]) for s in saves] == [(step, step, True) for step in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        assert files_of(mirror / f"global_step_{step}") == files_of(background / f"global_step_{step}")
    assert (mirror / POINTER).read_text() == str(STEPS)

    def tensors(run_dir: Path, step: int) -> dict:
        out = tmp_path / f"{run_dir.name}_{step}.pt"
        dcp_to_torch_save(run_dir / f"global_step_{step}" / "actor", out)
        flat = {}

        def walk(prefix, value):
            if isinstance(value, dict):
                for key, item in value.items():
                    walk(f"{prefix}.{key}", item)
            elif isinstance(value, torch.Tensor):
                flat[prefix] = value

        walk("", torch.load(out, weights_only=False))
        return flat

    for step in (1, STEPS):
        expected, got = tensors(straight, step), tensors(background, step)
        assert expected and got.keys() == expected.keys()
        assert max((got[k].float() - expected[k].float()).abs().max().item() for k in expected) <= 1e-6
