import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from hybrid_rl.algorithms import (
    RunningMoments,
    clip_advantages,
    clip_rewards,
    normalize_rewards,
    shape_advantages,
    shape_scores,
    whiten_advantages,
)

SCORES = [3.0, -1.0, 0.5, 2.0, -4.0, 1.0, 0.0]
INDEX = ["a", "a", "b", "b", "b", "c", "a"]  # "c" is a singleton


def _scores():
    return torch.tensor(SCORES, dtype=torch.float64)


def _hand(mean_over, std_over, eps=1e-6, prior=()):
    """Hand computation of one normalize_rewards call over SCORES (``prior`` = earlier running data)."""
    groups = {}
    for s, g in zip(SCORES, INDEX):
        groups.setdefault(g, []).append(s)
    seen = list(prior) + SCORES
    out = []
    for s, g in zip(SCORES, INDEX):
        single = len(groups[g]) == 1
        mu = {"batch": statistics.fmean(SCORES), "group": 0.0 if single else statistics.fmean(groups[g]),
              "running": statistics.fmean(seen), None: 0.0}[mean_over]
        sd = {"batch": statistics.stdev(SCORES), "group": 1.0 if single else statistics.stdev(groups[g]),
              "running": statistics.stdev(seen)}.get(std_over)
        out.append((s - mu) / (sd + eps) if sd is not None else s - mu)
    return torch.tensor(out, dtype=torch.float64)


MODES = ["batch", "group", "running", None]


@pytest.mark.parametrize("mean_over", MODES)
@pytest.mark.parametrize("std_over", MODES)
def test_normalize_rewards_each_mode(mean_over, std_over):
    running = RunningMoments()
    prior = [10.0, -2.0, 4.0]
    running.update(torch.tensor(prior))
    out = normalize_rewards(_scores(), INDEX, mean_over, std_over, running=running)
    torch.testing.assert_close(out, _hand(mean_over, std_over, prior=prior))
    # the running statistics absorb the batch exactly once, and only when a running mode is used
    assert running.count == len(prior) + (len(SCORES) if "running" in (mean_over, std_over) else 0)


def test_normalize_rewards_spellings_and_errors():
    torch.testing.assert_close(normalize_rewards(_scores(), INDEX, "none", "None"), _scores())
    torch.testing.assert_close(normalize_rewards(_scores(), INDEX, "Batch", None), _hand("batch", None))
    with pytest.raises(ValueError, match="Unknown reward_norm.std mode 'global'. Valid: batch, group, running, none"):
        normalize_rewards(_scores(), INDEX, "batch", "global")
    with pytest.raises(ValueError, match="RunningMoments"):
        normalize_rewards(_scores(), INDEX, "running", None)
    with pytest.raises(ValueError, match="'group' needs index"):
        normalize_rewards(_scores(), None, "group", None)
    # a single score: batch std falls back to 1 instead of NaN
    torch.testing.assert_close(normalize_rewards(torch.tensor([2.0]), None, "batch", "batch"), torch.tensor([0.0]))


def test_first_running_batch_uses_its_own_statistics():
    running = RunningMoments()
    out = normalize_rewards(_scores(), None, "running", "running", running=running)
    torch.testing.assert_close(out, _hand("batch", "batch"))


@settings(max_examples=25, deadline=None)
@given(batches=st.lists(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=0, max_size=20), min_size=1, max_size=6))
def test_running_moments_equals_numpy_over_all_data(batches):
    running = RunningMoments()
    for b in batches:
        running.update(torch.tensor(b, dtype=torch.float32) if len(b) % 2 else np.array(b))
    seen = np.array([x for b in batches for x in (np.float32(b) if len(b) % 2 else b)], dtype=np.float64)
    assert running.count == len(seen)
    if len(seen):
        assert running.mean == pytest.approx(seen.mean(), rel=1e-9, abs=1e-9)
    if len(seen) > 1:
        assert running.std == pytest.approx(seen.std(ddof=1), rel=1e-7, abs=1e-9)
    else:
        assert running.std == 1.0
    restored = RunningMoments()
    restored.load_state_dict(running.state_dict())
    assert restored.state_dict() == running.state_dict()
    restored.update([1.0, 2.0])
    running.update([1.0, 2.0])
    assert restored.state_dict() == running.state_dict()


def test_running_moments_state_dict_is_plain_numbers():
    running = RunningMoments()
    running.update(torch.arange(5.0))
    state = running.state_dict()
    assert state == {"count": 5, "mean": 2.0, "m2": 10.0}
    assert running.std == pytest.approx(math.sqrt(2.5))


def test_clipping():
    x = torch.tensor([-5.0, -0.5, 0.0, 2.0, 7.0])
    assert clip_rewards(x, None) is x and clip_rewards(x, 0) is x and clip_advantages(x, 0.0) is x
    assert torch.equal(clip_rewards(x, 1.5), torch.tensor([-1.5, -0.5, 0.0, 1.5, 1.5]))
    assert torch.equal(clip_advantages(x, 2), torch.tensor([-2.0, -0.5, 0.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match="reward_clip must be positive"):
        clip_rewards(x, -1.0)


def test_whiten_advantages_by_hand():
    adv = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    valid = [1.0, 2.0, 3.0, 4.0]
    mu, sd = statistics.fmean(valid), math.sqrt(statistics.variance(valid) + 1e-8)
    expected = torch.tensor([[(1 - mu) / sd, (2 - mu) / sd, 0.0], [(3 - mu) / sd, (4 - mu) / sd, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(whiten_advantages(adv, mask), expected)


@pytest.mark.parametrize("config", [None, {}, OmegaConf.create({"gamma": 1.0, "reward_clip": None, "reward_norm": {"mean": None, "std": None},
                                                              "whiten_advantages": False, "advantage_clip": None})])
def test_defaults_are_exact_noops(config):
    scores = _scores()
    adv = torch.randn(7, 4)
    running = RunningMoments()
    assert shape_scores(scores, INDEX, config, running) is scores
    assert shape_advantages(adv, torch.ones(7, 4), config) is adv
    assert running.count == 0


def test_shape_scores_clips_before_normalising():
    config = OmegaConf.create({"reward_clip": 2.0, "reward_norm": {"mean": "batch", "std": "batch"}})
    clipped = [min(max(s, -2.0), 2.0) for s in SCORES]
    mu, sd = statistics.fmean(clipped), statistics.stdev(clipped)
    expected = torch.tensor([(s - mu) / (sd + 1e-6) for s in clipped], dtype=torch.float64)
    torch.testing.assert_close(shape_scores(_scores(), INDEX, config), expected)
    running = RunningMoments()
    out = shape_scores(_scores(), INDEX, {"reward_norm": {"mean": "group", "std": "running"}}, running)
    torch.testing.assert_close(out, _hand("group", "running"))
    assert running.count == len(SCORES)


def test_shape_advantages_whitens_then_clips():
    adv = torch.tensor([[1.0, 2.0, 9.0], [3.0, 40.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    out = shape_advantages(adv, mask, {"whiten_advantages": True, "advantage_clip": 1.0})
    torch.testing.assert_close(out, whiten_advantages(adv, mask).clamp(-1, 1))
    assert out[0, 2] == 0 and out.abs().max() == 1.0
    torch.testing.assert_close(shape_advantages(adv, mask, {"advantage_clip": 3.0}), adv.clamp(-3, 3))
