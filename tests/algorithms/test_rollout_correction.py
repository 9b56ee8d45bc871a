import math

import pytest
import torch

from hybrid_rl.algorithms import ROLLOUT_RS_MODES, compute_rollout_correction, mismatch_metrics

MISMATCH_KEYS = {
    "rollout_corr/abs_logp_diff_mean",
    "rollout_corr/abs_logp_diff_max",
    "rollout_corr/k3_mean",
    "rollout_corr/k1_mean",
}
IS_KEYS = {f"rollout_corr/rollout_is_{k}" for k in ("mean", "max", "min", "eff_sample_size", "truncated_fraction")}
RS_KEYS = {"rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction"}


def _hand_made():
    """log ρ rows [0.1, −0.2, 0.0], [0.9, 0.0, pad], [−0.6, 0.1, 0.1]; the pad holds garbage log-probs."""
    log_ratio = torch.tensor([[0.1, -0.2, 0.0], [0.9, 0.0, 0.0], [-0.6, 0.1, 0.1]], dtype=torch.float64)
    rollout = -torch.full((3, 3), 1.5, dtype=torch.float64)
    old = rollout + log_ratio
    old[1, 2] = -math.inf
    rollout[1, 2] = math.nan
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    return old, rollout, mask


# Expected masks worked out by hand from k1 = −x, k2 = x²/2, k3 = eˣ − 1 − x (values in the comments).
HAND_CASES = [
    # k1 per token: [−.1 .2 0], [−.9 0], [.6 −.1 −.1]; bounds [log .7, log 1.5] = [−.357, .405]
    ("token_k1", "0.7_1.5", [[1, 1, 1], [0, 1, 0], [0, 1, 1]]),
    ("token_k1", 2.0, [[1, 1, 1], [0, 1, 0], [1, 1, 1]]),  # [1/2, 2] → ±.693
    ("token_k1", "2.0", [[1, 1, 1], [0, 1, 0], [1, 1, 1]]),
    # k2 per token: [.005 .02 0], [.405 0], [.18 .005 .005]
    ("token_k2", 0.1, [[1, 1, 1], [0, 1, 0], [0, 1, 1]]),
    # k3 per token: [.00517 .01873 0], [.5596 0], [.1488 .00517 .00517]
    ("token_k3", 0.01, [[1, 0, 1], [0, 1, 0], [0, 1, 1]]),
    # sums of k1: .1, −.9, .4 within [log .8, log 1.25] = ±.223
    ("seq_sum_k1", "0.8_1.25", [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),
    ("seq_sum_k2", 0.2, [[1, 1, 1], [0, 0, 0], [1, 1, 1]]),  # .025, .405, .19
    ("seq_sum_k3", 0.1, [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),  # .0239, .5596, .1591
    ("seq_mean_k1", "0.8_1.25", [[1, 1, 1], [0, 0, 0], [1, 1, 1]]),  # .033, −.45, .133
    ("seq_mean_k2", 0.1, [[1, 1, 1], [0, 0, 0], [1, 1, 1]]),  # .0083, .2025, .0633
    ("seq_mean_k3", 0.05, [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),  # .0080, .2798, .0530
    ("seq_max_k2", 0.15, [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),  # .02, .405, .18
    ("seq_max_k3", 0.1, [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),  # .0187, .5596, .1488
]


@pytest.mark.parametrize("mode, threshold, expected", HAND_CASES)
def test_rejection_modes_hand_made(mode, threshold, expected):
    old, rollout, mask = _hand_made()
    weights, new_mask, metrics = compute_rollout_correction(old, rollout, mask, rollout_rs=mode, rollout_rs_threshold=threshold)
    assert weights is None
    torch.testing.assert_close(new_mask, torch.tensor(expected, dtype=torch.float64))
    rejected = (mask.sum() - new_mask.sum()).item()
    assert math.isclose(metrics["rollout_corr/rollout_rs_masked_fraction"], rejected / mask.sum().item(), rel_tol=1e-7)
    assert MISMATCH_KEYS | RS_KEYS | {f"rollout_corr/rollout_rs_{mode}_masked_fraction"} <= set(metrics)


def test_all_modes_covered_by_hand_cases():
    assert {case[0] for case in HAND_CASES} == set(ROLLOUT_RS_MODES)


def test_combined_modes_must_all_pass():
    old, rollout, mask = _hand_made()
    _, new_mask, metrics = compute_rollout_correction(old, rollout, mask, rollout_rs="token_k2, seq_sum_k2", rollout_rs_threshold="0.1,0.2")
    torch.testing.assert_close(new_mask, torch.tensor([[1, 1, 1], [0, 0, 0], [0, 1, 1]], dtype=torch.float64))
    assert math.isclose(metrics["rollout_corr/rollout_rs_masked_fraction"], 3 / 8, rel_tol=1e-7)
    assert math.isclose(metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 2 / 3, rel_tol=1e-12)
    # a single threshold is shared by every mode
    _, shared, _ = compute_rollout_correction(old, rollout, mask, rollout_rs="token_k2,seq_max_k2", rollout_rs_threshold=0.1)
    torch.testing.assert_close(shared, torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 0]], dtype=torch.float64))


def _stat(x, k):
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(max(min(x, 20), -20)) - 1 - x}[k]


def _reference_stats(log_ratio, mask, mode):
    """Loops: (B, T) nested list of the statistic each valid token is judged by (None at padding)."""
    kind, k = (mode.split("_")[1] if mode.startswith("seq") else "token"), mode[-2:]
    out = []
    for i in range(len(log_ratio)):
        stats = [_stat(log_ratio[i][t], k) if mask[i][t] else None for t in range(len(mask[i]))]
        valid = [x for x in stats if x is not None]
        if kind != "token" and valid:
            value = {"sum": sum(valid), "mean": sum(valid) / len(valid), "max": max(valid)}[kind]
            stats = [value if x is not None else None for x in stats]
        out.append(stats)
    return out


@pytest.mark.parametrize("mode", sorted(ROLLOUT_RS_MODES))
def test_rejection_modes_random_against_loops(mode):
    g = torch.Generator().manual_seed(sorted(ROLLOUT_RS_MODES).index(mode))
    old = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    rollout = old - torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.3
    mask = (torch.rand(6, 9, generator=g) < 0.7).double()
    mask[0] = 0
    stats = _reference_stats((old - rollout).tolist(), mask.tolist(), mode)
    values = sorted({x for row in stats for x in row if x is not None})
    # thresholds between the data's own quantiles (never on a value), so every mode genuinely splits the batch
    def between(q):
        j = int(q * (len(values) - 1))
        return (values[j] + values[j + 1]) / 2

    if mode.endswith("k1"):
        low, high = between(0.25), between(0.75)
        threshold = f"{math.exp(low)}_{math.exp(high)}"
    else:
        low, high = -math.inf, between(0.5)
        threshold = high
    _, new_mask, _ = compute_rollout_correction(old, rollout, mask, rollout_rs=mode, rollout_rs_threshold=threshold)
    expected = [[float(x is not None and low <= x <= high) for x in row] for row in stats]
    torch.testing.assert_close(new_mask, torch.tensor(expected, dtype=torch.float64))
    assert 0 < new_mask.sum() < mask.sum()


def _is_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(5, 6, generator=g, dtype=torch.float64) * 3
    log_ratio = torch.randn(5, 6, generator=g, dtype=torch.float64) * 0.6
    log_ratio[0, 0] = 30.0  # beyond the ±20 safety bound
    log_ratio[4, :] = -0.4  # a sequence with a small weight
    mask = (torch.rand(5, 6, generator=g) < 0.75).double()
    mask[0, 0] = mask[4, 0] = 1
    mask[3] = 0  # an empty sequence
    return rollout + log_ratio, rollout, mask


def _reference_weights(old, rollout, mask, level, threshold, normalize):
    """Per-token or per-sequence truncated ratios with loops; normalised over non-empty units."""
    B, T = mask.shape
    w = [[0.0] * T for _ in range(B)]
    units = []
    for i in range(B):
        lr = [(old[i, t] - rollout[i, t]).item() for t in range(T)]
        if level == "sequence":
            s = sum(lr[t] for t in range(T) if mask[i, t])
            value = min(math.exp(max(min(s, 20), -20)), threshold)
            if mask[i].sum() > 0:
                units.append(value)
            for t in range(T):
                w[i][t] = value * mask[i, t].item()
        else:
            for t in range(T):
                if mask[i, t]:
                    w[i][t] = min(math.exp(max(min(lr[t], 20), -20)), threshold)
                    units.append(w[i][t])
    if normalize:
        mean = sum(units) / len(units)
        if mean > 1e-8:
            w = [[x / mean for x in row] for row in w]
            units = [x / mean for x in units]
    return torch.tensor(w, dtype=torch.float64), units


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1e30])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights(level, threshold, normalize):
    old, rollout, mask = _is_inputs()
    old.requires_grad_()
    weights, new_mask, metrics = compute_rollout_correction(
        old, rollout, mask, rollout_is=level, rollout_is_threshold=threshold, batch_normalize=normalize
    )
    expected, units = _reference_weights(old.detach(), rollout, mask, level, threshold, normalize)
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad
    torch.testing.assert_close(new_mask, mask)
    if threshold == 1e30 and not normalize and level == "token":
        assert weights[0, 0].item() == pytest.approx(math.exp(20))  # only the ±20 safety clamp
    if threshold == 2.0 and not normalize:
        assert weights.max().item() <= 2.0
        small = weights[4][mask[4] > 0]
        assert (small < 1).all()  # truncation is from above only
    if normalize:
        assert sum(units) / len(units) == pytest.approx(1.0)
    assert math.isclose(metrics["rollout_corr/rollout_is_mean"], sum(units) / len(units), rel_tol=1e-9)
    assert math.isclose(metrics["rollout_corr/rollout_is_max"], max(units), rel_tol=1e-9)
    assert math.isclose(metrics["rollout_corr/rollout_is_min"], min(units), rel_tol=1e-9)
    ess = (sum(units) / len(units)) ** 2 / (sum(u * u for u in units) / len(units))
    assert math.isclose(metrics["rollout_corr/rollout_is_eff_sample_size"], ess, rel_tol=1e-9)
    assert 0 < ess <= 1


def test_batch_normalize_skipped_for_vanishing_mean():
    rollout = torch.zeros(2, 3, dtype=torch.float64)
    old = rollout - 25.0  # every weight is e^−20 < 1e-8
    mask = torch.ones(2, 3, dtype=torch.float64)
    weights, _, _ = compute_rollout_correction(old, rollout, mask, rollout_is="token", batch_normalize=True)
    torch.testing.assert_close(weights, torch.full((2, 3), math.exp(-20), dtype=torch.float64))


def test_is_with_rejection_uses_kept_tokens():
    old, rollout, mask = _hand_made()
    weights, new_mask, _ = compute_rollout_correction(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=10.0, rollout_rs="token_k2", rollout_rs_threshold=0.1,
        batch_normalize=True,
    )
    kept = [math.exp(x) for x in (0.1, -0.2, 0.0, 0.0, 0.1, 0.1)]
    assert (weights[new_mask == 0] == 0).all()
    assert weights[new_mask > 0].mean().item() == pytest.approx(1.0)
    torch.testing.assert_close(weights[new_mask > 0], torch.tensor(kept, dtype=torch.float64) / (sum(kept) / len(kept)))
    # sequence weights use the whole sequence's ratio even when some of its tokens are rejected
    seq_w, _, _ = compute_rollout_correction(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=10.0, rollout_rs="token_k2", rollout_rs_threshold=0.1
    )
    assert seq_w[2, 1].item() == pytest.approx(math.exp(-0.6 + 0.1 + 0.1)) and seq_w[2, 0].item() == 0.0


def test_mismatch_metrics_always_present():
    old, rollout, mask = _hand_made()
    metrics = mismatch_metrics(old, rollout, mask)
    assert set(metrics) == MISMATCH_KEYS
    xs = [0.1, -0.2, 0.0, 0.9, 0.0, -0.6, 0.1, 0.1]
    assert math.isclose(metrics["rollout_corr/abs_logp_diff_mean"], sum(map(abs, xs)) / 8, rel_tol=1e-7)
    assert math.isclose(metrics["rollout_corr/abs_logp_diff_max"], 0.9, rel_tol=1e-12)
    assert math.isclose(metrics["rollout_corr/k1_mean"], sum(-x for x in xs) / 8, rel_tol=1e-7)
    assert math.isclose(metrics["rollout_corr/k3_mean"], sum(math.exp(x) - 1 - x for x in xs) / 8, rel_tol=1e-7)
    assert all(math.isfinite(v) for v in metrics.values())  # the garbage at the pad never leaks in
    for kwargs in ({}, {"rollout_is": "token"}, {"rollout_rs": "token_k3", "rollout_rs_threshold": 1.0}):
        _, _, m = compute_rollout_correction(old, rollout, mask, **kwargs)
        assert MISMATCH_KEYS | RS_KEYS <= set(m)
        assert (IS_KEYS <= set(m)) == ("rollout_is" in kwargs)
    empty = mismatch_metrics(old, rollout, torch.zeros_like(mask))
    assert set(empty) == MISMATCH_KEYS and all(v == 0.0 for v in empty.values())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rollout_is": "geometric"}, "Unknown rollout_is 'geometric'. Valid: token, sequence"),
        ({"rollout_rs": "token_k1,seq_max_k1", "rollout_rs_threshold": 2.0}, "seq_max_k1.*Valid: token_k1, token_k2"),
        ({"rollout_rs": "token_k2"}, "needs rollout_rs_threshold"),
        ({"rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "1,2,3"}, "3 entries for 2"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2_1"}, "lower_upper"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "abc"}, "lower_upper"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": -1.0}, "non-negative"),
    ],
)
def test_errors(kwargs, match):
    old, rollout, mask = _hand_made()
    with pytest.raises(ValueError, match=match):
        compute_rollout_correction(old, rollout, mask, **kwargs)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("lower", [None, 0.8])
def test_verl07_rejection_levels_keep_what_verl_07_kept(level, lower):
    """verl 0.7's `rollout_rs` level with its float upper bound and optional lower bound, adopted as
    0.9's k1 mode, keeps exactly the tokens 0.7's rule does: lower <= ρ <= upper for the token's ratio
    ρ = exp(old - rollout), or the sequence's product or geometric mean of them (loops here)."""
    from hybrid_rl.config import validate_config
    from hybrid_rl.main import compose_config

    upper = 1.3
    overrides = [f"algorithm.rollout_correction.rollout_rs={level}", f"algorithm.rollout_correction.rollout_rs_threshold={upper}"]
    if lower is not None:
        overrides.append(f"algorithm.rollout_correction.rollout_rs_threshold_lower={lower}")
    correction = validate_config(compose_config(overrides)).algorithm.rollout_correction
    assert correction.rollout_rs == {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}[level]
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(16, 6, generator=g, dtype=torch.float64) * 2
    rollout = old - torch.randn(16, 6, generator=g, dtype=torch.float64) * 0.4
    mask = (torch.rand(16, 6, generator=g) < 0.8).double()
    _, kept, _ = compute_rollout_correction(old, rollout, mask, rollout_rs=correction.rollout_rs,
                                            rollout_rs_threshold=correction.rollout_rs_threshold)
    low = 1 / upper if lower is None else lower
    expected = torch.zeros_like(mask)
    for i in range(16):
        logs = [float(old[i, t] - rollout[i, t]) for t in range(6) if mask[i, t]]
        seq = {"sequence": math.exp(sum(logs)), "geometric": math.exp(sum(logs) / max(len(logs), 1))}.get(level)
        for t in range(6):
            ratio = math.exp(float(old[i, t] - rollout[i, t])) if level == "token" else seq
            expected[i, t] = mask[i, t] * (low <= ratio <= upper)
    assert 0 < expected.sum() < mask.sum()  # some kept, some rejected
    torch.testing.assert_close(kept, expected)


@pytest.mark.parametrize("rollout_rs", [None, "token_k1"])
def test_token_veto_drops_the_sequences_verl_07_vetoed(rollout_rs):
    """verl 0.7's rollout_token_veto_threshold v: a sequence with any valid token whose ratio
    ρ = exp(old - rollout) is below v loses every token, whatever rollout_rs kept (a loop here);
    padding's garbage log-probs veto nothing."""
    from hybrid_rl.config import validate_config
    from hybrid_rl.main import compose_config

    key = "algorithm.rollout_correction.rollout_token_veto_threshold"
    veto = validate_config(compose_config([f"{key}=0.6"])).algorithm.rollout_correction.rollout_token_veto_threshold
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(24, 5, generator=g, dtype=torch.float64) * 2
    rollout = old - torch.randn(24, 5, generator=g, dtype=torch.float64) * 0.3
    mask = (torch.rand(24, 5, generator=g) < 0.8).double()
    old[mask == 0] = -math.inf  # a vetoing ratio, were padding not skipped
    _, kept, metrics = compute_rollout_correction(old, rollout, mask, rollout_rs=rollout_rs, rollout_rs_threshold=1.5,
                                                  token_veto_threshold=veto)
    _, rs_kept, _ = compute_rollout_correction(old, rollout, mask, rollout_rs=rollout_rs, rollout_rs_threshold=1.5)
    expected, vetoed, catastrophic = rs_kept.clone(), 0, 0
    for i in range(24):
        low = [t for t in range(5) if mask[i, t] and math.exp(float(old[i, t] - rollout[i, t])) < veto]
        catastrophic += len(low)
        if low:
            expected[i] = 0
            vetoed += 1
    assert 0 < vetoed < 24 and (rollout_rs is None or not torch.equal(rs_kept, mask))
    torch.testing.assert_close(kept, expected)
    assert math.isclose(metrics["rollout_corr/rollout_is_veto_fraction"], vetoed / 24, rel_tol=1e-12)
    assert math.isclose(metrics["rollout_corr/rollout_is_catastrophic_token_fraction"],
                        catastrophic / mask.sum().item(), rel_tol=1e-9)  # masked_mean's 1e-8 in the count
    with pytest.raises(ValueError, match="must be positive"):
        compute_rollout_correction(old, rollout, mask, token_veto_threshold=0.0)


@pytest.mark.parametrize("overrides, match", [
    (["rollout_token_veto_threshold=0"], r"rollout_token_veto_threshold=0 must be a positive number"),
    (["rollout_token_veto_threshold=abc"], r"rollout_token_veto_threshold='abc' must be a positive number"),
    (["rollout_rs=token", "rollout_rs_threshold=2.0", "rollout_rs_threshold_lower=3.0"],
     r"rollout_rs=token \(verl 0.7's level\) .* 0 < lower <= upper"),
    (["rollout_rs=token_k1", "rollout_rs_threshold=2.0", "rollout_rs_threshold_lower=0.5"],
     r"rollout_rs_threshold_lower is verl 0.7's lower bound"),
])
def test_verl07_rejection_settings_that_do_not_fit_are_refused(overrides, match):
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.main import compose_config

    with pytest.raises(ConfigError, match=match):
        validate_config(compose_config([f"algorithm.rollout_correction.{o}" for o in overrides]))
