"""Exact loss normalisation through the real workers: the same mini-batch trained by 1 rank with
1 micro-batch and by 2 FSDP ranks with 2 micro-batches each (fixed rows, or token-budget
micro-batches of the padding-free forward) gives the same losses and the same (global, pre-clip)
gradient norm, for several aggregation modes and with an all-masked row."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.main import build_trainer, compose_config
from hybrid_rl.metrics import reduce_worker_metrics
from hybrid_rl.protocol import Batch, BatchMeta
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

ROWS, PROMPT, RESPONSE = 8, 6, 5


def synthetic_batch(vocab: int, pad_id: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(2, PROMPT + 1, (ROWS,), generator=g)
    resp_lens = torch.randint(1, RESPONSE + 1, (ROWS,), generator=g)
    resp_lens[3] = 0  # a row with no response tokens must not disturb the normalisation
    prompts = torch.full((ROWS, PROMPT), pad_id)
    prompt_mask = torch.zeros(ROWS, PROMPT, dtype=torch.long)
    responses = torch.full((ROWS, RESPONSE), pad_id)
    response_mask = torch.zeros(ROWS, RESPONSE, dtype=torch.long)
    for i in range(ROWS):
        p, r = int(prompt_lens[i]), int(resp_lens[i])
        prompts[i, PROMPT - p:] = torch.randint(10, vocab, (p,), generator=g)
        prompt_mask[i, PROMPT - p:] = 1
        responses[i, :r] = torch.randint(10, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch(tensors={
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp_min(0),
        "advantages": torch.randn(ROWS, RESPONSE, generator=g) * response_mask,
        "ref_log_prob": -torch.rand(ROWS, RESPONSE, generator=g) * 3,
    }, meta=BatchMeta(temperature=1.0))


def update_metrics(mode: str, ranks: int, micro: int, model_dir, files, run_dir, tokenizer,
                   max_tokens: int | None = None) -> dict:
    """`max_tokens` switches to token-budget micro-batches (use_dynamic_bsz) instead of `micro` rows."""
    batching = ([f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_tokens}"] if max_tokens
                else ["actor_rollout_ref.actor.use_dynamic_bsz=false"])
    trainer = build_trainer(compose_config(run_overrides(model_dir, files, run_dir) + batching + [
        f"trainer.n_gpus_per_node={ranks}", "trainer.cpus_per_worker=1", "actor_rollout_ref.rollout.name=hf",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.loss_agg_mode={mode}", "actor_rollout_ref.actor.kl_loss_type=k3",
        "actor_rollout_ref.actor.entropy_coeff=0.01"]))
    try:
        batch = synthetic_batch(len(tokenizer), tokenizer.pad_token_id)
        return reduce_worker_metrics(trainer.workers.update_actor(batch))
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_one_rank_equals_two_ranks_with_micro_batches(mode, ray_session, tiny_model_dir, tiny_tokenizer,
                                                      arithmetic_files, tmp_path):
    single = update_metrics(mode, 1, ROWS, tiny_model_dir, arithmetic_files, tmp_path / "a", tiny_tokenizer)
    split = update_metrics(mode, 2, 2, tiny_model_dir, arithmetic_files, tmp_path / "b", tiny_tokenizer)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert split[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), (key, single[key], split[key])


def test_token_budget_micro_batches_are_exact(ray_session, tiny_model_dir, tiny_tokenizer, arithmetic_files, tmp_path):
    mode = "seq-mean-token-mean"
    single = update_metrics(mode, 1, ROWS, tiny_model_dir, arithmetic_files, tmp_path / "a", tiny_tokenizer)
    # 12 tokens: each rank's 4 rows (3 to 11 tokens each) need several micro-batches.
    split = update_metrics(mode, 2, ROWS, tiny_model_dir, arithmetic_files, tmp_path / "b", tiny_tokenizer,
                           max_tokens=12)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert split[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), (key, single[key], split[key])
