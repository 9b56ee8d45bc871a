"""End-to-end GRPO on a tiny random model: 2 FSDP2 ranks on gloo, each with its own in-process
vLLM engine, through the real driver, Ray worker group, rewards and trainer loop."""

from __future__ import annotations

import glob
import gzip
import json
import math
import os

import pytest

from hybrid_rl.data import collate_prompts
from hybrid_rl.main import build_trainer, compose_config
from hybrid_rl.protocol import BatchMeta
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

MAX_PROMPT = 200
RESPONSE = 16


def long_prompt_batch(tokenizer, pad_token_id, temperature):
    """Prompts longer than vLLM-CPU's 128-token KV block, so a stale prefix cache would show."""
    rows = []
    for i in range(4):
        text = f"What is {10 + i} + {20 + i}? " * 14
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
        ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
        assert 128 < len(ids) <= MAX_PROMPT
        rows.append({"prompt_ids": ids, "raw_prompt": [{"role": "user", "content": text}],
                     "data_source": "arithmetic", "reward_model": {"ground_truth": str(30 + 2 * i)},
                     "extra_info": {}, "index": i})
    batch = collate_prompts(rows, pad_token_id, MAX_PROMPT)
    # The actor divides logits by the temperature vLLM sampled with (rollout.temperature).
    batch.meta = BatchMeta(temperature=temperature)
    return batch


@pytest.mark.parametrize("eager, rollout_tp, lora_rank", [(True, 1, 0), (False, 1, 0), (True, 2, 0), (True, 1, 8)],
                         ids=["eager", "compiled", "rollout_tp2", "lora"])
def test_two_ranks_vllm_grpo(eager, rollout_tp, lora_rank, ray_session, tiny_model_dir, tiny_tokenizer,
                             arithmetic_files, tmp_path):
    """Also with the engine's torch.compile'd model (enforce_eager=false, the default on GPU):
    the synced weights must reach the compiled graph; with one vLLM engine split over both
    ranks (rollout TP=2 while FSDP trains over both: verl's diff_tp); and with LoRA, where each
    sync after the first pushes only the merged adapted weights and the KL's reference is the
    base model with the adapter off."""
    cfg = compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path, MAX_PROMPT, RESPONSE) + [
        f"actor_rollout_ref.rollout.enforce_eager={eager}", f"actor_rollout_ref.model.lora_rank={lora_rank}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}",
        "trainer.n_gpus_per_node=2", "trainer.cpus_per_worker=1", "trainer.total_training_steps=2",
        "trainer.test_freq=2", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.name=vllm",
        # The random model earns no reward: the entropy bonus gives the adapter a gradient (weight
        # decay alone moves a full model, not an adapter whose B starts at zero).
        f"actor_rollout_ref.actor.entropy_coeff={0.01 if lora_rank else 0.0}",
    ])
    shared_memory = set(glob.glob("/dev/shm/*"))
    trainer = build_trainer(cfg)
    assert trainer.engine_settings["tensor_parallel"] == rollout_tp
    assert trainer.engine_settings["block_size"] == 32  # prompts shorter than vLLM-CPU's 128 are shared
    # vLLM-CPU's group shared memory is unnamed once mapped: no later run trips on it, none leaks.
    assert set(glob.glob("/dev/shm/*")) <= shared_memory
    probe = long_prompt_batch(tiny_tokenizer, trainer.pad_token_id, cfg.actor_rollout_ref.rollout.temperature)
    before_rollout = trainer.workers.generate_sequences(probe)
    before = trainer.workers.compute_log_prob(before_rollout)["old_log_probs"]

    summary = trainer.fit()

    lines = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    steps = [m for m in lines if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                    "critic/score/mean", "response_length/mean", "timing_s/gen", "timing_s/update_actor",
                    "timing_s/update_weights", "perf/throughput"):
            assert math.isfinite(m[key]), (key, m[key])
        # Measured in the update's own forward: the fp32 engine samples from the trainer's weights.
        assert m["rollout_corr/abs_logp_diff_max"] <= 1e-4, m["rollout_corr/abs_logp_diff_max"]
    if lora_rank:  # adapter B starts at zero: the first step's policy is the reference
        assert steps[0]["actor/kl_loss"] == 0.0 and steps[1]["actor/kl_loss"] > 0.0
    assert [step for step, _ in summary.val_scores] == [0, 2]

    # The update changed the weights: the actor scores the same sequences differently.
    mask = before_rollout["response_mask"].bool()
    after = trainer.workers.compute_log_prob(before_rollout)["old_log_probs"]
    assert (after - before)[mask].abs().max() > 1e-4  # unchanged weights give exactly the same forward

    # After the sync, vLLM samples from exactly the trained weights.
    rollout = trainer.workers.generate_sequences(probe)
    assert len(rollout) == len(probe)  # one answer per row, whatever the rollout's layout
    recomputed = trainer.workers.compute_log_prob(rollout)["old_log_probs"]
    mask = rollout["response_mask"].bool()
    assert mask.sum() > 0
    delta = (rollout["rollout_log_probs"] - recomputed)[mask].abs().max().item()
    # The compiled graph may fuse and reorder fp32 reductions, hence a looser bound; stale
    # weights would be off by about the update's own effect.
    tolerance = 1e-4 if eager else 1e-3
    assert delta <= tolerance, f"vLLM vs actor log-prob mismatch {delta}"
    assert delta < 0.2 * (after - before)[before_rollout["response_mask"].bool()].abs().max()
    trainer.shutdown()


def test_two_ranks_hf_rollout(ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    """rollout.name=hf: transformers generate on the sharded actor, ranks kept in lock-step. With
    verl's profiler keys: torch.profiler (the actor's own profiler.tool; global_profiler.tool stays
    null) traces the second step of rank 1 only, whose finish hook then lists the traces."""
    profile = tmp_path / "profile"
    cfg = compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path, MAX_PROMPT, RESPONSE) + [
        "trainer.n_gpus_per_node=2", "trainer.cpus_per_worker=1", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=2", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.profiler.tool=torch", "global_profiler.steps=[2]",
        f"global_profiler.save_path={profile}", "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[1]",
        f"global_profiler.finish_hook_cmd='ls \"$VERL_PROFILE_SAVE_PATH/step2\" > {tmp_path}/hook_$VERL_PROFILE_RANK'",
    ])
    trainer = build_trainer(cfg)
    summary = trainer.fit()
    trainer.shutdown()
    steps = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert steps[-1]["step"] == 2 and math.isfinite(steps[-1]["actor/pg_loss"])
    assert summary.val_scores[-1][0] == 2 and 0.0 <= summary.val_scores[-1][1] <= 1.0
    assert sorted(p.relative_to(profile).as_posix() for p in profile.rglob("*")) == [
        "step2", "step2/actor_rollout_ref_rank1.json.gz", "step2/actor_rollout_ref_rank1.txt"]
    with gzip.open(profile / "step2" / "actor_rollout_ref_rank1.json.gz", "rt") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    # The step's worker calls, validation's generation among them, and the update's matmuls.
    assert {"generate_sequences", "update_actor", "aten::mm"} <= names
    assert "aten::mm" in (profile / "step2" / "actor_rollout_ref_rank1.txt").read_text()
    assert [p.name for p in tmp_path.glob("hook_*")] == ["hook_1"]
    assert (tmp_path / "hook_1").read_text().split() == ["actor_rollout_ref_rank1.json.gz", "actor_rollout_ref_rank1.txt"]
