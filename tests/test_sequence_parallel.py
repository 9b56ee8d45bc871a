"""Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size) on the FSDP engine.

Four gloo ranks in two sequence-parallel groups of two (data-parallel size 2), each group on a
batch of its own, compute the same log-probs, entropies and values as four ranks without
sequence parallelism where ranks 0-1 and 2-3 hold the same two batches, and one update gives the
same loss, gradient norm and weights; so do a critic's values and a reward model's scores. Three head layouts: query and key/value heads both split
evenly (4/2), key/value heads repeated for an even query split (2/1), and an uneven query split
(3/1: two heads on one rank, one on the other)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from hybrid_rl.engines.ulysses import head_counts
from tests.conftest import build_tiny_model, built_once
from tests.engine_helpers import actor_config, loss_fn, make_engine, rollout_batch, weights

pytestmark = pytest.mark.slow

WORLD, SP = 4, 2


def grouped(batch):
    """Rows in pairs that share a prompt (two responses to each), as a GRPO batch has them: the
    packing then computes each prompt once and predicts both first response tokens from its last
    token."""
    prompt_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    for key in ("input_ids", "attention_mask"):
        batch[key][1::2, :prompt_len] = batch[key][0::2, :prompt_len]
    batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp_min(0)
    return batch


def _run(cfg, model_dir, batch) -> dict:
    engine = make_engine(cfg, model_dir)
    actor = cfg.actor_rollout_ref.actor
    torch.manual_seed(0)  # the value head's initial weights
    critic = build_engine(ModelSpec("critic", model_dir, cfg.actor_rollout_ref.model, head=Head.VALUE), actor,
                          torch.device("cpu"))
    inferred = engine.infer(batch, Output.LOG_PROBS_ENTROPY, 0.7, micro_rows=3, max_tokens=None)
    budget = engine.infer(batch, Output.LOG_PROBS, 0.7, micro_rows=3, max_tokens=24)  # token-budget micro-batches
    values = critic.infer(batch, Output.VALUES, 1.0, micro_rows=8, max_tokens=None)["values"]
    torch.manual_seed(0)
    scorer = build_engine(ModelSpec("reward_model", model_dir, cfg.actor_rollout_ref.model, head=Head.SCORE), actor,
                          torch.device("cpu"))
    scores = scorer.infer(batch, Output.SCORES, 1.0, micro_rows=8, max_tokens=None)["scores"]
    metrics = engine.update(batch, actor, rollout_n=2, seed=1, output=Output.LOG_PROBS_ENTROPY, temperature=0.7,
                            loss_fn=loss_fn)
    return {"layout": (engine.dp_rank, engine.dp_size, engine.is_output_rank), "inferred": inferred,
            "budget": budget["log_probs"], "values": values, "scores": scores, "metrics": metrics, "weights": weights(engine)}


def _rank_main(rank, init_file, model_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    batch = grouped(rollout_batch(1 + rank // SP))  # the same rows for both ranks of a group
    common = ["actor_rollout_ref.model.share_prompt_prefix=true"]
    # One mini-batch per rank either way: 16 x 2 / 4 ranks and 8 x 2 / 2 data-parallel groups.
    plain = _run(actor_config("fsdp2", extra=[*common, "actor_rollout_ref.actor.ppo_mini_batch_size=16"]),
                 model_dir, batch)
    split = _run(actor_config("fsdp2", extra=[*common, "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                                              f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={SP}"]),
                 model_dir, batch)
    torch.save({"plain": plain, "split": split}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 1), (3, 1)])
def test_sequence_parallel_equals_data_parallel(tmp_path_factory, tiny_tokenizer, heads, kv_heads):
    model_dir = str(built_once(tmp_path_factory, f"tiny_model_{heads}_{kv_heads}_heads",
                               lambda folder: build_tiny_model(folder, tiny_tokenizer, heads=heads, kv_heads=kv_heads)))
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(os.path.join(out_dir, "init"), model_dir, out_dir), nprocs=WORLD,
                           start_method="spawn")
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]
    for rank, result in enumerate(results):
        plain, split = result["plain"], result["split"]
        assert plain["layout"] == (rank, WORLD, True)
        assert split["layout"] == (rank // SP, WORLD // SP, rank % SP == 0)
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(split["inferred"][key], plain["inferred"][key], rtol=0, atol=1e-5)
        torch.testing.assert_close(split["budget"], plain["inferred"]["log_probs"], rtol=0, atol=1e-5)
        torch.testing.assert_close(split["values"], plain["values"], rtol=0, atol=1e-5)
        torch.testing.assert_close(split["scores"], plain["scores"], rtol=0, atol=1e-5)
        for key in ("actor/loss", "actor/grad_norm"):
            assert split["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-5)
        # Adam's first step moves a weight by about lr (1e-3) x the sign of its gradient, a
        # gradient near 0 by less and sensitively: atol allows 10 % of a step there.
        for name, tensor in plain["weights"].items():
            torch.testing.assert_close(split["weights"][name], tensor, rtol=1e-5, atol=1e-4)


def test_heads_are_dealt_as_evenly_as_they_go():
    assert head_counts(9, 2) == [5, 4]
    assert head_counts(4, 2) == [2, 2]
    assert head_counts(3, 3) == [1, 1, 1]
    assert sum(head_counts(14, 4)) == 14 and max(head_counts(14, 4)) - min(head_counts(14, 4)) == 1


@pytest.mark.parametrize("overrides,message", [
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"],
     r"actor_rollout_ref.actor.ulysses_sequence_parallel_size=3 must divide the role's 4 ranks: 1, 2, 4"),
    (["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=3"],
     r"actor_rollout_ref.actor.ulysses_sequence_parallel_size=3 must divide"),
    (["critic.ulysses_sequence_parallel_size=8", "algorithm.adv_estimator=gae"],
     r"critic.ulysses_sequence_parallel_size=8 must divide the role's 4 ranks"),
    # A cluster script's unset variable: the rank count is checked before anything divides it.
    (["trainer.n_gpus_per_node=", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"],
     r"trainer.n_gpus_per_node= must be a positive integer"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=false"],
     r"splits padding-free rows; set actor_rollout_ref.model.use_remove_padding=true"),
])
def test_bad_group_sizes_are_refused_at_start(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(["trainer.n_gpus_per_node=4", *overrides]))


def test_sequence_parallelism_on_the_megatron_engine_is_refused():
    cfg = compose_config(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    cfg.actor_rollout_ref.actor.strategy = "megatron"
    with pytest.raises(ConfigError, match=r"runs on the FSDP engine, not actor_rollout_ref.actor.strategy=megatron"):
        validate_config(cfg)
