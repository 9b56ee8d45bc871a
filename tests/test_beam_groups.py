"""Beam-search groups (rollout.beam_search): the groups of a batch, transformers' beams with their
log-probs against an unbatched beam search and a teacher-forced forward, and a training step on
vLLM's beam search whose rollout log-probs match the actor's."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_rl.config import ConfigError
from hybrid_rl.main import build_trainer, compose_config, prepare
from hybrid_rl.protocol import Batch
from hybrid_rl.workers.rollout import HFRollout, beam_groups, sampling_settings
from tests.conftest import run_overrides

QUESTIONS = ["What is 12 + 34?", "minus 17 and 3.5 dollars"]


def test_groups_are_runs_of_one_uid():
    batch = Batch(non_tensors={"uid": ["a", "a", "a", "b", "b", "c"]})
    assert beam_groups(batch) == [(0, 3), (3, 2), (5, 1)]


def test_transformers_beams_and_their_log_probs(tiny_model_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [tiny_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False) for q in QUESTIONS]
    ids = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width, n = max(map(len, ids)), 3
    input_ids = torch.full((2 * n, width), tiny_tokenizer.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for i in range(2 * n):
        row = ids[i // n]
        input_ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
    batch = Batch(tensors={"input_ids": input_ids, "attention_mask": mask},
                  non_tensors={"uid": ["p0"] * n + ["p1"] * n})
    rollout = HFRollout(model, tiny_tokenizer.pad_token_id, [tiny_tokenizer.eos_token_id])
    settings = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1, "beam_width": n}
    tokens, log_probs = rollout.generate(batch, settings, response_length=8)
    assert len(tokens) == 2 * n
    for g, row in enumerate(ids):
        alone = model.generate(torch.tensor([row]), num_beams=n, num_return_sequences=n, do_sample=False,
                               max_new_tokens=8, pad_token_id=tiny_tokenizer.pad_token_id,
                               eos_token_id=[tiny_tokenizer.eos_token_id])
        beams = [seq[len(row):].tolist() for seq in alone]
        assert [t[:len(b)] for t, b in zip(tokens[g * n:(g + 1) * n], beams)] == beams  # best first
        assert len({tuple(b) for b in beams}) == n  # n different responses, not n copies
        for response, logp in zip(tokens[g * n:(g + 1) * n], log_probs[g * n:(g + 1) * n]):
            end = response.index(tiny_tokenizer.eos_token_id) + 1 if tiny_tokenizer.eos_token_id in response \
                else len(response)
            with torch.no_grad():
                logits = model(torch.tensor([row + response[:end]])).logits[0, len(row) - 1:-1]
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(response[:end])[:, None])[:, 0]
            assert torch.allclose(torch.tensor(logp[:end]), expected, atol=1e-4)


def test_sampling_settings_pick_beams_for_training_only():
    cfg = compose_config(["actor_rollout_ref.rollout.beam_search=true", "actor_rollout_ref.rollout.n=3"])
    rollout = cfg.actor_rollout_ref.rollout
    assert sampling_settings(rollout, validate=False)["beam_width"] == 3
    assert "beam_width" not in sampling_settings(rollout, validate=True)


@pytest.mark.slow
def test_a_step_on_vllm_beam_groups(ray_session, tiny_model_dir, tiny_tokenizer, arithmetic_files, tmp_path):
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run", response=8) + [
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.rollout.beam_search=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
        f"trainer.rollout_data_dir={tmp_path}/rollouts"]
    trainer = build_trainer(compose_config(overrides))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    step = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    print({k: v for k, v in step.items() if "rollout_corr" in k or "response_length" in k})
    assert step["rollout_corr/abs_logp_diff_max"] < 1e-3  # the beams' log-probs are the policy's
    rows = [json.loads(line) for line in open(tmp_path / "rollouts" / "1.jsonl")]
    groups = [rows[i:i + 3] for i in range(0, 12, 3)]
    assert all(len({row["input"] for row in group}) == 1 for group in groups)
    assert all(len({row["output"] for row in group}) == 3 for group in groups)  # three different beams


def test_beam_groups_that_cannot_work_are_refused(tmp_path, tiny_model_dir, arithmetic_files):
    base = run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run") + ["actor_rollout_ref.rollout.beam_search=true"]
    with pytest.raises(ConfigError, match="needs actor_rollout_ref.rollout.n >= 2"):
        prepare(compose_config(base + ["actor_rollout_ref.rollout.n=1"]))
    with pytest.raises(ConfigError, match="must be a multiple of the 2 ranks"):
        prepare(compose_config(base + ["trainer.n_gpus_per_node=2", "data.train_batch_size=3",
                                       "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]))
