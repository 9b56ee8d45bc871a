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
