import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from hybrid_rl.algorithms import compute_grpo_outcome_advantage, get_advantage_estimator


def _batch(seed, batch=12, length=6, num_groups=4):
    rng = np.random.default_rng(seed)
    rewards = torch.from_numpy(rng.normal(size=(batch, length)))
    mask = torch.from_numpy((rng.random((batch, length)) < 0.7).astype(np.float64))
    # uid strings, some groups of size 1, order shuffled
    index = np.array([f"uid-{g}" for g in rng.integers(0, num_groups + 2, size=batch)], dtype=object)
    return rewards, mask, index


def _grpo_reference(rewards, mask, index, norm, eps=1e-6):
    scores = [sum(row) for row in rewards.tolist()]
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(scores[i])
    adv = []
    for i, g in enumerate(index):
        members = groups[g]
        mu, sd = (statistics.fmean(members), statistics.stdev(members)) if len(members) > 1 else (0.0, 1.0)
        adv.append((scores[i] - mu) / (sd + eps) if norm else scores[i] - mu)
    return torch.tensor(adv, dtype=torch.float64)[:, None] * mask


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_grpo_matches_reference(seed, norm):
    rewards, mask, index = _batch(seed)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, _grpo_reference(rewards, mask, index, norm))
    assert ret is adv or torch.equal(ret, adv)


def test_grpo_registry_entry_reads_config_and_accepts_extras():
    rewards, mask, index = _batch(7)
    fn = get_advantage_estimator("grpo")
    for config, norm in [(None, True), ({"norm_adv_by_std_in_grpo": False}, False), (OmegaConf.create({"gamma": 1.0, "norm_adv_by_std_in_grpo": True}), True)]:
        adv, _ = fn(rewards, mask, index=index, config=config, values=torch.zeros_like(rewards))
        torch.testing.assert_close(adv, _grpo_reference(rewards, mask, index, norm))
    with pytest.raises(ValueError, match="needs index"):
        fn(rewards, mask)


def test_grpo_index_types_and_no_grad():
    rewards, mask, index = _batch(8)
    rewards = rewards.float().requires_grad_()
    ints = torch.tensor([sorted(set(index)).index(g) * 7 + 3 for g in index])  # distinct ids (hash() % N may collide)
    adv_str, _ = compute_grpo_outcome_advantage(rewards, mask.float(), index)
    adv_int, _ = compute_grpo_outcome_advantage(rewards, mask.float(), ints)
    adv_list, _ = compute_grpo_outcome_advantage(rewards, mask.float(), list(index))
    assert not adv_str.requires_grad and adv_str.dtype == torch.float32
    torch.testing.assert_close(adv_str, adv_int)
    torch.testing.assert_close(adv_str, adv_list)
    with pytest.raises(ValueError, match="index has"):
        compute_grpo_outcome_advantage(rewards, mask, index[:-1])


def test_grpo_constant_group_gives_zero():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    adv, _ = compute_grpo_outcome_advantage(rewards, torch.ones(3, 2), np.array(["a", "a", "b"], dtype=object))
    assert torch.equal(adv[:2], torch.zeros(2, 2))
    assert torch.equal(adv[2], torch.zeros(2))  # singleton: (0 - 0) / (1 + eps)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 5), min_size=1, max_size=4),
    norm=st.booleans(),
    data=st.data(),
)
def test_grpo_group_mean_is_zero(sizes, norm, data):
    index = np.array([f"g{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    scores = data.draw(st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=len(index), max_size=len(index)))
    perm = np.random.default_rng(len(index)).permutation(len(index))
    index = index[perm]
    rewards = torch.tensor(scores, dtype=torch.float64)[:, None]
    adv, _ = compute_grpo_outcome_advantage(rewards, torch.ones_like(rewards), index, norm_adv_by_std_in_grpo=norm)
    for g in set(index):
        members = adv[torch.from_numpy(index == g), 0]
        assert abs(members.mean().item()) < 1e-6 * max(1.0, members.abs().max().item())


def test_rloo_matches_reference():
    rewards, mask, index = _batch(4)
    scores = rewards.sum(-1).tolist()
    expected = []
    for i, g in enumerate(index):
        others = [scores[j] for j, h in enumerate(index) if h == g and j != i]
        expected.append(scores[i] - statistics.fmean(others) if others else scores[i])
    adv, ret = get_advantage_estimator("rloo")(rewards, mask, index=index)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64)[:, None] * mask)
    torch.testing.assert_close(ret, adv)
