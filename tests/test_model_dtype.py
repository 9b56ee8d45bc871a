"""verl's `fsdp_config.model_dtype`: the FSDP engine holds and trains the weights in that dtype.
bf16 halves what weights, gradients and Adam's moments take, and a checkpoint of it resumes
exactly."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from tests.engine_helpers import actor_config, make_engine, rollout_batch, step, two_rank_results, weights

BF16 = ("actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",)


def training_bytes(engine) -> int:
    """Bytes of the trained weights, their gradients and the optimizer's state tensors."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    state = [t for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    return sum(t.nbytes for t in params + [p.grad for p in params if p.grad is not None] + state)


def _bf16_rank_main(rank, world, init_file, model_dir, out_dir):
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg, reference_cfg = actor_config("fsdp2", dtype="bf16", extra=BF16), actor_config("fsdp2", dtype="bf16")
    engine, reference = make_engine(cfg, model_dir), make_engine(reference_cfg, model_dir)
    dtypes = [{p.dtype for p in e.module.parameters()} for e in (engine, reference)]
    log_probs = [e.infer(rollout_batch(1), Output.LOG_PROBS, 1.0, 3, None)["log_probs"] for e in (engine, reference)]
    before = weights(engine)
    first = step(engine, cfg, 1)
    step(reference, reference_cfg, 1)
    moments = {t.dtype for s in engine.optimizer.state.values() for k, t in s.items() if k != "step"}
    after, memory = weights(engine), [training_bytes(e) for e in (engine, reference)]
    folder = os.path.join(out_dir, "ckpt")
    engine.save_checkpoint(folder)
    second = (step(engine, cfg, 2), weights(engine))
    resumed = make_engine(cfg, model_dir)
    resumed.load_checkpoint(folder)
    torch.save({"dtypes": dtypes, "log_probs": log_probs, "before": before, "first": first, "moments": moments,
                "after": after, "memory": memory, "second": second, "resumed": (step(resumed, cfg, 2), weights(resumed))},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_bf16_weights_train_in_bf16_at_half_the_memory_and_resume_exactly(tiny_model_dir, tmp_path):
    """Two ranks, each holding its FSDP shards of the weights, gradients and moments in bf16."""
    mask = rollout_batch(1)["response_mask"].bool()
    for r in two_rank_results(_bf16_rank_main, tmp_path, tiny_model_dir):
        assert r["dtypes"] == [{torch.bfloat16}, {torch.float32}]
        # The same bf16 compute; only norms and embeddings, which autocast leaves in float32, differ.
        ours, theirs = r["log_probs"]
        assert 0 < (ours - theirs)[mask].abs().max() <= 0.1
        assert all(torch.isfinite(torch.tensor(v)) for v in r["first"].values())
        assert r["moments"] == {torch.bfloat16}
        assert any(not torch.equal(r["before"][k], w) for k, w in r["after"].items())  # the update lands
        assert r["memory"][0] * 2 == r["memory"][1]
        # A checkpoint of bf16 weights and moments: the next update from it is the one made.
        (second, second_weights), (resumed, resumed_weights) = r["second"], r["resumed"]
        assert resumed == second and all(torch.equal(w, second_weights[k]) for k, w in resumed_weights.items())


def test_a_bf16_critic_holds_its_value_head_in_bf16(tiny_model_dir):
    from hybrid_rl.config_keys import compose_config

    cfg = compose_config(["critic.fsdp.dtype=bf16", "critic.fsdp.model_dtype=bf16"])
    critic = build_engine(ModelSpec("critic", tiny_model_dir, cfg.critic.model, head=Head.VALUE,
                                    optim_cfg=cfg.critic.optim, total_steps=4), cfg.critic, torch.device("cpu"))
    assert {p.dtype for p in critic.module.parameters()} == {torch.bfloat16}
    values = critic.infer(rollout_batch(1), Output.VALUES, 1.0, 3, None)["values"]
    assert torch.isfinite(values).all()


@pytest.mark.parametrize("extra, message", [
    ((), r"model_dtype=bf16 needs bf16 compute, but fsdp_config.dtype gives torch.float32"),
    (("actor_rollout_ref.actor.fsdp_config.dtype=bf16", "actor_rollout_ref.model.lora_rank=4"),
     r"model_dtype=bf16 with LoRA"),
])
def test_bf16_weights_that_cannot_be_trained_as_asked_are_refused(tiny_model_dir, extra, message):
    cfg = actor_config("fsdp2", extra=BF16 + extra)
    with pytest.raises(ValueError, match=message):
        make_engine(cfg, tiny_model_dir)
    with pytest.raises(ValueError, match="model_dtype=fp16: the weights are held in fp32 or bf16"):
        make_engine(actor_config("fsdp2", dtype="bf16", extra=("actor_rollout_ref.actor.fsdp_config.model_dtype=fp16",)),
                    tiny_model_dir)


def test_bf16_weights_asked_of_the_megatron_engine_are_refused_at_start():
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.config_keys import compose_config

    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 sets the FSDP "
                                          r"engine's weights; the Megatron engine"):
        validate_config(compose_config(BF16, config_name="ppo_megatron_trainer"))
    validate_config(compose_config(BF16))
