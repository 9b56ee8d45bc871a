"""The countdown task: generated problems are solvable and disjoint across splits, and the scorer
accepts exactly the equations that use each number once and reach the target."""

import subprocess
import sys

import pytest

from hybrid_rl.data.countdown import make_countdown_rows, problem_key
from hybrid_rl.data.dataset import read_rows
from hybrid_rl.main import REPO_ROOT
from hybrid_rl.rewards import default_compute_score
from hybrid_rl.rewards.countdown import evaluate

TRUTH = {"target": 24, "numbers": [4, 6, 1]}


def score(answer, truth=TRUTH):
    return default_compute_score("countdown", f"<think>try things</think> <answer>{answer}</answer>", truth)


@pytest.mark.parametrize("answer", ["4 * 6 * 1", "(4 * 6) / 1", "6 * 4 * 1 = 24", " 1 * (6 * 4) "])
def test_right_equations(answer):
    assert score(answer) == 1.0


@pytest.mark.parametrize("answer", [
    "4 * 6",                 # a number left out
    "4 * 6 * 1 * 1",         # a number used twice
    "4 * 6 + 1",             # misses the target
    "4 * 6 * 1 = 25",        # claims another target
    "4 * 6 * 1**1",          # a power
    "__import__('os')",      # not arithmetic at all
    "4 * 6 / (1 - 1)",       # division by zero
    "",
])
def test_wrong_equations(answer):
    assert score(answer) == 0.0


def test_the_equation_must_be_in_the_answer_tags():
    assert default_compute_score("countdown", "4 * 6 * 1", TRUTH) == 0.0


def test_evaluation_is_exact():
    assert evaluate("7 / 2 * 2") == 7 and evaluate("1 / 3 + 1 / 3 + 1 / 3") == 1
    assert evaluate("2 ** 3") is None and evaluate("(1") is None


def test_tinyzero_rows_score_unchanged():
    # TinyZero's countdown rows: data_source "countdown", ground_truth {"target", "numbers"}.
    row = {"data_source": "countdown", "reward_model": {"style": "rule", "ground_truth": {"target": 98,
                                                                                           "numbers": [44, 19, 35]}}}
    assert default_compute_score(row["data_source"], "<answer>44 + 19 + 35</answer>",
                                 row["reward_model"]["ground_truth"]) == 1.0
    with pytest.raises(ValueError, match="countdown ground_truth must be"):
        default_compute_score("countdown", "<answer>1</answer>", "98")


def test_generated_problems_are_solvable_distinct_and_deterministic():
    rows = make_countdown_rows(300, seed=5)
    assert rows == make_countdown_rows(300, seed=5)
    assert len({problem_key(r) for r in rows}) == 300
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        solution = row["extra_info"]["solution"]
        assert len(truth["numbers"]) in (3, 4) and 1 <= truth["target"] <= 1000
        # Checked independently of the scorer: Python's own arithmetic on the written solution.
        assert abs(eval(solution) - truth["target"]) < 1e-9  # noqa: S307 (our own generated text)
        assert sorted(int(t) for t in solution.replace("(", " ").replace(")", " ").split() if t.isdigit()) == \
            sorted(truth["numbers"])
        assert score(solution, truth) == 1.0
    with pytest.raises(ValueError, match="could only make"):
        make_countdown_rows(50, lo=1, hi=1, counts=(2,), max_target=3)


def test_the_data_tool_writes_disjoint_splits(tmp_path):
    done = subprocess.run([sys.executable, "tools/data/countdown.py", "--out-dir", str(tmp_path), "--train-size", "200",
                           "--test-size", "50"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    train, test = (read_rows(str(tmp_path / f"{s}.parquet")) for s in ("train", "test"))
    assert len(train) == 200 and len(test) == 50
    assert not {problem_key(r) for r in train} & {problem_key(r) for r in test}
    bad = subprocess.run([sys.executable, "tools/data/countdown.py", "--out-dir", str(tmp_path), "--min", "5",
                          "--max", "2"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "error: countdown needs 1 <= min <= max" in bad.stderr
