"""The verl advantage-estimator catalogue, each checked against a float64 reference written
differently: plain Python loops over rows, groups and time, statistics from the ``statistics`` module."""

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from hybrid_rl.algorithms import ADV_ESTIMATORS, GROUP_ESTIMATORS, get_advantage_estimator

NEW = ["gae", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_process",
       "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"]


def _batch(seed, batch=12, length=7, num_groups=4, min_group=1):
    """Random rewards, masks with holes (multi-turn observations) and some all-masked rows."""
    rng = np.random.default_rng(seed)
    rewards = torch.from_numpy(rng.normal(size=(batch, length)))
    mask = torch.from_numpy((rng.random((batch, length)) < 0.7).astype(np.float64))
    mask[0, :] = 1.0
    mask[1, -3:] = 0.0  # right padding
    groups = [g for g in range(num_groups) for _ in range(min_group)]
    groups += list(rng.integers(0, num_groups + 2 if min_group == 1 else num_groups, size=batch - len(groups)))
    index = np.array([f"uid-{g}" for g in rng.permutation(groups)], dtype=object)
    return rewards, mask, index


def _rows(x):
    return x.tolist()


def _whiten_ref(matrix, mask):
    valid = [x for row, mrow in zip(matrix, mask) for x, m in zip(row, mrow) if m]
    mu, var = statistics.fmean(valid), statistics.variance(valid)
    return [[(x - mu) / math.sqrt(var + 1e-8) * m for x, m in zip(row, mrow)] for row, mrow in zip(matrix, mask)]


def _members(index):
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    return groups


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- gae


def _gae_ref(rewards, values, mask, gamma, lam):
    """Compact each row to its valid tokens, run textbook GAE there, scatter back; a masked token
    takes the advantage of the next valid token (0 if none)."""
    adv_rows, ret_rows = [], []
    for r, v, m in zip(rewards, values, mask):
        pos = [t for t in range(len(r)) if m[t]]
        compact = [0.0] * len(pos)
        for k in range(len(pos) - 1, -1, -1):
            v_next = v[pos[k + 1]] if k + 1 < len(pos) else 0.0
            a_next = compact[k + 1] if k + 1 < len(pos) else 0.0
            compact[k] = r[pos[k]] + gamma * v_next - v[pos[k]] + gamma * lam * a_next
        row = []
        for t in range(len(r)):
            later = [k for k, p in enumerate(pos) if p >= t]
            row.append(compact[later[0]] if later else 0.0)
        adv_rows.append(row)
        ret_rows.append([a + vt for a, vt in zip(row, v)])
    return _whiten_ref(adv_rows, mask), ret_rows


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_compacted_reference(seed, gamma, lam):
    rewards, mask, _ = _batch(seed)
    values = torch.from_numpy(np.random.default_rng(seed + 100).normal(size=rewards.shape))
    config = OmegaConf.create({"gamma": gamma, "lam": lam, "adv_estimator": "gae"})
    adv, ret = get_advantage_estimator("gae")(rewards, mask, config=config, values=values)
    exp_adv, exp_ret = _gae_ref(_rows(rewards), _rows(values), _rows(mask), gamma, lam)
    _close(adv, exp_adv)
    _close(ret, exp_ret)


def test_gae_defaults_and_masked_positions_are_skipped():
    rewards, mask, _ = _batch(5)
    rng = np.random.default_rng(9)
    values = torch.from_numpy(rng.normal(size=rewards.shape))
    adv, ret = get_advantage_estimator("gae")(rewards, mask, values=values)  # γ = λ = 1
    exp_adv, exp_ret = _gae_ref(_rows(rewards), _rows(values), _rows(mask), 1.0, 1.0)
    _close(adv, exp_adv)
    _close(ret, exp_ret)
    # verl's multi-turn check: values (and rewards) that differ only on masked tokens change nothing.
    hidden = mask == 0
    values2 = torch.where(hidden, torch.from_numpy(rng.normal(size=rewards.shape)) * 100, values)
    rewards2 = torch.where(hidden, rewards + 5.0, rewards)
    adv2, ret2 = get_advantage_estimator("gae")(rewards2, mask, values=values2, config={"gamma": 0.9, "lam": 0.8})
    adv1, ret1 = get_advantage_estimator("gae")(rewards, mask, values=values, config={"gamma": 0.9, "lam": 0.8})
    torch.testing.assert_close(adv2, adv1, rtol=0, atol=0)
    torch.testing.assert_close(ret2 * mask, ret1 * mask, rtol=0, atol=0)
    # Even NaN values on skipped tokens stay out of the advantages.
    adv3, _ = get_advantage_estimator("gae")(rewards, mask, values=values.masked_fill(hidden, float("nan")),
                                            config={"gamma": 0.9, "lam": 0.8})
    torch.testing.assert_close(adv3, adv1, rtol=0, atol=0)
    assert torch.equal(adv[hidden], torch.zeros_like(adv[hidden]))  # re-masked after whitening (verl is not)


# ---------------------------------------------------------------- grpo through config (Dr. GRPO)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(2, 5), min_size=1, max_size=4), norm=st.booleans(), data=st.data())
def test_grpo_config_zero_group_mean(sizes, norm, data):
    index = np.array([f"g{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    scores = data.draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=len(index), max_size=len(index)))
    rewards = torch.tensor(scores, dtype=torch.float64)[:, None]
    adv, _ = get_advantage_estimator("grpo")(rewards, torch.ones_like(rewards), index=index,
                                             config=OmegaConf.create({"norm_adv_by_std_in_grpo": norm}))
    for g, rows in _members(index).items():
        members = [adv[i, 0].item() for i in rows]
        assert abs(statistics.fmean(members)) < 1e-9 * max(1.0, max(map(abs, members)))
        if not norm:  # Dr. GRPO: plain s − mean, no std division
            mu = statistics.fmean(scores[i] for i in rows)
            assert members == pytest.approx([scores[i] - mu for i in rows], abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(2, 5), min_size=1, max_size=4), data=st.data())
def test_rloo_zero_group_mean(sizes, data):
    index = np.array([f"g{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    scores = data.draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=len(index), max_size=len(index)))
    rewards = torch.tensor(scores, dtype=torch.float64)[:, None]
    adv, _ = get_advantage_estimator("rloo")(rewards, torch.ones_like(rewards), index=index)
    for rows in _members(index).values():
        members = [adv[i, 0].item() for i in rows]
        assert abs(statistics.fmean(members)) < 1e-9 * max(1.0, max(map(abs, members)))


# ---------------------------------------------------------------- grpo_passk


def _passk_ref(rewards, mask, index, norm, eps=1e-6):
    scores = [sum(r) for r in rewards]
    adv = [0.0] * len(scores)
    for rows in _members(index).values():
        ranked = sorted(rows, key=lambda i: (-scores[i], i))
        best, second = ranked[0], ranked[1]
        gap = scores[best] - scores[second]
        adv[best] = gap / (statistics.stdev(scores[i] for i in rows) + eps) if norm else gap
    return [[a * m for m in mrow] for a, mrow in zip(adv, mask)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config, norm", [(None, True), ({"norm_adv_by_std_in_grpo": False}, False)])
def test_grpo_passk_matches_reference(seed, config, norm):
    rewards, mask, index = _batch(seed, min_group=2)
    rewards[2] = rewards[3]  # a tie somewhere is harmless
    adv, ret = get_advantage_estimator("grpo_passk")(rewards, mask, index=index, config=config)
    _close(adv, _passk_ref(_rows(rewards), _rows(mask), index, norm))
    assert torch.equal(ret, adv)


def test_grpo_passk_tied_best_gets_zero_and_singleton_raises():
    rewards = torch.tensor([[1.0], [1.0], [0.0], [2.0], [0.0]])
    adv, _ = get_advantage_estimator("grpo_passk")(rewards, torch.ones_like(rewards), index=["a", "a", "a", "b", "b"])
    assert adv[:3].abs().sum() == 0  # r_max − r_2nd = 0
    assert adv[3, 0] > 0 and adv[4, 0] == 0
    with pytest.raises(ValueError, match="at least 2 responses per group.*size 1"):
        get_advantage_estimator("grpo_passk")(rewards, torch.ones_like(rewards), index=["a", "a", "b", "b", "c"])


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(2, 5), min_size=1, max_size=4), norm=st.booleans(), data=st.data())
def test_grpo_passk_one_nonzero_per_group_when_max_unique(sizes, norm, data):
    n = sum(sizes)
    index = np.array([f"g{k}" for k, size in enumerate(sizes) for _ in range(size)], dtype=object)
    scores = data.draw(st.lists(st.integers(-1000, 1000), min_size=n, max_size=n, unique=True))
    rewards = torch.tensor(scores, dtype=torch.float64)[:, None]
    adv, _ = get_advantage_estimator("grpo_passk")(rewards, torch.ones_like(rewards), index=index,
                                                   config={"norm_adv_by_std_in_grpo": norm})
    for rows in _members(index).values():
        nonzero = [i for i in rows if adv[i, 0] != 0]
        assert nonzero == [max(rows, key=lambda i: scores[i])]
        assert adv[nonzero[0], 0] > 0


# ---------------------------------------------------------------- GDPO


def _components(seed, rows=12):
    rng = np.random.default_rng(100 + seed)
    components = rng.normal(size=(rows, 3)) * np.array([1.0, 50.0, 1.0])
    components[:, 2] = np.round(components[:, 2])  # ties within groups
    return components


def _gdpo_ref(components, mask, index, weights, norm):
    groups = _members(index)
    combined = [0.0] * len(components)
    for k, weight in enumerate(weights):
        for i, g in enumerate(index):
            values = [components[j][k] for j in groups[g]]
            mu, sd = (statistics.fmean(values), statistics.stdev(values)) if len(values) > 1 else (0.0, 1.0)
            combined[i] += weight * ((components[i][k] - mu) / (sd + 1e-6) if norm else components[i][k] - mu)
    return _whiten_ref([[combined[i] * m for m in row] for i, row in enumerate(mask)], mask)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("weights", [None, [0.5, 2.0, -1.0]])
def test_gdpo_matches_reference(seed, norm, weights):
    rewards, mask, index = _batch(seed)
    components = _components(seed)
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": norm, "gdpo_reward_weights": weights})
    adv, ret = get_advantage_estimator("gdpo")(rewards, mask, index=index, config=config,
                                               reward_components=torch.from_numpy(components))
    _close(adv, _gdpo_ref(components.tolist(), _rows(mask), index, weights or [1.0, 1.0, 1.0], norm))
    assert torch.equal(ret, adv)
    # The components alone count: the token rewards are not read.
    again, _ = get_advantage_estimator("gdpo")(rewards * 0 + 3.0, mask, index=index, config=config,
                                               reward_components=torch.from_numpy(components))
    assert torch.equal(again, adv)


def test_gdpo_each_component_counts_whatever_its_scale():
    """What GDPO is for: with the std normalisation, scaling one component leaves the advantages
    as they were (up to ε), where GRPO on the summed score is ruled by the widest component."""
    rewards, mask, index = _batch(0, min_group=3)
    components = torch.from_numpy(_components(0))
    estimator = get_advantage_estimator("gdpo")
    adv, _ = estimator(rewards, mask, index=index, reward_components=components)
    scaled, _ = estimator(rewards, mask, index=index, reward_components=components * torch.tensor([1000.0, 1.0, 1.0]))
    torch.testing.assert_close(scaled, adv, rtol=1e-4, atol=1e-4)
    summed = components.sum(-1, keepdim=True) * torch.nn.functional.one_hot(torch.tensor([6] * 12), 7)
    grpo, _ = get_advantage_estimator("grpo")(summed, mask, index=index)
    assert not torch.allclose(grpo, adv, atol=1e-2)


def test_gdpo_bad_components():
    rewards, mask, index = _batch(0)
    with pytest.raises(ValueError, match="reward_components has shape"):
        get_advantage_estimator("gdpo")(rewards, mask, index=index, reward_components=torch.zeros(12))
    with pytest.raises(ValueError, match="2 weights .* for 3 reward components"):
        get_advantage_estimator("gdpo")(rewards, mask, index=index, config={"gdpo_reward_weights": [1.0, 2.0]},
                                        reward_components=torch.zeros(12, 3))


# ---------------------------------------------------------------- REINFORCE++ (+ baseline)


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_plus_plus_baseline_matches_reference(seed):
    rewards, mask, index = _batch(seed)
    scores = [sum(r) for r in _rows(rewards)]
    groups = _members(index)
    centred = []
    for i, g in enumerate(index):
        mu = statistics.fmean(scores[j] for j in groups[g]) if len(groups[g]) > 1 else 0.0
        centred.append([(scores[i] - mu) * m for m in _rows(mask)[i]])
    adv, ret = get_advantage_estimator("reinforce_plus_plus_baseline")(rewards, mask, index=index)
    _close(adv, _whiten_ref(centred, _rows(mask)))
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(seed, gamma):
    rewards, mask, _ = _batch(seed)
    expected = []
    for r, m in zip(_rows(rewards), _rows(mask)):
        g = [0.0] * len(r)
        for t in range(len(r) - 1, -1, -1):
            # the discounted sum only continues through a valid next token
            g[t] = r[t] + (gamma * g[t + 1] if t + 1 < len(r) and m[t + 1] else 0.0)
        expected.append(g)
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(rewards, mask, config={"gamma": gamma})
    _close(ret, expected)
    _close(adv, _whiten_ref(expected, _rows(mask)))


# ---------------------------------------------------------------- ReMax


@pytest.mark.parametrize("seed", range(3))
def test_remax_matches_reference(seed):
    rewards, mask, _ = _batch(seed)
    baselines = torch.from_numpy(np.random.default_rng(seed).normal(size=rewards.shape[0]))
    exp_adv, exp_ret = [], []
    for r, m, b in zip(_rows(rewards), _rows(mask), baselines.tolist()):
        to_go = [sum(r[u] * m[u] for u in range(t, len(r))) for t in range(len(r))]
        exp_ret.append(to_go)
        exp_adv.append([(g - b) * mt for g, mt in zip(to_go, m)])
    adv, ret = get_advantage_estimator("remax")(rewards, mask, reward_baselines=baselines)
    _close(adv, exp_adv)
    _close(ret, exp_ret)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 6), length=st.integers(1, 8))
def test_remax_baseline_equal_to_score_gives_zero_first_token(seed, rows, length):
    rng = np.random.default_rng(seed)
    rewards = torch.from_numpy(rng.normal(size=(rows, length)))
    mask = torch.from_numpy((rng.random((rows, length)) < 0.7).astype(np.float64))
    mask[:, 0] = 1.0
    adv, _ = get_advantage_estimator("remax")(rewards, mask, reward_baselines=(rewards * mask).sum(-1))
    torch.testing.assert_close(adv[:, 0], torch.zeros(rows, dtype=torch.float64), atol=1e-12, rtol=0)


# ---------------------------------------------------------------- OPO, GPG


@pytest.mark.parametrize("seed", range(3))
def test_opo_matches_reference(seed):
    rewards, mask, index = _batch(seed)
    mask[5] = 0.0  # an empty response: weight 0 in its group's baseline
    scores = [sum(r) for r in _rows(rewards)]
    lengths = [sum(m) for m in _rows(mask)]
    groups = _members(index)
    expected = []
    for i, g in enumerate(index):
        rows = groups[g]
        total = sum(lengths[j] for j in rows)
        b = sum(lengths[j] * scores[j] for j in rows) / total if len(rows) > 1 and total else 0.0
        expected.append([(scores[i] - b) * m for m in _rows(mask)[i]])
    adv, ret = get_advantage_estimator("opo")(rewards, mask, index=index)
    _close(adv, expected)
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("f_norm", [None, 2.5])
def test_gpg_matches_reference(seed, f_norm):
    rewards, mask, index = _batch(seed)
    rewards[:4] = 0.0  # some unrewarded responses so that α ≠ 1
    scores = [sum(r) for r in _rows(rewards)]
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    groups = _members(index)
    expected = []
    for i, g in enumerate(index):
        mu = statistics.fmean(scores[j] for j in groups[g]) if len(groups[g]) > 1 else 0.0
        a = alpha * (scores[i] - mu) / (f_norm or 1.0)
        expected.append([a * m for m in _rows(mask)[i]])
    adv, ret = get_advantage_estimator("gpg")(rewards, mask, index=index, config={"gpg_f_norm": f_norm})
    _close(adv, expected)
    assert torch.equal(ret, adv)


# ---------------------------------------------------------------- GRPO process supervision


def _process_ref(rewards, mask, steps, index, norm, eps=1e-6):
    groups = _members(index)
    expected = [None] * len(rewards)
    for rows in groups.values():
        ends = {i: [t for t in range(len(rewards[i])) if steps[i][t] and mask[i][t]] for i in rows}
        pooled = [rewards[i][t] for i in rows for t in ends[i]]
        mu, sd = (statistics.fmean(pooled), statistics.stdev(pooled)) if len(pooled) > 1 else (0.0, 1.0)
        for i in rows:
            normed = {t: (rewards[i][t] - mu) / (sd + eps) if norm else rewards[i][t] - mu for t in ends[i]}
            expected[i] = [sum(v for e, v in normed.items() if e >= t) * mask[i][t] for t in range(len(rewards[i]))]
    return expected


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_process_matches_reference(seed, norm):
    rewards, mask, index = _batch(seed)
    steps = torch.from_numpy(np.random.default_rng(seed + 7).random(rewards.shape) < 0.3)
    rewards = torch.where(steps, rewards, torch.zeros_like(rewards))  # rewards sit on step ends
    adv, ret = get_advantage_estimator("grpo_process")(rewards, mask, index=index, step_mask=steps,
                                                       config={"norm_adv_by_std_in_grpo": norm})
    _close(adv, _process_ref(_rows(rewards), _rows(mask), steps.tolist(), index, norm))
    assert torch.equal(ret, adv)
    for i in range(rewards.shape[0]):  # nothing is credited after a response's last step end
        ends = (steps[i] & mask[i].bool()).nonzero()
        after = 0 if len(ends) == 0 else ends.max().item() + 1
        assert torch.equal(adv[i, after:], torch.zeros_like(adv[i, after:]))


def test_grpo_process_single_step_reward_group():
    rewards = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 0.0]])
    steps = torch.tensor([[False, True, False], [False, False, False]])
    adv, _ = get_advantage_estimator("grpo_process")(rewards, torch.ones(2, 3), index=["a", "a"], step_mask=steps)
    # one step reward in the group: μ = 0, σ = 1
    torch.testing.assert_close(adv, torch.tensor([[3.0, 3.0, 0.0], [0.0, 0.0, 0.0]]) / (1 + 1e-6))


def _otb_reference(rewards, mask, index, old, sum_sq, is_weights, compact, zero_tail):
    """OTB by loops: per row the reward-to-go and the running sum of (1 − 2π + Σπ²)·ρ̄², read at
    every position (``compact``: at the k-th masked-in token instead), a baseline per group and
    column as the W-weighted mean of the group's returns."""
    series = []
    for i, (r, m) in enumerate(zip(_rows(rewards), mask)):
        to_go = [sum(r[u] * m[u] for u in range(t, len(r))) for t in range(len(r))]
        path, total = [], 0.0
        for t in range(len(r)):
            w = 1 - 2 * math.exp(old[i][t]) + sum_sq[i][t]
            total += w * (is_weights[i][t] ** 2 if is_weights is not None else 1.0) * m[t]
            path.append(total)
        kept = [t for t in range(len(r)) if m[t]] if compact else list(range(len(r)))
        series.append((to_go, path, kept, int(sum(m))))
    advantages = [[0.0] * rewards.shape[1] for _ in range(rewards.shape[0])]
    for group in set(index):
        members = [i for i in range(len(index)) if index[i] == group and (series[i][3] > 0 or not compact)]
        longest = sorted((series[i][3] for i in members), reverse=True)
        for i in members:
            to_go, path, kept, length = series[i]
            for k, t in enumerate(kept):
                if not mask[i][t]:
                    continue
                column = [(series[j][0][series[j][2][k]], series[j][1][series[j][2][k]])
                          for j in members if k < len(series[j][2]) and mask[j][series[j][2][k]]]
                baseline = (sum(g * w for g, w in column) / (sum(w for _, w in column) + 1e-8)
                            if len(members) > 1 else 0.0)
                unique_longest = len(longest) > 1 and length == longest[0] > longest[1]
                if zero_tail and unique_longest and k >= longest[1]:
                    baseline = 0.0
                advantages[i][t] = to_go[t] - baseline
    return advantages, [s[0] for s in series]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name, compact", [("optimal_token_baseline", False), ("tir_optimal_token_baseline", True)])
@pytest.mark.parametrize("importance_sampling", [False, True])
def test_optimal_token_baseline_matches_reference(seed, name, compact, importance_sampling):
    rewards, mask, index = _batch(seed, min_group=2)
    if not compact:  # the plain estimator's columns are positions: responses right-padded
        lengths = np.random.default_rng(seed).integers(0, rewards.shape[1] + 1, size=rewards.shape[0])
        mask = (torch.arange(rewards.shape[1]) < torch.from_numpy(lengths)[:, None]).double()
    rng = np.random.default_rng(seed + 1)
    old = torch.from_numpy(np.log(rng.uniform(0.05, 1.0, size=rewards.shape)))
    sum_sq = torch.from_numpy(rng.uniform(0.05, 1.0, size=rewards.shape))
    weights = torch.from_numpy(rng.uniform(0.5, 2.0, size=rewards.shape)) if importance_sampling else None
    adv, ret = get_advantage_estimator(name)(rewards, mask, index=index, old_log_probs=old, sum_pi_squared=sum_sq,
                                             rollout_is_weights=weights)
    exp_adv, exp_ret = _otb_reference(rewards, _rows(mask), list(index), _rows(old), _rows(sum_sq),
                                      None if weights is None else _rows(weights), compact, zero_tail=compact)
    _close(adv, exp_adv)
    _close(ret, exp_ret)


def test_optimal_token_baseline_zero_tail_and_singletons():
    """A group's unique longest response keeps its whole return past the second-longest one
    (``handle_zero_tail``); a group of one gets no baseline at all."""
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1.0, 1, 0, 0], [1.0, 1, 1, 1]])
    extras = dict(old_log_probs=torch.full((3, 4), -0.5), sum_pi_squared=torch.full((3, 4), 0.4))
    index = ["a", "a", "b"]
    plain, _ = get_advantage_estimator("optimal_token_baseline")(rewards, mask, index=index, **extras)
    tail, _ = get_advantage_estimator("optimal_token_baseline")(rewards, mask, index=index, handle_zero_tail=True,
                                                                 **extras)
    assert torch.equal(plain[2], torch.tensor([2.0, 2.0, 2.0, 2.0]))  # alone in its group
    assert torch.equal(tail[0, 2:], torch.tensor([1.0, 0.0])) and not torch.equal(plain[0, 2:], tail[0, 2:])
    assert torch.equal(plain[:, :2], tail[:, :2])


# ---------------------------------------------------------------- registry and errors


def test_registry_lists_catalogue():
    assert set(NEW) | {"grpo", "rloo"} <= set(ADV_ESTIMATORS.names())


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_group_estimators_are_those_that_need_an_index(name):
    """GROUP_ESTIMATORS (the config's warning for rollout.n=1 reads it) is exactly the set of
    estimators that compare responses within a group."""
    rewards = torch.ones(4, 3)
    extras = {"step_mask": torch.ones(4, 3, dtype=torch.bool), "values": torch.zeros(4, 3),
              "reward_baselines": torch.zeros(4), "old_log_probs": torch.zeros(4, 3), "sum_pi_squared": torch.ones(4, 3),
              "reward_components": torch.ones(4, 2)}
    estimator = get_advantage_estimator(name)
    if name not in GROUP_ESTIMATORS:
        estimator(rewards, torch.ones(4, 3), **extras)
        return
    with pytest.raises(ValueError, match=f"'{name}' needs index"):
        estimator(rewards, torch.ones(4, 3), **extras)
    with pytest.raises(ValueError, match="index has 3 ids for 4 rows"):
        estimator(rewards, torch.ones(4, 3), index=["a", "a", "b"], **extras)


@pytest.mark.parametrize("name, match", [
    ("gae", "'gae' needs extra 'values'"),
    ("remax", "'remax' needs extra 'reward_baselines'.*greedy baseline rollout"),
    ("grpo_process", "'grpo_process' needs extra 'step_mask'"),
    ("optimal_token_baseline", "'optimal_token_baseline' needs extra 'old_log_probs'.*calculate_sum_pi_squared=true"),
    ("gdpo", "'gdpo' needs extra 'reward_components'.*gdpo_reward_keys"),
])
def test_missing_extras_give_clear_errors(name, match):
    with pytest.raises(ValueError, match=match):
        get_advantage_estimator(name)(torch.ones(4, 3), torch.ones(4, 3), index=["a", "a", "b", "b"])


def test_extra_shapes_checked_and_unknown_extras_ignored():
    rewards, mask, index = _batch(1)
    with pytest.raises(ValueError, match="values has shape"):
        get_advantage_estimator("gae")(rewards, mask, values=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="reward_baselines has 3 values for 12 rows"):
        get_advantage_estimator("remax")(rewards, mask, reward_baselines=torch.zeros(3))
    extras = {"values": torch.zeros_like(rewards), "reward_baselines": torch.zeros(12, dtype=torch.float64),
              "step_mask": torch.ones_like(mask, dtype=torch.bool), "old_log_probs": torch.full_like(rewards, -1.0).float(),
              "sum_pi_squared": torch.full_like(rewards, 0.3).float(), "reward_components": torch.ones(12, 2),
              "unrelated": object()}
    idx = np.array([f"g{i // 2}" for i in range(12)], dtype=object)  # pairs, so grpo_passk applies
    for name in ADV_ESTIMATORS.names():
        adv, ret = get_advantage_estimator(name)(rewards.float(), mask.float(), index=idx, config=None, **extras)
        assert adv.shape == ret.shape == rewards.shape and not adv.requires_grad
        assert torch.isfinite(adv).all()
        assert torch.equal(adv * (1 - mask.float()), torch.zeros_like(adv)), name


def test_gdpo_components_from_the_reward_functions_values():
    """The trainer's (B, K) components: a failed sample (on_error=zero) scores 0 in each; a missing
    or non-numeric value is an error naming the key and what the function returned."""
    from hybrid_rl.trainer import RewardComponentError, reward_components

    extra = {"score": [1.0, 0.0, 2.0], "acc": [1, None, 0.5], "fmt": [0.0, None, True], "reward_failed": [False, True, False]}
    with pytest.raises(RewardComponentError, match="component 'fmt' of sample 2 is True"):
        reward_components(extra, ["acc", "fmt"], 3)
    extra["fmt"][2] = 0.25
    torch.testing.assert_close(reward_components(extra, ["acc", "fmt"], 3),
                               torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 0.25]]))
    with pytest.raises(RewardComponentError, match="names 'format', which the reward function did not return for "
                                                   "sample 0 .*it returned: acc, fmt, reward_failed, score"):
        reward_components(extra, ["format"], 3)
    extra["acc"][1] = None
    del extra["reward_failed"]
    with pytest.raises(RewardComponentError, match="'acc'.* for sample 1 \\(1 of 3 samples"):
        reward_components(extra, ["acc"], 3)
