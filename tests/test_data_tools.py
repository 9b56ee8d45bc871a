"""tools/data/: the preparation scripts write verl's schema that the built-in scorers grade."""

from __future__ import annotations

import json
import subprocess
import sys

from hybrid_rl.data.dataset import read_rows
from hybrid_rl.main import REPO_ROOT
from hybrid_rl.rewards import default_compute_score

GSM8K_ROWS = [
    {"question": "Ana has 3 apples and buys 4 more. How many apples does she have?",
     "answer": "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day. How many in 2 days?",
     "answer": "1,200 * 2 = <<1200*2=2400>>2,400\n#### 2,400"},
]


def run_tool(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_gsm8k_from_local_files(tmp_path):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    done = run_tool("tools/data/gsm8k.py", "--out-dir", str(tmp_path / "out"), "--train-file", str(source),
                    "--test-file", str(source))
    assert done.returncode == 0, done.stderr
    rows = read_rows(str(tmp_path / "out" / "test.parquet"))
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["7", "2400"]
    assert rows[1]["data_source"] == "openai/gsm8k" and rows[1]["extra_info"]["split"] == "test"
    assert rows[0]["prompt"][0]["content"].startswith(GSM8K_ROWS[0]["question"]) and '"####"' in rows[0]["prompt"][0]["content"]
    for row, source_row in zip(rows, GSM8K_ROWS):  # the reference solution scores 1 with the built-in scorer
        assert default_compute_score(row["data_source"], source_row["answer"], row["reward_model"]["ground_truth"]) == 1.0


def test_a_row_without_an_answer_marker_is_named(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    done = run_tool("tools/data/gsm8k.py", "--out-dir", str(tmp_path), "--train-file", str(source),
                    "--test-file", str(source))
    assert done.returncode == 1 and "train row 0 has no '#### <answer>'" in done.stderr


def test_arithmetic_tool_writes_train_test_and_shifted_sets(tmp_path):
    done = run_tool("tools/data/arithmetic.py", "--out-dir", str(tmp_path), "--train-size", "50", "--test-size", "10",
                    "--shifted-size", "5", "--phrasing", "question", "--ops", "+-*")
    assert done.returncode == 0, done.stderr
    train, test, shifted = (read_rows(str(tmp_path / f"{name}.parquet")) for name in ("train", "test", "shifted"))
    assert len(train) == 50 and len(test) == 10 and len(shifted) == 15
    assert all(row["extra_info"]["phrasing"] == "question" for row in train + test)
    assert {row["data_source"] for row in shifted} == {"arithmetic/wide", "arithmetic/question", "arithmetic/words"}


def test_arithmetic_tool_asks_every_set_in_the_tags_format(tmp_path):
    done = run_tool("tools/data/arithmetic.py", "--out-dir", str(tmp_path), "--train-size", "20", "--test-size", "5",
                    "--shifted-size", "3", "--answer-format", "tags")
    assert done.returncode == 0, done.stderr
    rows = [r for name in ("train", "test", "shifted") for r in read_rows(str(tmp_path / f"{name}.parquet"))]
    assert len(rows) == 34 and all(r["extra_info"]["answer_format"] == "tags" for r in rows)
    assert all(r["prompt"][0]["content"].endswith("inside <answer> </answer>.") for r in rows)


DAPO_ROWS = [
    {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve 2x = 6. The last line of your response "
                                              "should be of the form Answer: $Answer"}],
     "ability": "MATH", "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "3"},
     "extra_info": {"index": "a"}},
]


def test_dapo_math_from_local_files_is_scored_by_the_answer_line(tmp_path):
    source = tmp_path / "dapo.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in DAPO_ROWS * 3))
    done = run_tool("tools/data/dapo_math.py", "--out-dir", str(tmp_path / "out"), "--train-file", str(source),
                    "--test-file", str(source), "--unique")
    assert done.returncode == 0, done.stderr
    (row,) = read_rows(str(tmp_path / "out" / "dapo-math-17k.parquet"))
    assert len(read_rows(str(tmp_path / "out" / "aime-2024.parquet"))) == 1
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], "2x = 6, so x = 3.\nAnswer: $3$", truth)["acc"] is True
    assert default_compute_score(row["data_source"], "x is 3", truth) == {"score": -1.0, "acc": False, "pred": None}
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    done = run_tool("tools/data/dapo_math.py", "--out-dir", str(tmp_path), "--train-file", str(plain), "--test-file",
                    str(plain))
    assert done.returncode == 1 and "not in verl's schema" in done.stderr


MATH_TRAIN_ROWS = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 2", "type": "Prealgebra",
     "solution": "We get $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$."},
    {"problem": "Solve $x^2 = 4$ for $x > 0$.", "level": "Level 3", "type": "Algebra",
     "solution": "Taking roots, $x = \\boxed{2}$."},
    {"problem": "Find the interval where $x^2 < 1$.", "level": "Level 5", "type": "Algebra",
     "solution": "It is $\\boxed{(-1, 1)}$."},
]
MATH500_ROWS = [{"problem": "Compute $3 \\cdot 4$.", "answer": "12", "level": 1, "subject": "Prealgebra",
                 "solution": "$3 \\cdot 4 = 12$."}]


def test_math_keeps_the_asked_levels_and_its_reference_answers_score_one(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "math500.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in MATH_TRAIN_ROWS))
    test.write_text("".join(json.dumps(row) + "\n" for row in MATH500_ROWS))
    done = run_tool("tools/data/hendrycks_math.py", "--out-dir", str(tmp_path / "out"), "--train-file", str(train),
                    "--test-file", str(test), "--levels", "3", "4", "5", "--template", "qwen-math")
    assert done.returncode == 0, done.stderr
    rows = read_rows(str(tmp_path / "out" / "train.parquet"))
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["2", "(-1, 1)"]
    assert [row["extra_info"]["level"] for row in rows] == [3, 5]
    assert rows[0]["prompt"][0]["role"] == "system" and "\\boxed{}" in rows[0]["prompt"][0]["content"]
    assert rows[0]["prompt"][1] == {"role": "user", "content": MATH_TRAIN_ROWS[1]["problem"]}
    for row, source in zip(rows, MATH_TRAIN_ROWS[1:]):  # the reference solution is right, a wrong one is not
        assert default_compute_score(row["data_source"], source["solution"], row["reward_model"]["ground_truth"]) == \
            {"score": 1.0, "acc": True, "pred": row["reward_model"]["ground_truth"]}
        assert default_compute_score(row["data_source"], "so $\\boxed{7}$", row["reward_model"]["ground_truth"])["score"] == 0.0
    (test_row,) = read_rows(str(tmp_path / "out" / "test.parquet"))  # every level kept; the answer column used
    assert test_row["data_source"] == "HuggingFaceH4/MATH-500" and test_row["reward_model"]["ground_truth"] == "12"
    assert test_row["prompt"][-1]["content"].startswith(MATH500_ROWS[0]["problem"])


def test_math_rows_without_an_answer_or_of_no_asked_level_are_named(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"problem": "p", "level": "Level 4", "solution": "no box"}) + "\n")
    done = run_tool("tools/data/hendrycks_math.py", "--out-dir", str(tmp_path), "--train-file", str(source), "--test-file", str(source))
    assert done.returncode == 1 and "train row 0 has neither an answer nor a \\boxed{} answer" in done.stderr
    done = run_tool("tools/data/hendrycks_math.py", "--out-dir", str(tmp_path), "--train-file", str(source), "--test-file",
                    str(source), "--levels", "1")
    assert done.returncode == 1 and "no train problem is of level 1" in done.stderr
