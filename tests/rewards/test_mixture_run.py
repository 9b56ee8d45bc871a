"""A training run whose reward mixes the sandboxed unit-test reward with a function, on code rows."""

import json
import os
import shutil

import pytest

from hybrid_rl.main import build_trainer, compose_config
from tests.conftest import run_overrides, write_jsonl

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]

SHORT = '''
def short(data_source, solution_str, ground_truth, extra_info=None):
    return None if extra_info["index"] % 2 else -len(solution_str) / 100
'''


def code_rows(n: int, split: str) -> list[dict]:
    rows = []
    for i in range(n):
        k = i % 5 + 1
        tests = {"tests": [f"assert times(2) == {2 * k}", "assert times(0) == 0"]}
        rows.append({"data_source": "code", "prompt": [{"role": "user", "content": f"Write times(x) returning x * {k}."}],
                     "reward_model": {"style": "rule", "ground_truth": json.dumps(tests)},
                     "extra_info": {"split": split, "index": i}})
    return rows


def test_a_run_with_code_tests_and_a_weighted_function(ray_session, tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    files = (write_jsonl(data / "train.jsonl", code_rows(16, "train")), write_jsonl(data / "val.jsonl", code_rows(4, "test")))
    (tmp_path / "short.py").write_text(SHORT)
    overrides = run_overrides(tiny_model_dir, files, tmp_path / "run", response=12) + [
        "trainer.total_training_steps=1", "trainer.val_before_train=true", "trainer.test_freq=1",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        f"reward.funcs=[code_tests,'{tmp_path}/short.py:short']", "reward.weights=[1.0,0.5]",
        "reward.sandbox.timeout_s=5"]
    trainer = build_trainer(compose_config(overrides))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    step = next(m for m in lines if "reward/code_tests/mean" in m)
    # The tiny random model writes no working code: every test fails, and no run hangs or crashes.
    assert step["reward/code_tests/mean"] == 0.0 and step["reward/code_tests/sandbox_failures"] == 0.0
    # score = 0.5 x short on the rows where short scores (its exact sums: test_mixture.py)
    assert step["reward/short/mean"] < 0 and 0.5 * step["reward/short/mean"] <= step["critic/score/mean"] < 0
    assert any("val/reward/code_tests/mean" in m for m in lines)
