"""A crash in the middle of writing a checkpoint leaves the previous one complete and pointed to;
a non-finite gradient norm skips the optimizer step."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from hybrid_rl.checkpoint import CheckpointManager, read_trainer_state
from hybrid_rl.main import REPO_ROOT
from hybrid_rl.protocol import Batch
from hybrid_rl.workers.train_engine import mini_batch_updates

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


def test_non_finite_gradient_skips_the_step():
    model = torch.nn.Linear(3, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    # [1 prompt token | 2 response tokens] rows: the update loop counts the tokens it forwards.
    tokens = torch.ones(4, 3, dtype=torch.long)
    batch = Batch(tensors={"x": torch.randn(4, 3), "response_mask": torch.ones(4, 2), "input_ids": tokens,
                           "attention_mask": tokens, "responses": tokens[:, 1:]})

    def nan_loss(t, agg):
        return model(t["x"]).sum() * float("nan"), {}

    metrics, skipped = mini_batch_updates(model, optimizer, batch, mini_rows=4, micro_rows=2, max_tokens=None,
                                          share_prompts=False, epochs=1, shuffle=False,
                                          seed=0, grad_clip=1.0, device=torch.device("cpu"), loss_fn=nan_loss)
    assert skipped == 1 and not torch.isfinite(torch.tensor(metrics["grad_norm"])).all()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
