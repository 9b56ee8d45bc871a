import itertools

import pytest
import torch

from hybrid_rl.data import EpochSampler


def test_sequential_and_drop_last():
    s = EpochSampler(10, 3, shuffle=False, total_epochs=2)
    assert len(s) == s.steps_per_epoch == 3 and s.total_steps == 6
    assert list(s) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] * 2
    s = EpochSampler(10, 3, shuffle=False, drop_last=False)
    assert len(s) == 4 and list(s)[-1] == [9]


def test_shuffle_matches_seeded_generator_and_reshuffles():
    s = EpochSampler(12, 4, seed=5, total_epochs=3)
    batches = list(s)
    assert len(batches) == 9
    for epoch in range(3):
        perm = torch.randperm(12, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        assert list(itertools.chain(*batches[3 * epoch : 3 * epoch + 3])) == perm
    assert batches[0:3] != batches[3:6]  # fresh permutation per epoch
    assert batches == list(EpochSampler(12, 4, seed=5, total_epochs=3))  # deterministic
    assert batches != list(EpochSampler(12, 4, seed=6, total_epochs=3))


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 4, 7, 8])
def test_resume_gives_identical_remaining_sequence(stop_after):
    full = list(EpochSampler(11, 4, seed=1, total_epochs=3))  # 2 batches/epoch, 6 total
    s = EpochSampler(11, 4, seed=1, total_epochs=3)
    it = iter(s)
    seen = [next(it) for _ in range(min(stop_after, len(full)))]
    state = s.state_dict()
    assert set(state) == {"epoch", "batch_in_epoch"}
    resumed = EpochSampler(11, 4, seed=1, total_epochs=3)
    resumed.load_state_dict(state)
    assert seen + list(resumed) == full


def test_state_points_at_next_batch():
    s = EpochSampler(8, 4, total_epochs=2)
    it = iter(s)
    assert s.state_dict() == {"epoch": 0, "batch_in_epoch": 0}
    next(it)
    assert s.state_dict() == {"epoch": 0, "batch_in_epoch": 1}
    next(it)
    assert s.state_dict() == {"epoch": 1, "batch_in_epoch": 0}


def test_errors():
    with pytest.raises(ValueError) as err:
        EpochSampler(5, 8)
    msg = str(err.value)
    assert "5" in msg and "8" in msg and "data.train_batch_size" in msg
    assert len(EpochSampler(5, 8, drop_last=False)) == 1
    s = EpochSampler(8, 4)
    with pytest.raises(ValueError, match="batches per epoch"):
        s.load_state_dict({"epoch": 0, "batch_in_epoch": 2})


# ---------------------------------------------------------------- verl's data.sampler

# A curriculum sampler written for verl, unchanged: easiest rows first, then those it saw fail.
VERL_CURRICULUM = '''
import torch
from omegaconf import DictConfig

from verl import DataProto
from verl.experimental.dataset.sampler import AbstractCurriculumSampler


class HardestFirst(AbstractCurriculumSampler):
    def __init__(self, data_source, data_config: DictConfig):
        self.size = len(data_source)
        self.failed = []
        self.updates = 0
        self.difficulty = [row["extra_info"]["difficulty"] for row in (data_source[i] for i in range(self.size))]

    def __iter__(self):
        seen = set(self.failed)
        order = self.failed + sorted((i for i in range(self.size) if i not in seen), key=self.difficulty.__getitem__)
        self.failed = []
        for index in order:
            yield index

    def __len__(self):
        return self.size

    def update(self, batch: DataProto) -> None:
        self.updates += 1
        scores = batch.batch["token_level_scores"].sum(-1)
        self.failed += [int(i) for i, s in zip(batch.non_tensor_batch["index"], scores) if s <= 0]
'''


STATEFUL = VERL_CURRICULUM + '''

class Stateful(HardestFirst):
    """Remembers how far into its epoch it is (torch's stateful-sampler protocol)."""
    drawn = 0

    def __iter__(self):
        order = list(super().__iter__())
        while self.drawn < len(order):
            self.drawn += 1
            yield order[self.drawn - 1]
        self.drawn = 0

    def state_dict(self):
        return {"drawn": self.drawn}

    def load_state_dict(self, state):
        self.drawn = state["drawn"]
'''


class Rows:
    """A dataset stand-in: rows with a difficulty in extra_info."""

    def __init__(self, difficulties):
        self.rows = [{"extra_info": {"difficulty": d}} for d in difficulties]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _load(tmp_path, body=VERL_CURRICULUM, name="HardestFirst", batch_size=2, epochs=2):
    from omegaconf import OmegaConf

    from hybrid_rl.data import load_custom_sampler

    (tmp_path / "curriculum.py").write_text(body)
    data_cfg = OmegaConf.create({"sampler": {"class_path": str(tmp_path / "curriculum.py"), "class_name": name}})
    return load_custom_sampler(data_cfg, Rows([3, 1, 2, 0, 5]), batch_size, epochs)


def test_verl_curriculum_sampler_loads_unchanged_and_learns(tmp_path):
    import sys

    from hybrid_rl.protocol import Batch

    sampler = _load(tmp_path)
    assert "verl" not in sys.modules  # the stand-in is gone once the file has loaded
    assert len(sampler) == 2 and sampler.total_steps == 4  # 5 rows: the tail of each epoch is dropped
    batches = iter(sampler)
    assert next(batches) == [3, 1] and next(batches) == [2, 0]  # easiest first
    trained = Batch({"token_level_scores": torch.tensor([[0.0, 1.0], [0.0, 0.0]])},
                    {"index": [3, 1], "uid": ["a", "b"]})
    sampler.update(trained)
    assert sampler.sampler.updates == 1
    assert next(batches) == [1, 3]  # the next epoch starts with the row that scored 0
    assert sampler.state_dict() == {"epoch": 1, "batch_in_epoch": 1}


def test_custom_sampler_resumes_its_position(tmp_path, caplog):
    """Without state_dict the epoch restarts and the served indices are skipped (said once); with
    it, the sampler's own state comes back instead."""
    first = _load(tmp_path)
    served = iter(first)
    next(served)
    resumed = _load(tmp_path)
    resumed.load_state_dict(first.state_dict())
    assert "has no state_dict" in caplog.text
    assert list(resumed) == [[2, 0], [3, 1], [2, 0]]

    stateful = STATEFUL
    first = _load(tmp_path, stateful, "Stateful")
    served = iter(first)
    next(served)
    state = first.state_dict()
    assert state == {"epoch": 0, "batch_in_epoch": 1, "sampler": {"drawn": 2}}
    resumed = _load(tmp_path, stateful, "Stateful")
    resumed.load_state_dict(state)
    assert list(resumed) == [[2, 0], [3, 1], [2, 0]]


@pytest.mark.parametrize("body, name, match", [
    ("class NotASampler:\n    def __init__(self, data_source, data_config):\n        pass\n", "NotASampler",
     "must be a class derived from AbstractSampler"),
    (VERL_CURRICULUM, "Missing", "has no attribute 'Missing'"),
    (VERL_CURRICULUM.replace("return self.size", "return 1"), "HardestFirst", "yields 1 indices per epoch, fewer "
                                                                              "than the batch size 2"),
    (VERL_CURRICULUM.replace("return self.size", "return 9"), "HardestFirst", "stopped before the 8 indices"),
    (STATEFUL.replace('return {"drawn": self.drawn}', 'return {"drawn": torch.tensor(self.drawn)}'), "Stateful",
     "state_dict\\(\\) must return JSON values"),
])
def test_bad_custom_samplers(tmp_path, body, name, match):
    with pytest.raises(ValueError, match=match):
        list(_load(tmp_path, body, name))
