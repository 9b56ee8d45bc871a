"""Training a reward model with hybrid-rl-reward-model: sampling and labelling, pair forming, a
pointwise and a pairwise run that learn held-out prompts, the saved folder, bad data files."""

import json
import random

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from hybrid_rl.engines import Head
from hybrid_rl.main import check_reward_model
from hybrid_rl.rewards.model_inputs import RewardInputs, collate_rows
from hybrid_rl.rewards.training import (RewardDataError, main, pairs_from_labels, read_examples, split_by_prompt,
                                        token_rows, train_reward_model)
from tests.conftest import write_jsonl
from tests.rewards.test_reward_model import reward_model_dir  # noqa: F401 (a fixture)


def labelled_rows(n_prompts: int, seed: int = 0) -> list[dict]:
    """Two good and two bad responses per prompt; good ones give a number, bad ones refuse."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_prompts):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt = [{"role": "user", "content": f"What is {a} + {b}?"}]
        for good in (f"The answer is {a + b}. #### {a + b}", f"{a + b}"):
            rows.append({"prompt": prompt, "response": good, "label": 1.0})
        for bad in ("minus and dollars", "What is it?"):
            rows.append({"prompt": prompt, "response": bad, "label": 0.0})
    return rows


def test_pairs_pair_the_best_with_the_worst_while_labels_differ():
    prompt = [{"role": "user", "content": "q"}]
    rows = [{"prompt": prompt, "response": str(k), "label": label} for k, label in enumerate([0.0, 1.0, 0.5, 1.0])]
    pairs = pairs_from_labels(rows, random.Random(0))
    assert [(b["label"], w["label"]) for b, w in pairs] == [(1.0, 0.0), (1.0, 0.5)]
    assert pairs_from_labels([dict(r, label=1.0) for r in rows], random.Random(0)) == []


@pytest.mark.parametrize("loss", ["pointwise", "pairwise"])
def test_training_learns_held_out_prompts_and_saves_a_reward_model(tmp_path, tiny_model_dir, loss):
    rows = labelled_rows(40)  # in two files (responses of two policies, say), read together
    data = [write_jsonl(tmp_path / "first.jsonl", rows[:50]), write_jsonl(tmp_path / "second.jsonl", rows[50:])]
    out = tmp_path / "rm"
    result = train_reward_model(data, str(out), tiny_model_dir, loss=loss, epochs=3, lr=1e-3, batch_size=16,
                                micro_batch_size=8, val_fraction=0.25, dtype="fp32")
    before, after = result["before"], result["after"]
    assert result["val_rows"] == 40 and after["pairs"] == 20  # 10 held-out prompts, 2 pairs each
    assert after["pairwise_loss"] < before["pairwise_loss"] and after["pairwise_accuracy"] >= 0.9
    if loss == "pointwise":
        assert after["pointwise_loss"] < before["pointwise_loss"] and after["pointwise_accuracy"] >= 0.9
    # The folder is a reward model that transformers loads and our start-up check accepts, and it
    # scores as the trained engine did.
    assert check_reward_model_folder(out)
    model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    rows, _ = read_examples(data)
    from transformers import AutoTokenizer

    tokens = token_rows([(r, "response") for r in rows[:4]], AutoTokenizer.from_pretrained(out))
    with torch.no_grad():
        scores = [model(input_ids=torch.tensor([p + r])).logits[0, 0].item() for p, r in tokens]
    assert scores[0] > 0 > scores[2] if loss == "pointwise" else scores[0] > scores[2]
    saved = json.loads((out / "reward_model_training.json").read_text())
    assert saved["after"] == after and len(saved["curve"]) == 3 * -(-result["train_examples"] // (
        16 if loss == "pointwise" else 8))


def check_reward_model_folder(path) -> bool:
    from omegaconf import OmegaConf

    check_reward_model(OmegaConf.create({"model": {"path": str(path), "trust_remote_code": False},
                                        "process": {"enable": False}}), "--out")
    return True


def test_a_fresh_score_head_is_drawn_from_the_seed(tmp_path, tiny_model_dir):
    """Starting from a policy, the score head is new: the same --seed gives the same model."""
    data = write_jsonl(tmp_path / "labelled.jsonl", labelled_rows(8))

    def trained(seed: int, name: str) -> dict:
        train_reward_model(data, str(tmp_path / name), tiny_model_dir, epochs=1, lr=1e-3, batch_size=16,
                           micro_batch_size=8, val_fraction=0.25, seed=seed, dtype="fp32")
        return AutoModelForSequenceClassification.from_pretrained(tmp_path / name).score.weight

    first, again, other = trained(0, "a"), trained(0, "b"), trained(1, "c")
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_sampled_rows_carry_the_policys_tokens_and_rule_labels(tmp_path, tiny_model_dir, arithmetic_files):
    out = tmp_path / "samples.jsonl"
    assert main(["sample", "--prompts", arithmetic_files[1], "--out", str(out), "--model", tiny_model_dir,
                 "--n", "2", "--max-response-length", "6"]) == 0
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 12  # 6 prompts x 2
    for row in rows:
        assert row["label"] in (0.0, 1.0) and row["data_source"] == "arithmetic"
        assert 0 < len(row["response_ids"]) <= 6 and row["prompt"][-1]["role"] == "user"
    # the rows train as the very tokens the policy saw and wrote
    (prompt, response), = token_rows([(rows[0], "response")], None)
    assert (prompt, response) == (rows[0]["prompt_ids"], rows[0]["response_ids"])
    assert collate_rows([(prompt, response)], 0)["responses"][0].tolist() == response


def test_bad_data_files_are_refused(tmp_path, tiny_model_dir, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "answer": "a"}])
    with pytest.raises(RewardDataError, match="needs prompt,\\s+response and label"):
        read_examples(bad)
    out_of_range = write_jsonl(tmp_path / "range.jsonl", [{"prompt": "q", "response": "a", "label": 3}])
    with pytest.raises(RewardDataError, match="label 3 is not a number in"):
        read_examples(out_of_range)
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    assert main(["train", "--data", prefs, "--out", str(tmp_path / "rm"), "--base", tiny_model_dir]) == 2
    assert "train with --loss pairwise" in capsys.readouterr().err
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "q", "response": r, "label": 1.0} for r in "ab"])
    with pytest.raises(RewardDataError, match="no training examples"):
        train_reward_model(same, str(tmp_path / "rm"), tiny_model_dir, loss="pairwise", val_fraction=0.0)
    assert not (tmp_path / "rm").exists()


def step_rows(n_prompts: int, seed: int = 0) -> list[dict]:
    """Labelled steps: a step is good when it checks (ok, fine, right) and bad when it doubts
    (wrong, bad, no); every response mixes both, in random order."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_prompts):
        prompt = [{"role": "user", "content": f"Check item {i}."}]
        labels = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in range(rng.randint(0, 2))]
        rng.shuffle(labels)
        steps = [f"step {k} is {rng.choice(['ok', 'fine', 'right'] if good else ['wrong', 'bad', 'no'])}"
                 for k, good in enumerate(labels)]
        rows.append({"prompt": prompt, "steps": steps, "labels": labels})
    return rows


@pytest.mark.parametrize("scorer", ["token_classifier", "step_tag"])
def test_a_process_reward_model_learns_held_out_steps_and_scores_them_where_rl_reads_them(tmp_path, tiny_model_dir,
                                                                                         scorer):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from hybrid_rl.engines import Output
    from hybrid_rl.workers.reward_model import place_step_scores, tag_token_ids_of
    from tests.rewards.test_process_reward_model import prm_engine
    from tests.rewards.test_reward_model import engine as reward_model_engine, rollouts

    data = write_jsonl(tmp_path / "steps.jsonl", step_rows(48))
    out = tmp_path / "prm"
    tag = {"step_tag": " ки"} if scorer == "step_tag" else {}
    result = train_reward_model(data, str(out), tiny_model_dir, epochs=4, lr=1e-3, batch_size=8, micro_batch_size=8,
                                val_fraction=0.25, dtype="fp32", **tag)
    before, after = result["before"], result["after"]
    assert result["val_rows"] == 12 and after["steps"] >= 24
    assert after["step_loss"] < before["step_loss"] and after["step_accuracy"] >= 0.9
    # The folder passes the start-up check of reward_model.process.* ...
    check_reward_model(OmegaConf.create({"model": {"path": str(out), "trust_remote_code": False},
                                        "process": {"enable": True, "step_tag": tag.get("step_tag")}}), "--out")
    # ... and scored as RL reads it (the policy's tokens of held-out responses, then EOS), its
    # step scores tell the good steps from the bad.
    tokenizer = AutoTokenizer.from_pretrained(out)
    _, held_out = split_by_prompt(read_examples(data)[0], 0.25, random.Random(0))  # as the training split them
    batch = rollouts(tokenizer, [row["prompt"] for row in held_out], ["\n".join(row["steps"]) for row in held_out])
    if scorer == "step_tag":
        engine = reward_model_engine(str(out), packing="padded", head=Head.STEP_TAG,
                                     tag_token_ids=tag_token_ids_of(tokenizer, ["+", "-"]))
    else:
        engine = prm_engine(str(out))
    rows, _, steps = RewardInputs(tokenizer, tokenizer, None, tag.get("step_tag")).with_steps(batch, "\n")
    token_scores = engine.infer(rows, Output.TOKEN_SCORES, 1.0, 4, None)["token_scores"]
    step_scores, step_mask = place_step_scores(token_scores, steps, batch["responses"].shape)
    labels = torch.tensor([label for row in held_out for label in row["labels"]])
    assert int(step_mask.sum()) == len(labels)
    assert float(((step_scores[step_mask] > 0.5) == (labels > 0.5)).float().mean()) >= 0.9


def test_sampled_steps_carry_the_step_scorers_labels(tmp_path, tiny_model_dir, arithmetic_files):
    out = tmp_path / "steps.jsonl"
    assert main(["sample", "--prompts", arithmetic_files[1], "--out", str(out), "--model", tiny_model_dir, "--n", "2",
                 "--max-response-length", "12", "--temperature", "2.0",
                 "--step-scorer", "recipes/deepseekmath_grpo/step_reward.py"]) == 0
    rows, kind = read_examples(str(out))
    assert kind == "steps" and rows
    for row in rows:
        assert len(row["labels"]) == len(row["steps"]) and all(0.0 <= label <= 1.0 for label in row["labels"])
        assert all(step.strip() and "\n" not in step for step in row["steps"])


def test_bad_step_data_is_refused(tmp_path, tiny_model_dir, reward_model_dir):
    prompt = [{"role": "user", "content": "q"}]
    few = write_jsonl(tmp_path / "few.jsonl", [{"prompt": prompt, "steps": ["a", "b"], "labels": [1.0]}])
    with pytest.raises(RewardDataError, match="one number in \\[0, 1\\] per step"):
        read_examples(few)
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"prompt": prompt, "steps": ["a", " "], "labels": [1.0, 0.0]}])
    with pytest.raises(RewardDataError, match="non-blank texts"):
        read_examples(blank)
    joined = write_jsonl(tmp_path / "joined.jsonl", [{"prompt": prompt, "steps": ["a\nb", "c"], "labels": [1.0, 0.0]}]
                         * 4)
    with pytest.raises(RewardDataError, match="split into 3 steps, not 2"):
        train_reward_model(joined, str(tmp_path / "prm"), tiny_model_dir, val_fraction=0.0, dtype="fp32")
    with pytest.raises(RewardDataError, match="train a process reward model with --loss pointwise"):
        train_reward_model(joined, str(tmp_path / "prm"), tiny_model_dir, loss="pairwise")
    with pytest.raises(RewardDataError, match="--step-tag trains a step-tag scorer, a causal LM"):
        train_reward_model(joined, str(tmp_path / "prm"), reward_model_dir, step_tag=" ки")
    assert not (tmp_path / "prm").exists()


def test_completion_labels_mark_a_step_good_when_a_continuation_from_it_is_right(tiny_tokenizer):
    """Math-Shepherd's hard estimation, with the continuations scripted (the model's text is what
    the test must choose): each step's prefix ends at its step-end token."""
    from hybrid_rl.rewards.training import completion_labels

    text = "12 + 34\n= 47\nso 47"
    response_ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    seen = []

    def complete(prefixes):
        seen.extend(tiny_tokenizer.decode(p, skip_special_tokens=True) for p in prefixes)
        scripted = [["= 46", "= 45"], ["so 48", "so 49"]]  # two continuations of each of the two prefixes
        return [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for pair in scripted for t in pair]

    steps, labels = completion_labels(tiny_tokenizer, response_ids, text, "\n", 2, complete,
                                      lambda answer: answer.endswith("46"))
    assert seen == ["12 + 34\n", "12 + 34\n= 47\n"]
    assert steps == ["12 + 34", "= 47", "so 47"] and labels == [1.0, 0.0, 0.0]
    assert completion_labels(tiny_tokenizer, [], "", "\n", 2, complete, bool) is None


def test_sampled_steps_labelled_by_completions(tmp_path, tiny_model_dir, arithmetic_files):
    out = tmp_path / "steps.jsonl"
    assert main(["sample", "--prompts", arithmetic_files[1], "--out", str(out), "--model", tiny_model_dir, "--n", "2",
                 "--max-response-length", "10", "--temperature", "2.0", "--completions", "2",
                 "--step-separator", " "]) == 0
    rows, kind = read_examples(str(out))
    assert kind == "steps" and rows and any(len(row["steps"]) > 1 for row in rows)
    assert all(set(row["labels"]) <= {0.0, 1.0} and len(row["labels"]) == len(row["steps"]) for row in rows)
    assert main(["sample", "--prompts", arithmetic_files[1], "--out", str(out), "--model", tiny_model_dir,
                 "--completions", "2", "--step-scorer", "recipes/deepseekmath_grpo/step_reward.py"]) == 2
