"""tools/evaluate.py (hybrid-rl-evaluate): the pass@k estimator, and a real evaluation of a model
and of a run's checkpoint."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from hybrid_rl.evaluate import pass_at_k, score_of
from hybrid_rl.main import REPO_ROOT


@pytest.mark.parametrize("n, correct, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 6, 4), (8, 3, 8), (7, 1, 7)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_response(n, correct, k):
    responses = [True] * correct + [False] * (n - correct)
    subsets = list(itertools.combinations(responses, k))
    assert pass_at_k(n, correct, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 1, 5)


def test_correctness_follows_acc_when_the_scorer_gives_it():
    assert score_of(1.0) == (1.0, True) and score_of(0.1) == (0.1, False)
    assert score_of({"score": 0.1, "acc": True}) == (0.1, True)
    assert score_of({"score": 1.0, "acc": 0}) == (1.0, False)


@pytest.mark.slow
def test_evaluates_a_model_and_a_run_checkpoint_the_same(straight_run, arithmetic_files, tmp_path):
    # test_resume's uninterrupted run: its final model and its run folder (whose latest checkpoint
    # is the same step) are evaluated.
    run_dir = straight_run("vllm", "fsdp")
    results = {}
    for name, model in (("final", run_dir / "final_model"), ("checkpoint", run_dir)):
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, "tools/evaluate.py", "--model", str(model), "--data", arithmetic_files[1],
                               "--n", "3", "--k", "1", "2", "3", "--max-response-length", "12", "--out", str(out),
                               "--samples", str(tmp_path / f"{name}.jsonl")],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[name] = json.loads(out.read_text())
        assert "greedy" in done.stdout and "pass@3" in done.stdout
    final, checkpoint = (results[name]["files"][arithmetic_files[1]] for name in ("final", "checkpoint"))
    # The exported checkpoint is the final model: the same answers, the same scores.
    assert final == checkpoint
    metrics = final["arithmetic"]
    assert metrics["prompts"] == 6 and set(metrics) == {"prompts", "greedy", "mean@3", "pass@1", "pass@2", "pass@3"}
    assert metrics["pass@1"] == pytest.approx(metrics["mean@3"])  # 0/1 scores: pass@1 is the mean
    assert metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@3"]
    rows = [json.loads(line) for line in open(tmp_path / "final.jsonl")]
    assert len(rows) == 6 and all(len(row["samples"]) == 3 for row in rows)


def test_a_missing_data_file_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "tools/evaluate.py", "--data", str(tmp_path / "nope.parquet")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "nope.parquet" in done.stderr
