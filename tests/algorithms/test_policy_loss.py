import math

import pytest
import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms import aggregate_loss, get_policy_loss


def _vanilla_reference(old, logp, adv, mask, eps_low, eps_high, c, weights=None):
    """Per-token dual-clip PPO with plain Python floats; returns (loss matrix, clip flags, lower-clip flags)."""
    loss, clip, lower = [], [], []
    for i in range(len(old)):
        loss.append([]), clip.append([]), lower.append([])
        for t in range(len(old[i])):
            a = adv[i][t]
            r = math.exp(min(max(logp[i][t] - old[i][t], -20.0), 20.0))
            l1 = -a * r
            l2 = -a * min(max(r, 1 - eps_low), 1 + eps_high)
            lc = max(l1, l2)
            l3 = -a * c
            value = min(l3, lc) if a < 0 else lc
            loss[i].append(value * (weights[i][t] if weights else 1.0))
            clip[i].append(float(l2 > l1))
            lower[i].append(float(lc > l3 and a < 0))
    return loss, clip, lower


def _masked_mean(vals, mask):
    num = sum(v * m for rv, rm in zip(vals, mask) for v, m in zip(rv, rm))
    return num / sum(m for rm in mask for m in rm)


def _inputs(seed, batch=6, length=8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.5
    logp[0, 0] = old[0, 0] + 3.0  # ratio ≈ 20: triggers the dual clip for A < 0
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv[0, 0] = -1.0
    mask = (torch.rand(batch, length, generator=g) < 0.75).double()
    mask[0, 0] = 1
    return old, logp, adv, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("use_weights", [False, True])
def test_vanilla_matches_reference(mode, use_weights):
    old, logp, adv, mask = _inputs(0)
    weights = torch.rand_like(old) if use_weights else None
    config = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    loss, metrics = get_policy_loss("vanilla")(old, logp, adv, mask, loss_agg_mode=mode, config=config, rollout_is_weights=weights)

    ref_loss, clip, lower = _vanilla_reference(
        old.tolist(), logp.tolist(), adv.tolist(), mask.tolist(), 0.1, 0.28, 3.0, weights.tolist() if use_weights else None
    )
    # aggregation itself is checked independently in test_aggregation.py
    torch.testing.assert_close(loss, aggregate_loss(torch.tensor(ref_loss, dtype=torch.float64), mask, mode))
    assert math.isclose(metrics["pg_clipfrac"].item(), _masked_mean(clip, mask.tolist()), rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac_lower"].item(), _masked_mean(lower, mask.tolist()), rel_tol=1e-6)
    assert metrics["pg_clipfrac_lower"].item() > 0
    kl = _masked_mean((old - logp).tolist(), mask.tolist())
    assert math.isclose(metrics["ppo_kl"].item(), kl, rel_tol=1e-6)
    assert all(not m.requires_grad for m in metrics.values())


def test_vanilla_hand_checked_example():
    # ε = 0.2 (symmetric via clip_ratio), c = 3. One token each:
    #  A=+1, r=1.5 -> clipped to 1.2 -> L = -1.2 (clipfrac)
    #  A=-1, r=0.5 -> L1 = 0.5, L2 = 0.8 -> L = 0.8 (clipfrac)
    #  A=-1, r=5   -> L1 = 5, L2 = 1.2, Lc = 5 > L3 = 3 -> L = 3 (dual clip, lower clipfrac; L2 < L1 so no clipfrac)
    #  A=+2, r=1   -> L = -2
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5], [5.0], [1.0]]))
    adv = torch.tensor([[1.0], [-1.0], [-1.0], [2.0]])
    mask = torch.ones(4, 1)
    loss, metrics = get_policy_loss("vanilla")(old, logp, adv, mask, config=OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0}))
    assert math.isclose(loss.item(), (-1.2 + 0.8 + 3.0 - 2.0) / 4, rel_tol=1e-6)
    assert metrics["pg_clipfrac"].item() == 0.5
    assert metrics["pg_clipfrac_lower"].item() == 0.25
    # gradient w.r.t. logp: only the unclipped token (r=1, A=2) gets −A·r = −2, divided by 4 tokens
    logp = logp.clone().requires_grad_()
    get_policy_loss("vanilla")(old, logp, adv, mask)[0].backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [0.0], [0.0], [-0.5]]))


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_vanilla_rejects_clip_ratio_c_not_above_one(c):
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        get_policy_loss("vanilla")(*[torch.zeros(1, 1)] * 3, torch.ones(1, 1), config={"clip_ratio_c": c})


def test_vanilla_forwards_agg_kwargs():
    old, logp, adv, mask = _inputs(3)
    kwargs = {"global_num_tokens": 100, "dp_size": 4}
    loss, _ = get_policy_loss("vanilla")(old, logp, adv, mask, agg_kwargs=kwargs)
    ref_loss, _, _ = _vanilla_reference(old.tolist(), logp.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, 3.0)
    expected = sum(v * m for rv, rm in zip(ref_loss, mask.tolist()) for v, m in zip(rv, rm)) / 100 * 4
    assert math.isclose(loss.item(), expected, rel_tol=1e-9)


def test_reinforce_loss_and_gradient():
    old, logp, adv, mask = _inputs(4)
    weights = torch.rand_like(old)
    logp = logp.clone().requires_grad_()
    loss, metrics = get_policy_loss("reinforce")(old, logp, adv, mask, loss_agg_mode="seq-mean-token-sum", rollout_is_weights=weights)
    rows = [
        sum(-a * lp * w * m for a, lp, w, m in zip(ra, rl, rw, rm))
        for ra, rl, rw, rm in zip(adv.tolist(), logp.tolist(), weights.tolist(), mask.tolist())
        if sum(rm) > 0
    ]
    assert math.isclose(loss.item(), sum(rows) / len(rows), rel_tol=1e-9)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * weights * mask / len(rows))
    assert "ppo_kl" in metrics
