"""One actor engine, a batch and a loss for the engine tests (CPU and GPU); imports no Ray, so the
GPU tests run where only torch, transformers and megatron-core are installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hybrid_rl.config_keys import compose_config
from hybrid_rl.engines import ModelSpec, Output, build_engine
from hybrid_rl.protocol import Batch

VOCAB = 318  # tests/conftest.py's tokenizer


def rollout_batch(seed: int, rows: int = 8, prompt_len: int = 6, response_len: int = 5) -> Batch:
    """Left-padded prompts and right-padded responses of random lengths, with advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(rows, prompt_len + response_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r in range(rows):
        p = int(torch.randint(1, prompt_len + 1, (1,), generator=g))
        n = int(torch.randint(1, response_len + 1, (1,), generator=g))
        ids[r, prompt_len - p:prompt_len + n] = torch.randint(5, VOCAB, (p + n,), generator=g)
        mask[r, prompt_len - p:prompt_len + n] = 1
    return Batch(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0),
                          "responses": ids[:, prompt_len:], "response_mask": mask[:, prompt_len:].float(),
                          "advantages": torch.randn(rows, response_len, generator=g)})


def loss_fn(out, micro, agg):
    """A policy-gradient term and an entropy bonus, normalised by the mini-batch's tokens."""
    mask = micro["response_mask"]
    scale = agg["dp_size"] / agg["global_num_tokens"]
    loss = -((out["log_probs"] * micro["advantages"] + 0.01 * out["entropy"]) * mask).sum() * scale
    return loss, {"loss": float(loss.detach())}


def value_loss_fn(out, micro, agg):
    """The critic's squared error to the advantages, normalised by the mini-batch's tokens."""
    mask = micro["response_mask"]
    loss = (((out["values"] - micro["advantages"]) ** 2) * mask).sum() * agg["dp_size"] / agg["global_num_tokens"]
    return loss, {"loss": float(loss.detach())}


def actor_config(strategy: str, tp: int = 1, pp: int = 1, extra=(), dtype: str = "fp32", cp: int = 1,
                 vpp: int | None = None):
    """fp32 for the exact comparisons (`auto` is bf16 on CPUs with bf16 instructions)."""
    return compose_config([
        f"actor_rollout_ref.actor.fsdp_config.dtype={dtype}", f"actor_rollout_ref.actor.megatron.dtype={dtype}",
        f"actor_rollout_ref.actor.strategy={strategy}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"actor_rollout_ref.actor.megatron.context_parallel_size={cp}",
        f"actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size={vpp or 'null'}", *extra],
        config_name="ppo_megatron_trainer")


def make_engine(cfg, model_dir, device=torch.device("cpu")):
    actor = cfg.actor_rollout_ref.actor
    return build_engine(ModelSpec("actor", model_dir, cfg.actor_rollout_ref.model, optim_cfg=actor.optim,
                                  total_steps=4), actor, device)


def step(engine, cfg, seed: int) -> dict:
    return engine.update(rollout_batch(seed), cfg.actor_rollout_ref.actor, rollout_n=2, seed=seed,
                         output=Output.LOG_PROBS_ENTROPY, temperature=0.7, loss_fn=loss_fn)


def weights(engine) -> dict:
    return {name: tensor.clone() for name, tensor in engine.per_tensor_weights(torch.float32)}


def offloaded(engine) -> dict[str, bool]:
    """Whether the weights, the optimizer state (Adam's moments; its step counters live on the
    host) and the gradient buffers hold no memory at all."""
    def freed(tensors):
        return all(t.untyped_storage().nbytes() == 0 for t in tensors)

    moments = [v for part in engine.optimizer_parts for state in part.optimizer.state.values()
               for key, v in state.items() if key != "step"]
    return {"params": freed(p for m in engine.models for p in m.parameters()),
            "moments": bool(moments) and freed(moments),
            "grads": freed(b.grad_data for chunk in engine.chunks for b in chunk.buffers)}


def export_step_folder(engine_checkpoint: str, model_dir: str, step_dir: Path, role: str = "actor") -> Path:
    """A trainer's checkpoint step folder around an engine's checkpoint of the actor (or critic)."""
    shutil.copytree(engine_checkpoint, step_dir / role)
    shutil.copytree(model_dir, step_dir / "huggingface", ignore=shutil.ignore_patterns("*.safetensors"))
    section = "critic" if role == "critic" else "actor_rollout_ref"
    (step_dir / "trainer_state.json").write_text(json.dumps({"config": {section: {"model": {"path": model_dir}}}}))
    return step_dir


def two_rank_results(rank_main, out_dir: Path, *args) -> list[dict]:
    """Run `rank_main(rank, 2, init_file, *args, out_dir)` on two spawned processes, each saving
    its results to `out_dir/rank<rank>.pt`; returns them in rank order."""
    import torch.multiprocessing as mp

    mp.start_processes(rank_main, args=(2, str(out_dir / "init"), *args, str(out_dir)), nprocs=2, start_method="spawn")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]

