"""GRPO and PPO with the Megatron engine through the real driver (`--config-name=ppo_megatron_trainer`):
TP=2 and PP=2 over two gloo ranks, feeding in-process vLLM engines (one per rank, or one split over
both ranks) through the Megatron weight export; after every sync vLLM samples from exactly the
trained weights. PPO's critic runs on
Megatron as well."""

from __future__ import annotations

import json
import math
import os

import pytest

from hybrid_rl.main import build_trainer, compose_config
from tests.conftest import run_overrides
from tests.test_end_to_end import MAX_PROMPT, RESPONSE, long_prompt_batch

pytestmark = pytest.mark.slow


def megatron_overrides(tp: int, pp: int) -> list[str]:
    return [f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
            f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
            # fp32 like the FSDP runs of the tests (`auto` is bf16 on CPUs with bf16 instructions)
            "actor_rollout_ref.actor.megatron.dtype=fp32"]


# PPO: GAE with the critic on Megatron too (same layout: one process holds every role).
PPO = ["algorithm.adv_estimator=gae", "critic.megatron.pipeline_model_parallel_size=2", "critic.megatron.dtype=fp32",
       "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=4"]


# verl 0.4-0.5's Megatron actor profiler, on rank 1: the first update's one optimizer step.
UPDATE_PROFILE = ["actor_rollout_ref.actor.profile.use_profile=true", "actor_rollout_ref.actor.profile.profile_ranks=[1]",
                  "actor_rollout_ref.actor.profile.step_start=0", "actor_rollout_ref.actor.profile.step_end=1"]


# The rollout's own tensor parallelism differs from training's in each case (verl's diff_tp): TP=2
# training into one vLLM engine per rank, PP=2 training into one engine split over both ranks.
@pytest.mark.parametrize("tp, pp, rollout_tp, algorithm", [(2, 1, 1, []), (1, 2, 2, []), (1, 2, 1, PPO)],
                         ids=["tp2", "pp2_rollout_tp2", "ppo_pp2"])
def test_megatron_syncs_exact_weights_into_vllm(tp, pp, rollout_tp, algorithm, ray_session, tiny_model_dir,
                                                     tiny_tokenizer, arithmetic_files, tmp_path):
    profile = tmp_path / "update_profile"
    cfg = compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path, MAX_PROMPT, RESPONSE) + [
        *megatron_overrides(tp, pp), *algorithm, "trainer.n_gpus_per_node=2", "trainer.cpus_per_worker=1",
        *UPDATE_PROFILE, f"actor_rollout_ref.actor.profile.save_path={profile}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ], config_name="ppo_megatron_trainer")
    trainer = build_trainer(cfg)
    assert trainer.engine_settings["tensor_parallel"] == rollout_tp
    probe = long_prompt_batch(tiny_tokenizer, trainer.pad_token_id, cfg.actor_rollout_ref.rollout.temperature)
    before_rollout = trainer.workers.generate_sequences(probe)
    before = trainer.workers.compute_log_prob(before_rollout)["old_log_probs"]

    trainer.fit()

    steps = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        keys = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "timing_s/update_weights")
        for key in keys + (("critic/vf_loss", "critic/grad_norm") if algorithm else ()):
            assert math.isfinite(m[key]), (key, m[key])
        # vLLM's sampling log-probs against the update's own forward (step 2: after a sync)
        assert m["rollout_corr/abs_logp_diff_max"] <= 1e-4, m["rollout_corr/abs_logp_diff_max"]

    mask = before_rollout["response_mask"].bool()
    after = trainer.workers.compute_log_prob(before_rollout)["old_log_probs"]
    assert (after - before)[mask].abs().max() > 1e-4  # the updates moved the weights (else exactly 0)

    rollout = trainer.workers.generate_sequences(probe)
    recomputed = trainer.workers.compute_log_prob(rollout)["old_log_probs"]
    mask = rollout["response_mask"].bool()
    assert mask.sum() > 0
    assert (rollout["rollout_log_probs"] - recomputed)[mask].abs().max() <= 1e-4
    trainer.shutdown()
    # The profile: rank 1's first update (of two), its optimizer step inside the trace.
    (trace,) = profile.iterdir()
    assert trace.name == "prof_start_0_end_1_rank_1.json"
    with open(trace) as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"ProfilerStep#0", "aten::mm"} <= names and "ProfilerStep#1" not in names
