import math

import pytest
import torch

from hybrid_rl.algorithms import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller, kl_penalty


def test_fixed_is_constant():
    ctrl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctrl.update(kl, n_steps=64)
        assert ctrl.value == 0.05


@pytest.mark.parametrize("current", [0.0, 0.05, 0.1, 0.11, 0.3, 5.0])
def test_adaptive_update_formula(current):
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    ctrl.update(current, n_steps=32)
    error = current / 0.1 - 1
    error = 0.2 if error > 0.2 else -0.2 if error < -0.2 else error
    assert math.isclose(ctrl.value, 0.2 * (1 + error * 32 / 1000), rel_tol=1e-12)


def test_adaptive_compounds_over_steps():
    ctrl = AdaptiveKLController(1.0, 0.1, 10)
    expected = 1.0
    for kl in (0.2, 0.2, 0.05, 0.1):
        ctrl.update(kl, n_steps=2)
        e = max(min(kl / 0.1 - 1, 0.2), -0.2)
        expected *= 1 + e * 2 / 10
    assert math.isclose(ctrl.value, expected, rel_tol=1e-12)


@pytest.mark.parametrize("horizon", [0, -5])
def test_adaptive_horizon_must_be_positive(horizon):
    with pytest.raises(ValueError, match="horizon > 0"):
        AdaptiveKLController(0.1, 0.1, horizon)
    with pytest.raises(ValueError, match="horizon > 0"):
        get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "horizon": horizon, "target_kl": 0.1})


def test_get_kl_controller_from_config():
    fixed = get_kl_controller({"type": "fixed", "kl_coef": 0.01, "horizon": 10000, "target_kl": 0.1})
    assert type(fixed) is FixedKLController and fixed.value == 0.01
    adaptive = get_kl_controller({"type": "adaptive", "kl_coef": 0.02, "horizon": 500, "target_kl": 0.3})
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.02, 0.3, 500)
    assert get_kl_controller(None).value == 0.001
    with pytest.raises(ValueError, match="Unknown KL controller type 'pid'"):
        get_kl_controller({"type": "pid"})


def test_state_round_trip():
    a = AdaptiveKLController(0.1, 0.05, 100)
    a.update(1.0, n_steps=10)
    b = AdaptiveKLController(0.1, 0.05, 100)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value
    a.update(0.01, 7), b.update(0.01, 7)
    assert b.value == a.value
    f = FixedKLController(0.3)
    g = FixedKLController(0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.3


@pytest.mark.parametrize("kind", ["kl", "k3", "abs"])
def test_apply_kl_penalty_formula_and_pre_update_beta(kind):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    scores = torch.zeros(B, T, dtype=torch.float64)
    scores[:, -1] = torch.rand(B, generator=g, dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[:, 0] = 1
    ctrl = AdaptiveKLController(0.5, 0.01, 10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kind)

    per_seq = []
    for i in range(B):
        total, n = 0.0, 0
        for t in range(T):
            kld = kl_penalty(old[i, t].view(1, 1), ref[i, t].view(1, 1), kind).item() * mask[i, t].item()
            assert math.isclose(rewards[i, t].item(), scores[i, t].item() - 0.5 * kld, rel_tol=1e-12, abs_tol=1e-15)
            total += kld * mask[i, t].item()
            n += mask[i, t].item()
        per_seq.append(total / n)
    current = sum(per_seq) / B
    # masked_mean's 1e-8 denominator epsilon (verl's) makes this agree to ~1e-9 relative, not to rounding
    assert math.isclose(metrics["actor/reward_kl_penalty"], current, rel_tol=1e-7)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5  # the value before this batch's update
    e = max(min(current / 0.01 - 1, 0.2), -0.2)
    assert math.isclose(ctrl.value, 0.5 * (1 + e * B / 10), rel_tol=1e-9)
    assert ctrl.value != 0.5
    # next batch uses the updated coefficient
    _, metrics2 = apply_kl_penalty(scores, old, ref, mask, ctrl, kind)
    assert metrics2["actor/reward_kl_penalty_coeff"] == pytest.approx(0.5 * (1 + e * B / 10))
