"""GRPO learns: a tiny random model's reward on a trivially learnable task (write many '7's)
rises clearly within a few dozen steps. Uses the real CLI config path, custom reward loading,
one FSDP2 rank and the in-process vLLM engine, with the default precision (`dtype: auto`): where
the CPU has bf16 instructions, bf16 autocast for training and a bf16 engine fed from float32
master weights; elsewhere float32."""

from __future__ import annotations

import json
import os

import pytest

from hybrid_rl.main import build_trainer, compose_config
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Fraction of the response's characters that are the digit 7."""
    return solution_str.count("7") / max(1, len(solution_str))
'''


def test_reward_rises(ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    reward_file = tmp_path / "sevens.py"
    reward_file.write_text(REWARD)
    steps = 30
    cfg = compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run") + [
        f"custom_reward_function.path={reward_file}", f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "data.val_files=null",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.optim.lr=3e-3", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.fsdp_config.dtype=auto", "actor_rollout_ref.rollout.dtype=auto",
    ])
    trainer = build_trainer(cfg)
    trainer.fit()
    trainer.shutdown()
    scores = [json.loads(line)["critic/score/mean"]
              for line in open(os.path.join(tmp_path, "run", "metrics.jsonl"))]
    assert len(scores) == steps
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > 3 * first and last > first + 0.15, scores
