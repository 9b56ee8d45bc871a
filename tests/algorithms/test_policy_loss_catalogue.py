"""The non-vanilla policy losses against per-token float64 loop references (values and gradients)."""

import math

import pytest
import torch

from hybrid_rl.algorithms import POLICY_LOSSES, get_policy_loss

B, T = 5, 7
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
CONFIG = {"clip_ratio": 0.2, "clip_ratio_low": 0.15, "clip_ratio_high": 0.25, "tau_pos": 1.3, "tau_neg": 0.8}


def _inputs(seed, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    mask[0] = 1  # a full row
    mask[1] = 0  # an empty row: excluded from the sequence counts
    mask[2, :3] = 1
    return old, logp, adv, mask


def _aggregate_reference(losses, mask, mode, global_num_tokens=None, global_num_seqs=None, dp_size=1, loss_scale_factor=None):
    """losses: nested lists of 0-dim tensors; plain loops over rows and tokens."""
    rows = []
    for i in range(len(losses)):
        total, count = 0.0, 0.0
        for t in range(len(losses[i])):
            if mask[i][t]:
                total = total + losses[i][t]
                count += 1
        rows.append((total, count))
    n_tokens = sum(c for _, c in rows)
    n_seqs = sum(1 for _, c in rows if c > 0)
    n_tokens = global_num_tokens if global_num_tokens is not None else n_tokens
    n_seqs = global_num_seqs if global_num_seqs is not None else n_seqs
    if mode == "token-mean":
        value = sum(s for s, _ in rows) / n_tokens
    elif mode == "seq-mean-token-sum":
        value = sum(s for s, _ in rows) / n_seqs
    elif mode == "seq-mean-token-mean":
        value = sum(s / c for s, c in rows if c > 0) / n_seqs
    else:
        constant = loss_scale_factor if loss_scale_factor is not None else len(losses[0])
        value = sum(s for s, _ in rows) / (n_seqs * constant)
    return value * dp_size


def _clip(x, lo, hi):
    """clip on a 0-dim tensor: keeps the gradient only inside [lo, hi]."""
    v = x.item()
    return x if lo <= v <= hi else torch.tensor(min(max(v, lo), hi), dtype=torch.float64)


def _ref_gspo(old, logp, adv, mask, cfg):
    lo, hi = 1 - cfg["clip_ratio_low"], 1 + cfg["clip_ratio_high"]
    out = []
    for i in range(B):
        n = sum(mask[i][t].item() for t in range(T))
        seq = sum((logp[i][t].item() - old[i][t].item()) * mask[i][t].item() for t in range(T)) / max(n, 1)
        row = []
        for t in range(T):
            x = logp[i][t] - logp[i][t].item() + seq
            s = torch.exp(x) if seq <= 10 else torch.tensor(math.exp(10.0), dtype=torch.float64)
            a = adv[i][t].item()
            l1, l2 = -a * s, -a * _clip(s, lo, hi)
            row.append(l1 if l1.item() >= l2.item() else l2)
        out.append(row)
    return out


def _ref_sapo(old, logp, adv, mask, cfg):
    out = []
    for i in range(B):
        row = []
        for t in range(T):
            d = logp[i][t] - old[i][t]
            r = torch.exp(d) if abs(d.item()) <= 20 else torch.tensor(math.exp(math.copysign(20, d.item())), dtype=torch.float64)
            a = adv[i][t].item()
            tau = cfg["tau_pos"] if a > 0 else cfg["tau_neg"]
            gate = 1.0 / (1.0 + torch.exp(-tau * (r - 1.0))) * 4.0 / tau
            row.append(-gate * a)
        out.append(row)
    return out


def _ref_cispo(old, logp, adv, mask, cfg):
    lo, hi = 1 - cfg["clip_ratio_low"], 1 + cfg["clip_ratio_high"]
    out, clipped = [], []
    for i in range(B):
        row = []
        for t in range(T):
            r = math.exp(min(max(logp[i][t].item() - old[i][t].item(), -20), 20))
            w = min(max(r, lo), hi)
            clipped.append((w != r) * mask[i][t].item())
            row.append(-w * adv[i][t].item() * logp[i][t])
        out.append(row)
    return out


def _ref_gpg(old, logp, adv, mask, cfg):
    return [[-logp[i][t] * adv[i][t].item() for t in range(T)] for i in range(B)]


def _ref_kl_cov(old, logp, adv, mask, cfg):
    ratio_k, coef = cfg["policy_loss"]["kl_cov_ratio"], cfg["policy_loss"]["ppo_kl_coef"]
    valid = [(i, t) for i in range(B) for t in range(T) if mask[i][t].item() > 0]
    mean_a = sum(adv[i][t].item() for i, t in valid) / len(valid)
    mean_l = sum(logp[i][t].item() for i, t in valid) / len(valid)
    cov = {(i, t): (adv[i][t].item() - mean_a) * (logp[i][t].item() - mean_l) for i, t in valid}
    k = max(1, int(len(valid) * ratio_k))
    top = set(sorted(cov, key=cov.get, reverse=True)[:k])
    out = []
    for i in range(B):
        row = []
        for t in range(T):
            d = logp[i][t] - old[i][t]
            loss = -adv[i][t].item() * torch.exp(d)
            if (i, t) in top:
                loss = loss + coef * torch.abs(d)
            row.append(loss)
        out.append(row)
    return out


def _ref_dro(old, logp, adv, mask, cfg):
    beta = cfg["policy_loss"]["dro_beta"]
    return [[-(adv[i][t].item() * logp[i][t] - 0.5 * beta * (logp[i][t] - old[i][t]) ** 2) for t in range(T)]
            for i in range(B)]


def _dppo_inside(kind, logp, old, a, cfg):
    """Whether DPPO keeps the token's gradient: its probability's move within the bound for A's sign."""
    p, p_old = math.exp(logp), math.exp(old)
    low, high = cfg["clip_ratio_low"], cfg["clip_ratio_high"]
    if kind == "tv":
        return p - p_old <= high if a > 0 else p - p_old >= -low
    d = p_old * (old - logp) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    return (d <= high or p <= p_old) if a > 0 else (d <= low or p >= p_old)


def _ref_dppo(kind):
    def reference(old, logp, adv, mask, cfg):
        out = []
        for i in range(B):
            row = []
            for t in range(T):
                a = adv[i][t].item()
                w = min(math.exp(min(max(logp[i][t].item() - old[i][t].item(), -20), 20)), cfg["clip_ratio_c"])
                inside = _dppo_inside(kind, logp[i][t].item(), old[i][t].item(), a, cfg)
                row.append(-a * w * logp[i][t] * float(inside))
            out.append(row)
        return out
    return reference


REFERENCES = {"gspo": _ref_gspo, "sapo": _ref_sapo, "cispo": _ref_cispo, "gpg": _ref_gpg, "kl_cov": _ref_kl_cov,
              "dro": _ref_dro, "dppo_tv": _ref_dppo("tv"), "dppo_kl": _ref_dppo("kl")}
KL_COV_CFG = {**CONFIG, "policy_loss": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.7}}
DPPO_CFG = {**CONFIG, "clip_ratio_low": 0.02, "clip_ratio_high": 0.03, "clip_ratio_c": 1.3}  # bounds some tokens pass
CONFIGS = {"kl_cov": KL_COV_CFG, "dro": {**CONFIG, "policy_loss": {"dro_beta": 0.7}}, "dppo_tv": DPPO_CFG,
           "dppo_kl": DPPO_CFG}


def _check(name, cfg, mode, use_weights, agg_kwargs, seed=0):
    old, logp, adv, mask = _inputs(seed)
    weights = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(99)) * 2 if use_weights else None
    lp = logp.clone().requires_grad_()
    loss, metrics = get_policy_loss(name)(old, lp, adv, mask, loss_agg_mode=mode, config=cfg, agg_kwargs=agg_kwargs, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, lp)

    lp_ref = logp.clone().requires_grad_()
    rows = REFERENCES[name](old, lp_ref, adv, mask, cfg)
    if use_weights:
        rows = [[rows[i][t] * weights[i, t].item() for t in range(T)] for i in range(B)]
    ref = _aggregate_reference(rows, mask, mode, **(agg_kwargs or {}))
    (ref_grad,) = torch.autograd.grad(ref, lp_ref)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, ref_grad)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())
    return loss, metrics


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("mode", MODES)
def test_loss_value_and_gradient(name, mode):
    _check(name, CONFIGS.get(name, CONFIG), mode, use_weights=False, agg_kwargs=None)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_is_weights_and_global_normalisation(name):
    cfg = CONFIGS.get(name, CONFIG)
    for mode in ("token-mean", "seq-mean-token-mean"):
        agg = {"global_num_tokens": 40, "global_num_seqs": 9, "dp_size": 3, "loss_scale_factor": None}
        _check(name, cfg, mode, use_weights=True, agg_kwargs=agg)


@pytest.mark.parametrize("name", ["gspo", "sapo"])
def test_gspo_sapo_honour_loss_agg_mode(name):
    losses = {mode: _check(name, CONFIG, mode, False, None)[0].item() for mode in MODES}
    assert len({round(v, 12) for v in losses.values()}) == len(MODES)


def test_gspo_metrics_and_sequence_ratio():
    old, logp, adv, mask = _inputs(3)
    _, metrics = get_policy_loss("gspo")(old, logp, adv, mask, config=CONFIG)
    lo, hi = 1 - 0.15, 1 + 0.25
    flags, kl, n = 0.0, 0.0, 0.0
    for i in range(B):
        cnt = mask[i].sum().item()
        s = math.exp(min(sum((logp[i, t] - old[i, t]).item() * mask[i, t].item() for t in range(T)) / max(cnt, 1), 10))
        for t in range(T):
            if mask[i, t]:
                a = adv[i, t].item()
                flags += float(-a * min(max(s, lo), hi) > -a * s)
                kl += (old[i, t] - logp[i, t]).item()
                n += 1
    assert math.isclose(metrics["pg_clipfrac"].item(), flags / n, rel_tol=1e-9)
    assert math.isclose(metrics["ppo_kl"].item(), kl / n, rel_tol=1e-9)


def test_gspo_ratio_capped_at_exp10():
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.full((1, 3), 12.0, dtype=torch.float64, requires_grad=True)
    adv = -torch.ones(1, 3, dtype=torch.float64)
    loss, _ = get_policy_loss("gspo")(old, logp, adv, torch.ones(1, 3, dtype=torch.float64), config={"clip_ratio": 0.2})
    assert math.isclose(loss.item(), math.exp(10), rel_tol=1e-12)  # −A·s with s capped, A < 0 (no dual clip)
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad == 0).all()


def test_cispo_clipfrac():
    old, logp, adv, mask = _inputs(4, spread=0.6)
    _, metrics = get_policy_loss("cispo")(old, logp, adv, mask, config=CONFIG)
    flags = [
        float(min(max(math.exp((logp[i, t] - old[i, t]).item()), 0.85), 1.25) != math.exp((logp[i, t] - old[i, t]).item()))
        for i in range(B) for t in range(T) if mask[i, t]
    ]
    assert math.isclose(metrics["pg_clipfrac"].item(), sum(flags) / len(flags), rel_tol=1e-9)
    assert 0 < metrics["pg_clipfrac"].item() < 1


# ---------------------------------------------------------------- GMPO (geo_mean)


def _ref_geo_mean(old, logp, adv, mask, cfg, weights=None):
    """Per-sequence losses L_i (None for empty rows), with the log-space clip spelled out by sign cases."""
    e_lo, e_hi = cfg["clip_ratio_low"], cfg["clip_ratio_high"]
    seq_losses = []
    for i in range(B):
        n = sum(mask[i][t].item() for t in range(T))
        if n == 0:
            seq_losses.append(None)
            continue
        total_d, total_a, total_logw = 0.0, 0.0, 0.0
        for t in range(T):
            if not mask[i][t]:
                continue
            d, a = logp[i][t] - old[i][t], adv[i][t].item()
            if a > 0:  # only an increase of the ratio is clipped
                d_hat = d if d.item() <= e_hi else torch.tensor(e_hi, dtype=torch.float64)
            elif a < 0:  # only a decrease is clipped
                d_hat = d if d.item() >= -e_lo else torch.tensor(-e_lo, dtype=torch.float64)
            else:
                d_hat = 0.0
            total_d = total_d + d_hat
            total_a += a
            if weights is not None:
                total_logw += math.log(weights[i][t].item() + 1e-10)
        loss = -(total_a / n) * torch.exp(total_d / n)
        seq_losses.append(loss * math.exp(total_logw / n))
    return seq_losses


@pytest.mark.parametrize("use_weights", [False, True])
@pytest.mark.parametrize("agg", [None, {"global_num_seqs": 11, "dp_size": 2}])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_geo_mean_value_and_gradient(use_weights, agg, mode):
    old, logp, adv, mask = _inputs(5, spread=0.3)
    adv[3, 1] = 0.0
    weights = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) + 0.1 if use_weights else None
    cfg = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.15}
    lp = logp.clone().requires_grad_()
    loss, metrics = get_policy_loss("geo_mean")(old, lp, adv, mask, loss_agg_mode=mode, config=cfg, agg_kwargs=agg, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, lp)

    lp_ref = logp.clone().requires_grad_()
    seq = [s for s in _ref_geo_mean(old, lp_ref, adv, mask, cfg, weights) if s is not None]
    n_seqs = agg["global_num_seqs"] if agg else len(seq)  # the empty row is not counted
    ref = sum(seq) / n_seqs * (agg["dp_size"] if agg else 1)
    (ref_grad,) = torch.autograd.grad(ref, lp_ref)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, ref_grad)

    clipped = lower = count = 0
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                d, a = (logp[i, t] - old[i, t]).item(), adv[i, t].item()
                c = (a > 0 and d > 0.15) or (a < 0 and d < -0.1)
                clipped += c
                lower += c and a < 0
                count += 1
    assert math.isclose(metrics["pg_clipfrac"].item(), clipped / count, rel_tol=1e-9)
    assert math.isclose(metrics["pg_clipfrac_lower"].item(), lower / count, rel_tol=1e-9)


def test_geo_mean_split_over_micro_batches_is_exact():
    """Two micro-batches with the global sequence count sum to the one-call loss."""
    old, logp, adv, mask = _inputs(6)
    fn = get_policy_loss("geo_mean")
    whole, _ = fn(old, logp, adv, mask, config=CONFIG)
    n = int((mask.sum(-1) > 0).sum())
    parts = sum(fn(old[s], logp[s], adv[s], mask[s], config=CONFIG, agg_kwargs={"global_num_seqs": n})[0] for s in (slice(0, 2), slice(2, B)))
    torch.testing.assert_close(parts, whole)


# ---------------------------------------------------------------- Clip-Cov


def _clip_cov_setup(seed):
    old, logp, adv, mask = _inputs(seed, spread=0.25)
    adv = adv * 3  # spread covariances over the (lb, ub) window
    cfg = {**CONFIG, "policy_loss": {"clip_cov_ratio": 0.15, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}, "seed": 0}
    return old, logp, adv, mask, cfg


def _clip_cov_candidates(old, logp, adv, mask, cfg):
    pl = cfg["policy_loss"]
    lo, hi = 1 - cfg["clip_ratio_low"], 1 + cfg["clip_ratio_high"]
    valid = [(i, t) for i in range(B) for t in range(T) if mask[i, t] > 0]
    mean_a = sum(adv[i, t].item() for i, t in valid) / len(valid)
    mean_l = sum(logp[i, t].item() for i, t in valid) / len(valid)
    cands = set()
    for i, t in valid:
        r = math.exp((logp[i, t] - old[i, t]).item())
        a = adv[i, t].item()
        cov = (a - mean_a) * (logp[i, t].item() - mean_l)
        if -a * min(max(r, lo), hi) <= -a * r and pl["clip_cov_lb"] < cov < pl["clip_cov_ub"]:
            cands.add((i, t))
    return valid, cands


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_clip_cov_value_gradient_and_selection(mode):
    old, logp, adv, mask, cfg = _clip_cov_setup(8)
    lp = logp.clone().requires_grad_()
    loss, metrics = get_policy_loss("clip_cov")(old, lp, adv, mask, loss_agg_mode=mode, config=cfg)
    (grad,) = torch.autograd.grad(loss, lp)

    valid, cands = _clip_cov_candidates(old, logp, adv, mask, cfg)
    n_drop = min(max(int(0.15 * len(valid)), 1), len(cands))
    assert len(cands) > n_drop > 1  # the draw is a genuine choice
    # Dropped tokens are the candidates whose gradient vanished (a kept candidate has gradient −A·r ≠ 0).
    dropped = {(i, t) for i, t in cands if grad[i, t].item() == 0.0}
    assert len(dropped) == n_drop
    assert math.isclose(metrics["pg_clipfrac"].item(), n_drop / len(valid), rel_tol=1e-9)

    lp_ref = logp.clone().requires_grad_()
    lo, hi = 1 - cfg["clip_ratio_low"], 1 + cfg["clip_ratio_high"]
    rows = []
    for i in range(B):
        row = []
        for t in range(T):
            r = torch.exp(lp_ref[i, t] - old[i, t])
            a = adv[i, t].item()
            l1, l2 = -a * r, -a * _clip(r, lo, hi)
            row.append(0.0 * r if (i, t) in dropped else (l1 if l1.item() >= l2.item() else l2))
        rows.append(row)
    ref = _aggregate_reference(rows, mask, mode)
    (ref_grad,) = torch.autograd.grad(ref, lp_ref)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, ref_grad)


def test_clip_cov_reproducible_with_seed():
    old, logp, adv, mask, cfg = _clip_cov_setup(8)
    fn = get_policy_loss("clip_cov")

    def dropped_pattern(seed):
        lp = logp.clone().requires_grad_()
        loss, _ = fn(old, lp, adv, mask, config={**cfg, "seed": seed})
        return loss.item(), torch.autograd.grad(loss, lp)[0] == 0

    first, again = dropped_pattern(0), dropped_pattern(0)
    assert first[0] == again[0] and torch.equal(first[1], again[1])
    others = [dropped_pattern(s) for s in range(1, 6)]
    assert any(not torch.equal(first[1], o[1]) for o in others)
    # policy_loss.seed takes precedence over the actor-level seed
    nested = {**cfg, "seed": 3, "policy_loss": {**cfg["policy_loss"], "seed": 0}}
    lp = logp.clone().requires_grad_()
    loss, _ = fn(old, lp, adv, mask, config=nested)
    assert loss.item() == first[0]


def test_clip_cov_default_config_drops_at_most_one():
    old, logp, adv, mask = _inputs(9)
    _, metrics = get_policy_loss("clip_cov")(old, logp, adv, mask, config=None)
    n_valid = mask.sum().item()
    assert metrics["pg_clipfrac"].item() * n_valid == pytest.approx(round(metrics["pg_clipfrac"].item() * n_valid))
    assert metrics["pg_clipfrac"].item() * n_valid <= 1 + 1e-9


def test_kl_cov_metric_and_zero_ratio():
    old, logp, adv, mask = _inputs(10)
    loss, metrics = get_policy_loss("kl_cov")(old, logp, adv, mask, config=KL_COV_CFG)
    vals = [abs((logp[i, t] - old[i, t]).item()) for i in range(B) for t in range(T) if mask[i, t]]
    assert math.isclose(metrics["ppo_kl"].item(), sum(vals) / len(vals), rel_tol=1e-9)
    off, _ = get_policy_loss("kl_cov")(old, logp, adv, mask, config={"policy_loss": {"kl_cov_ratio": 0.0}})
    plain = [-adv[i, t].item() * math.exp((logp[i, t] - old[i, t]).item()) for i in range(B) for t in range(T) if mask[i, t]]
    assert math.isclose(off.item(), sum(plain) / len(plain), rel_tol=1e-9)
    assert loss.item() > off.item()  # the penalty is non-negative and hits some tokens


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_keeps_some_tokens_and_drops_others_and_counts_them(kind):
    _, metrics = _check(f"dppo_{kind}", DPPO_CFG, "token-mean", False, None)
    old, logp, adv, mask = _inputs(0)
    outside = [not _dppo_inside(kind, logp[i][t].item(), old[i][t].item(), adv[i][t].item(), DPPO_CFG)
               for i in range(B) for t in range(T) if mask[i][t]]
    assert 0 < sum(outside) < len(outside)  # both kinds of token in the test's batch
    assert metrics["pg_clipfrac"].item() == pytest.approx(sum(outside) / len(outside))


def test_dro_needs_a_positive_beta():
    old, logp, adv, mask = _inputs(0)
    with pytest.raises(ValueError, match="dro_beta must be positive"):
        get_policy_loss("dro")(old, logp, adv, mask, config={**CONFIG, "policy_loss": {"dro_beta": None}})


def test_registered_names():
    assert {"vanilla", "reinforce", "gspo", "sapo", "geo_mean", "cispo", "clip_cov", "kl_cov", "gpg", "dro", "dppo_tv",
            "dppo_kl"} <= set(POLICY_LOSSES.names())
