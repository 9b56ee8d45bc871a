"""DAPO's dynamic sampling and overlong buffer in real runs of the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from hybrid_rl.main import REPO_ROOT
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

# Every response to a prompt with an even answer scores 1 (a group with nothing to learn from);
# responses to the other prompts score by their length's parity, so most of those groups differ.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    even = int(ground_truth) % 2 == 0
    acc = 1.0 if even else float(len(solution_str) % 2)
    return {"score": acc, "acc": acc, "even_answer": even}
'''
RESPONSE = 12


def run(tmp_path, tiny_model_dir, arithmetic_files, *extra):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path, response=RESPONSE) + [
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "data.train_batch_size=4", "data.gen_batch_size=3", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=hf", "trainer.cpus_per_worker=1", "ray_kwargs.ray_init.num_cpus=2",
        f"custom_reward_function.path={reward}", "algorithm.filter_groups.enable=true",
        f"trainer.rollout_data_dir={tmp_path}/rollouts", *extra]
    return subprocess.run([sys.executable, "-m", "hybrid_rl.main", *overrides], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)


def test_dynamic_sampling_trains_only_groups_that_differ_and_the_overlong_buffer_penalises(
        tiny_model_dir, arithmetic_files, tmp_path):
    done = run(tmp_path, tiny_model_dir, arithmetic_files, "algorithm.filter_groups.metric=acc",
               "reward_model.overlong_buffer.enable=true", f"reward_model.overlong_buffer.len={RESPONSE}",
               "reward_model.overlong_buffer.penalty_factor=0.5", "reward_model.overlong_buffer.log=true",
               "reward_model.reward_manager=dapo")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # trainer.test_freq=-1 with validation files: no validation, not even at the last step (as in verl).
    assert [row["step"] for row in steps] == [1, 2] and not [key for row in steps for key in row if key.startswith("val")]
    for step in (1, 2):
        metrics = steps[step - 1]
        # Three prompts per generation batch, four kept prompts a step: at least two batches.
        assert metrics["dynamic_sampling/generation_batches"] >= 2
        assert 0 < metrics["dynamic_sampling/zero_variance_groups"] < 1
        assert metrics["critic/score/zero_variance_groups"] == 0
        assert metrics["reward/overlong_penalty/mean"] < 0

        rows = [json.loads(line) for line in open(tmp_path / "rollouts" / f"{step}.jsonl")]
        assert len(rows) == 4 * 3  # train_batch_size x n, the surplus dropped
        groups = defaultdict(list)
        for row in rows:
            groups[row["input"]].append(row)
            assert not row["even_answer"]
            # The penalty is added to the reward function's score; the whole buffer is the response
            # length here, so every response with a token is penalised.
            assert row["score"] == pytest.approx(row["acc"] + row["overlong_reward"], abs=1e-6)
            assert -0.5 <= row["overlong_reward"] < 0 and row["overlong"]
        assert len(groups) == 4 and all(len({r["acc"] for r in group}) == 2 for group in groups.values())


def test_dynamic_sampling_stops_with_a_clear_error_when_no_group_differs(tiny_model_dir, arithmetic_files, tmp_path):
    # acc never differs within a group of even answers; only even answers pass this metric's check.
    done = run(tmp_path, tiny_model_dir, arithmetic_files, "algorithm.filter_groups.metric=even_answer",
               "algorithm.filter_groups.max_num_gen_batches=2")
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: dynamic sampling (algorithm.filter_groups) made 2 generation batches")
    assert "kept only 0 of the 4 prompts" in error and "raise max_num_gen_batches" in error
    assert "Traceback" not in done.stderr
