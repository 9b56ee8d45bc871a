"""`actor_rollout_ref.model.enable_gradient_checkpointing` on the FSDP engine and on the Megatron
engine (megatron's full recomputation; over TP, PP and CP ranks in tests/test_megatron_engine.py,
on CUDA in tests/test_gpu.py): the update is the same (loss, gradient norm, weights) and the
forward keeps far fewer activations for backward."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import build_tiny_model
from tests.engine_helpers import actor_config, make_engine, step, weights


def checkpointed_update(model_dir: str, checkpointing: bool, device=torch.device("cpu"), strategy="fsdp2",
                        extra=()) -> dict:
    """One update; the bytes of every tensor the forward passes saved for backward. A checkpointed
    region keeps only its inputs; what its recomputation saves inside the backward pass (where
    megatron's reentrant checkpoint calls these hooks too) lives one layer at a time, uncounted."""
    cfg = actor_config(strategy, extra=[f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}",
                                        *extra])
    engine = make_engine(cfg, model_dir, device)
    saved = [0]

    def pack(tensor):
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        metrics = step(engine, cfg, 1)
    return {"saved_bytes": saved[0], "metrics": metrics, "weights": weights(engine)}


def assert_same_update_fewer_activations(plain: dict, checkpointed: dict) -> None:
    for key in ("actor/loss", "actor/grad_norm"):
        assert checkpointed["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-6)
    for name, tensor in plain["weights"].items():
        torch.testing.assert_close(checkpointed["weights"][name], tensor, rtol=1e-6, atol=1e-7)
    assert checkpointed["saved_bytes"] < 0.5 * plain["saved_bytes"]


def test_fsdp_gradient_checkpointing_keeps_the_update_and_drops_activations(tmp_path, tiny_tokenizer):
    model_dir = build_tiny_model(tmp_path, tiny_tokenizer, num_layers=4, rope_theta=1e5)
    assert_same_update_fewer_activations(checkpointed_update(model_dir, False), checkpointed_update(model_dir, True))


def _megatron_main(rank, model_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=1)
    runs = [checkpointed_update(model_dir, flag, strategy="megatron") for flag in (False, True)]
    torch.save(runs, os.path.join(out_dir, "runs.pt"))
    dist.destroy_process_group()


def test_megatron_recomputation_keeps_the_update_and_drops_activations(tmp_path, tiny_tokenizer):
    """In a process of its own: megatron's parallel state is global to the process."""
    model_dir = build_tiny_model(tmp_path / "model", tiny_tokenizer, num_layers=4, rope_theta=1e5)
    mp.start_processes(_megatron_main, args=(model_dir, str(tmp_path)), nprocs=1, start_method="spawn")
    assert_same_update_fewer_activations(*torch.load(tmp_path / "runs.pt"))
