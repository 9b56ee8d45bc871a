"""`actor_rollout_ref.model.tiled_mlp` (verl's key) on the FSDP engine: the same update, with the
MLPs' intermediate activations no longer kept for backward, alone or under gradient checkpointing,
on one rank and on two that shard the model."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.engines import Output
from hybrid_rl.engines.fsdp import decoder_layers
from hybrid_rl.engines.tiled_mlp import tile_mlps
from tests.conftest import build_tiny_model
from tests.engine_helpers import actor_config, loss_fn, make_engine, rollout_batch, two_rank_results, weights
from tests.test_gradient_checkpointing import checkpointed_update

SGD = ["actor_rollout_ref.actor.optim.optimizer=sgd"]  # megatron's name: actor_config composes that tree
TILED = [*SGD, "actor_rollout_ref.model.tiled_mlp.enabled=true", "actor_rollout_ref.model.tiled_mlp.num_shards=3"]


def assert_same_update(reference: dict, other: dict) -> None:
    """The same loss, gradient norm and weights after the step. (The MLP weights' gradients are
    summed over the slices in another order: equal to float32 rounding, which SGD's step keeps at
    that size where Adam's would make a rounding-sized gradient element's step a whole one.)"""
    for key in ("actor/loss", "actor/grad_norm"):
        assert other["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-6)
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(other["weights"][name], tensor, rtol=1e-6, atol=1e-8)


def test_tiled_mlps_give_the_same_update_and_keep_fewer_activations(tmp_path, tiny_tokenizer):
    model_dir = build_tiny_model(tmp_path, tiny_tokenizer, num_layers=4, rope_theta=1e5)
    plain, tiled = checkpointed_update(model_dir, False, extra=SGD), checkpointed_update(model_dir, False, extra=TILED)
    assert_same_update(plain, tiled)
    # The MLPs' projections, activation and product made over half of what the layers kept
    # (measured: 10.5 MB untiled, 4.8 MB tiled).
    assert tiled["saved_bytes"] < 0.6 * plain["saved_bytes"]
    # Under gradient checkpointing a layer keeps its input only, tiled or not, and the update stays.
    checkpointed = checkpointed_update(model_dir, True, extra=SGD)
    both = checkpointed_update(model_dir, True, extra=TILED)
    assert_same_update(plain, both)
    assert both["saved_bytes"] == checkpointed["saved_bytes"]


def _two_rank_main(rank, world, init_file, model_dir, out_dir):
    """Both ranks shard the model (FSDP2) and update on rows of their own, untiled then tiled."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    runs = {}
    for name, extra in (("plain", SGD), ("tiled", TILED)):
        cfg = actor_config("fsdp2", extra=extra)
        engine = make_engine(cfg, model_dir)
        metrics = engine.update(rollout_batch(1 + 100 * rank), cfg.actor_rollout_ref.actor, rollout_n=2, seed=1,
                                output=Output.LOG_PROBS_ENTROPY, temperature=0.7, loss_fn=loss_fn)
        runs[name] = {"metrics": metrics, "weights": weights(engine),
                      "sharded": any(isinstance(p, DTensor) for p in engine.module.parameters())}
    torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_tiled_mlps_update_a_sharded_model_as_untiled(tiny_model_dir, tmp_path):
    for runs in two_rank_results(_two_rank_main, tmp_path, tiny_model_dir):
        assert runs["tiled"]["sharded"]
        assert_same_update(runs["plain"], runs["tiled"])


def moe_layers(mlp_only_layers: list[int]) -> list[torch.nn.Module]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, mlp_only_layers=mlp_only_layers)
    return decoder_layers(Qwen3MoeForCausalLM(config))


def test_expert_blocks_stay_whole(caplog):
    with caplog.at_level(logging.WARNING):
        assert tile_mlps(moe_layers([0]), 2, "m.tiled_mlp") == 1
    assert "m.tiled_mlp: 1 of 2 decoder layers' MLPs tiled" in caplog.text
    with pytest.raises(ValueError, match="tiles dense MLPs .* this model's 2 layers have none"):
        tile_mlps(moe_layers([]), 2, "m.tiled_mlp")


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.model.tiled_mlp.num_shards=0"], "num_shards=0 must be a positive integer"),
    (["critic.model.tiled_mlp.enabled=true", "critic.model.tiled_mlp.num_shards=two"],
     "critic.model.tiled_mlp.num_shards=two must be a positive integer"),
])
def test_bad_settings_stop_the_run_at_start(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(["actor_rollout_ref.model.tiled_mlp.enabled=true", *overrides]))


def test_the_megatron_engine_is_refused():
    cfg = compose_config(["actor_rollout_ref.model.tiled_mlp.enabled=true"], config_name="ppo_megatron_trainer")
    with pytest.raises(ConfigError, match="strategy=megatron builds megatron's layers"):
        validate_config(cfg)
