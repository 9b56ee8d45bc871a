import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybrid_rl.data import RLDataset, collate_prompts, make_arithmetic_rows
from hybrid_rl.data.arithmetic import PROMPT_TEMPLATE, problem_key


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_arithmetic_generator():
    rows = make_arithmetic_rows(50, seed=3, lo=10, hi=20, ops="+-")
    assert rows == make_arithmetic_rows(50, seed=3, lo=10, hi=20, ops="+-")
    keys = [problem_key(r) for r in rows]
    assert len(set(keys)) == 50
    for r in rows:
        a, op, b = problem_key(r)
        assert 10 <= a <= 20 and 10 <= b <= 20 and op in "+-"
        assert r["data_source"] == "arithmetic" and r["ability"] == "math"
        assert r["prompt"] == [{"role": "user", "content": PROMPT_TEMPLATE.format(a=a, op=op, b=b)}]
        assert r["reward_model"] == {"style": "rule", "ground_truth": str(a + b if op == "+" else a - b)}
    test = make_arithmetic_rows(30, seed=4, lo=10, hi=20, exclude=set(keys), split="test")
    assert not set(map(problem_key, test)) & set(keys)
    assert all(r["extra_info"]["split"] == "test" for r in test)
    with pytest.raises(ValueError, match="distinct"):
        make_arithmetic_rows(10, lo=1, hi=2, ops="+")
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_rows(1, ops="/")


def test_other_phrasings_ask_the_same_problems_in_other_words():
    plain = make_arithmetic_rows(40, seed=5, lo=1, hi=99, ops="+-*")
    for phrasing in ("question", "words"):
        rows = make_arithmetic_rows(40, seed=5, lo=1, hi=99, ops="+-*", phrasing=phrasing, data_source="arithmetic/x")
        assert rows == make_arithmetic_rows(40, seed=5, lo=1, hi=99, ops="+-*", phrasing=phrasing,
                                            data_source="arithmetic/x")
        assert [problem_key(r) for r in rows] == [problem_key(r) for r in plain]
        assert [r["reward_model"] for r in rows] == [r["reward_model"] for r in plain]
        for row in rows:
            a, _, b = problem_key(row)
            text = row["prompt"][0]["content"]
            assert row["data_source"] == "arithmetic/x" and row["extra_info"]["phrasing"] == phrasing
            assert str(a) in text and str(b) in text and "Calculate" not in text and "{" not in text
    with pytest.raises(ValueError, match="phrasing must be one of plain, question, words"):
        make_arithmetic_rows(1, phrasing="poem")


def test_shifted_sets_differ_from_training_and_are_scored_as_arithmetic():
    from hybrid_rl.data.arithmetic import SHIFTED_SETS, shifted_rows
    from hybrid_rl.rewards import UnknownDataSourceError, default_compute_score

    train = {problem_key(r) for r in make_arithmetic_rows(600, seed=0, lo=1, hi=20)}
    rows = shifted_rows(64, seed=0, exclude=train)
    assert len(rows) == 64 * len(SHIFTED_SETS)
    assert not {problem_key(r) for r in rows} & train
    assert {r["data_source"] for r in rows} == {f"arithmetic/{name}" for name in SHIFTED_SETS}
    row = rows[-1]
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], f"It is {truth}.", truth) == 1.0
    with pytest.raises(UnknownDataSourceError):
        default_compute_score("geometry/words", "1", "1")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_round_trip(tmp_path, tiny_tokenizer, fmt):
    rows = make_arithmetic_rows(20, seed=0)
    path = (write_parquet if fmt == "parquet" else write_jsonl)(tmp_path / f"d.{fmt}", rows)
    ds = RLDataset(path, tiny_tokenizer, max_prompt_length=256)
    assert len(ds) == 20
    for i, r in enumerate(rows):
        item = ds[i]
        assert item["raw_prompt"] == r["prompt"]
        assert item["data_source"] == "arithmetic"
        assert item["reward_model"] == r["reward_model"]
        assert item["extra_info"] == r["extra_info"]
        assert item["index"] == r["extra_info"]["index"]
        text = "<|user|>" + r["prompt"][0]["content"] + "<eos><|assistant|>"  # chat template applied
        assert item["prompt_ids"] == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tiny_tokenizer.decode(item["prompt_ids"]) == text


def test_multiple_files_string_prompt_and_row_index(tmp_path, tiny_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hello", "data_source": "x", "reward_model": {"ground_truth": "1"}}])
    b = write_jsonl(tmp_path / "b.json", [{"q": 1, "prompt": "bye", "data_source": "y", "reward_model": {"ground_truth": "2"}}])
    ds = RLDataset([a, b], tiny_tokenizer)
    assert len(ds) == 2
    assert ds[0]["raw_prompt"] == [{"role": "user", "content": "hello"}]
    assert ds[1]["index"] == 1 and ds[1]["extra_info"] == {} and ds[1]["data_source"] == "y"


def _long_rows():
    return [
        {"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "data_source": "d", "reward_model": {"ground_truth": "3"}},
        {"prompt": [{"role": "user", "content": "What is 12 + 34? " * 10}], "data_source": "d", "reward_model": {"ground_truth": "0"}},
    ]


def _full_ids(tok, content):
    return tok("<|user|>" + content + "<eos><|assistant|>", add_special_tokens=False)["input_ids"]


def test_truncation_error(tmp_path, tiny_tokenizer):
    rows = _long_rows()
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    n_long = len(_full_ids(tiny_tokenizer, rows[1]["prompt"][0]["content"]))
    with pytest.raises(ValueError) as err:
        RLDataset(path, tiny_tokenizer, max_prompt_length=20)
    msg = str(err.value)
    assert "row 1" in msg and f"{n_long} tokens" in msg
    for fix in ("data.max_prompt_length", "data.truncation=left|right|middle", "data.filter_overlong_prompts=True"):
        assert fix in msg


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tmp_path, tiny_tokenizer, mode):
    rows = _long_rows()
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    full = _full_ids(tiny_tokenizer, rows[1]["prompt"][0]["content"])
    ds = RLDataset(path, tiny_tokenizer, max_prompt_length=11, truncation=mode)
    ids = ds[1]["prompt_ids"]
    assert len(ids) == 11
    expected = {"left": full[-11:], "right": full[:11], "middle": full[:5] + full[-6:]}[mode]
    assert ids == expected
    assert all(len(ds[i]["prompt_ids"]) <= 11 for i in range(len(ds)))


def test_filter_overlong(tmp_path, tiny_tokenizer, caplog):
    rows = _long_rows()
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    short_len = len(_full_ids(tiny_tokenizer, rows[0]["prompt"][0]["content"]))
    with caplog.at_level(logging.WARNING):
        ds = RLDataset(path, tiny_tokenizer, max_prompt_length=short_len, filter_overlong_prompts=True)
    assert len(ds) == 1 and ds.num_filtered == 1 and ds[0]["index"] == 0
    assert "filtered 1 of 2" in caplog.text
    with pytest.raises(ValueError, match="empty after filtering"):
        RLDataset(path, tiny_tokenizer, max_prompt_length=3, filter_overlong_prompts=True)


def test_max_samples(tmp_path, tiny_tokenizer):
    path = write_parquet(tmp_path / "d.parquet", make_arithmetic_rows(30, seed=0))
    ds = RLDataset(path, tiny_tokenizer, max_samples=5)
    assert [ds[i]["index"] for i in range(5)] == [0, 1, 2, 3, 4]
    a = RLDataset(path, tiny_tokenizer, max_samples=5, seed=7)
    b = RLDataset(path, tiny_tokenizer, max_samples=5, seed=7)
    idx = [a[i]["index"] for i in range(5)]
    assert idx == [b[i]["index"] for i in range(5)] and idx != [0, 1, 2, 3, 4] and len(set(idx)) == 5
    assert len(RLDataset(path, tiny_tokenizer, max_samples=100)) == 30


def test_apply_chat_template_kwargs(tmp_path, make_tokenizer):
    tok = make_tokenizer(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    )
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "data_source": "x", "reward_model": {"ground_truth": "1"}}])
    plain = RLDataset(path, tok)[0]["prompt_ids"]
    loud = RLDataset(path, tok, apply_chat_template_kwargs={"shout": True})[0]["prompt_ids"]
    assert tok.decode(plain) == "hi" and tok.decode(loud) == "hi!!"


# ----------------------------------------------------------------------------- errors
def test_error_missing_file(tmp_path, tiny_tokenizer):
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLDataset(str(tmp_path / "missing.parquet"), tiny_tokenizer)


def test_error_corrupt_files(tmp_path, tiny_tokenizer):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match="bad.parquet"):
        RLDataset(str(bad), tiny_tokenizer)
    badj = tmp_path / "bad.jsonl"
    badj.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2"):
        RLDataset(str(badj), tiny_tokenizer)


def test_error_unsupported_extension(tmp_path, tiny_tokenizer):
    p = tmp_path / "data.csv"
    p.write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"unsupported.*data\.csv.*\.parquet"):
        RLDataset(str(p), tiny_tokenizer)


def test_error_missing_prompt_key(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "hi", "data_source": "x"}])
    with pytest.raises(ValueError) as err:
        RLDataset(path, tiny_tokenizer)
    msg = str(err.value)
    assert "'prompt'" in msg and "question" in msg and "data_source" in msg and "data.prompt_key" in msg
    assert len(RLDataset(path, tiny_tokenizer, prompt_key="question")) == 1


def test_error_empty_dataset(tmp_path, tiny_tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        RLDataset(str(path), tiny_tokenizer)


def test_error_no_chat_template(tmp_path, make_tokenizer):
    tok = make_tokenizer(chat_template=None)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ValueError, match="actor_rollout_ref.model.custom_chat_template"):
        RLDataset(path, tok)


def test_error_bad_prompt_and_truncation(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": 5}])
    with pytest.raises(ValueError, match="row 0"):
        RLDataset(path, tiny_tokenizer)
    with pytest.raises(ValueError, match="data.truncation"):
        RLDataset(path, tiny_tokenizer, truncation="both")


# ---------------------------------------------------------------------------- collate
def test_collate_left_padding_and_positions():
    rows = [
        {"prompt_ids": [5, 6, 7], "raw_prompt": [{"role": "user", "content": "a"}], "data_source": "d",
         "reward_model": {"ground_truth": "1"}, "extra_info": {"index": 0}, "index": 0},
        {"prompt_ids": [8], "raw_prompt": [{"role": "user", "content": "b"}], "data_source": "d",
         "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 1}, "index": 1},
    ]
    batch = collate_prompts(rows, pad_token_id=0, max_prompt_length=5)
    assert len(batch) == 2
    assert batch["input_ids"].tolist() == [[0, 0, 5, 6, 7], [0, 0, 0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 0, 0, 0, 0]]
    assert batch["input_ids"].dtype == torch.long
    assert list(batch["prompt_ids"]) == [[5, 6, 7], [8]]
    assert list(batch["index"]) == [0, 1]
    assert batch["reward_model"][1] == {"ground_truth": "2"}
    for key in ("raw_prompt", "data_source", "extra_info"):
        assert key in batch
    with pytest.raises(ValueError, match="max_prompt_length"):
        collate_prompts(rows, pad_token_id=0, max_prompt_length=2)


def test_dataset_to_collate(tmp_path, tiny_tokenizer):
    path = write_parquet(tmp_path / "d.parquet", make_arithmetic_rows(4, seed=1))
    ds = RLDataset(path, tiny_tokenizer, max_prompt_length=64)
    batch = collate_prompts([ds[i] for i in range(4)], tiny_tokenizer.pad_token_id, 64)
    for i in range(4):
        n = len(ds[i]["prompt_ids"])
        assert batch["input_ids"][i, -n:].tolist() == ds[i]["prompt_ids"]
        assert batch["attention_mask"][i].sum().item() == n
        assert batch["position_ids"][i, -1].item() == n - 1
