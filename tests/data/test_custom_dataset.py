"""verl's `data.custom_cls`: a user's dataset class (from a .py file or a `pkg://` module) gives the
rows, built with verl's keyword arguments; its items go through the same chat template,
truncation and reward lookup as a data file's rows; bad classes stop the run at start."""

from __future__ import annotations

import sys
import textwrap

import pytest

from hybrid_rl.main import compose_config, prepare
from tests.conftest import run_overrides

# A dataset in its own format (question,answer lines), as a user would write one for verl: built
# from data_files, tokenizer, processor, config and max_samples; items carry verl's raw_prompt.
CSV_DATASET = textwrap.dedent('''
    from torch.utils.data import Dataset


    class QuestionAnswerDataset(Dataset):
        built_with = []

        def __init__(self, data_files, tokenizer, processor, config, max_samples=-1):
            type(self).built_with.append({"files": list(data_files), "processor": processor,
                                          "max_samples": max_samples, "prompt_key": config.prompt_key,
                                          "tokenizer": type(tokenizer).__name__})
            self.rows = []
            for path in data_files:
                for line in open(path):
                    question, answer = line.strip().split(",")
                    self.rows.append((question, answer))
            if max_samples > 0:
                self.rows = self.rows[:max_samples]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, index):
            question, answer = self.rows[index]
            return {"raw_prompt": [{"role": "user", "content": f"What is {question}? Reply with the number."}],
                    "data_source": "arithmetic", "reward_model": {"style": "rule", "ground_truth": answer},
                    "extra_info": {"index": 100 + index}}


    def not_a_class():
        return None


    class Rows(list):
        pass


    class PositionalOnly(Dataset):
        def __init__(self, files):
            pass


    class TupleItems(QuestionAnswerDataset):
        def __getitem__(self, index):
            return self.rows[index]
''')


@pytest.fixture
def question_files(tmp_path):
    lines = [f"{a} + {b},{a + b}" for a in range(3, 9) for b in (2, 5)]
    train, val = tmp_path / "train.csv", tmp_path / "val.csv"
    train.write_text("\n".join(lines[:10]) + "\n")
    val.write_text("\n".join(lines[10:]) + "\n")
    (tmp_path / "qa_dataset.py").write_text(CSV_DATASET)
    return str(train), str(val), str(tmp_path / "qa_dataset.py")


def config(tiny_model_dir, tmp_path, train, val, path, name="QuestionAnswerDataset", *extra):
    return compose_config(run_overrides(tiny_model_dir, (train, val), str(tmp_path / "run")) + [
        f"data.custom_cls.path={path}", f"data.custom_cls.name={name}", *extra])


def test_a_custom_dataset_class_gives_the_rows(tiny_model_dir, question_files, tmp_path):
    train, val, path = question_files
    cfg = config(tiny_model_dir, tmp_path, train, val, path, "QuestionAnswerDataset", "data.train_max_samples=8")
    _, tokenizer, train_dataset, val_dataset, _, _ = prepare(cfg)
    assert (len(train_dataset), len(val_dataset)) == (8, 2)
    row = train_dataset[1]
    messages = [{"role": "user", "content": "What is 3 + 5? Reply with the number."}]
    assert row["raw_prompt"] == messages
    assert row["prompt_ids"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)
    assert row["reward_model"]["ground_truth"] == "8" and row["data_source"] == "arithmetic"
    assert row["index"] == 101
    module = next(m for name, m in sys.modules.items() if name.startswith("hybrid_rl_user_qa_dataset"))
    built = module.QuestionAnswerDataset.built_with[-2:]
    assert [b["files"] for b in built] == [[train], [val]]
    assert [b["max_samples"] for b in built] == [8, cfg.data.val_max_samples]
    assert all(b["processor"] is None and b["prompt_key"] == "prompt" and b["tokenizer"] == type(tokenizer).__name__
               for b in built)


def test_a_custom_dataset_class_from_an_importable_module(tiny_model_dir, question_files, tmp_path, monkeypatch):
    train, val, _ = question_files
    monkeypatch.syspath_prepend(str(tmp_path))
    _, _, train_dataset, _, _, _ = prepare(config(tiny_model_dir, tmp_path, train, val, "pkg://qa_dataset"))
    assert len(train_dataset) == 10


@pytest.mark.parametrize("name, expected", [
    ("Missing", "has no attribute 'Missing' (data.custom_cls.name)"),
    ("not_a_class", "not a torch.utils.data.Dataset subclass"),
    ("Rows", "not a torch.utils.data.Dataset subclass"),
    ("PositionalOnly", "PositionalOnly(data_files="),
    ("TupleItems", "item 0 of TupleItems is a tuple"),
])
def test_bad_dataset_classes_stop_the_run_at_start_naming_the_fix(tiny_model_dir, question_files, tmp_path, name,
                                                                   expected):
    train, val, path = question_files
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        prepare(config(tiny_model_dir, tmp_path, train, val, path, name))


def test_a_missing_dataset_file_or_class_name_is_named(tiny_model_dir, question_files, tmp_path):
    train, val, path = question_files
    with pytest.raises(FileNotFoundError, match="data.custom_cls.path: file not found"):
        prepare(config(tiny_model_dir, tmp_path, train, val, str(tmp_path / "nope.py")))
    with pytest.raises(ValueError, match="needs data.custom_cls.name"):
        prepare(config(tiny_model_dir, tmp_path, train, val, path, "null"))
