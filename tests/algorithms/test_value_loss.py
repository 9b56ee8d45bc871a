import math

import pytest
import torch

from hybrid_rl.algorithms import compute_value_loss


def _inputs(seed, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    vpreds = values + torch.randn(B, T, generator=g, dtype=torch.float64)
    returns = values + torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    mask[0] = 1
    mask[1] = 0
    return vpreds, returns, values, mask


def _reference(vpreds, returns, values, mask, c, mode):
    """Loops: per-token max of the two squared errors, then ½ × the aggregation; plus the metrics."""
    rows, clip_flags, preds = [], [], []
    for i in range(vpreds.shape[0]):
        row = []
        for t in range(vpreds.shape[1]):
            v, r, old = vpreds[i, t], returns[i, t].item(), values[i, t].item()
            v_clip = v if old - c <= v.item() <= old + c else torch.tensor(min(max(v.item(), old - c), old + c), dtype=torch.float64)
            e1, e2 = (v - r) ** 2, (v_clip - r) ** 2
            row.append(e1 if e1.item() >= e2.item() else e2)
            if mask[i, t]:
                clip_flags.append(float(e2.item() > e1.item()))
                preds.append(v.item())
        rows.append(row)
    sums = [sum(rows[i][t] for t in range(len(rows[i])) if mask[i, t]) for i in range(len(rows))]
    counts = [mask[i].sum().item() for i in range(len(rows))]
    if mode == "token-mean":
        agg = sum(sums) / sum(counts)
    else:  # seq-mean-token-mean over non-empty rows
        agg = sum(s / n for s, n in zip(sums, counts) if n) / sum(1 for n in counts if n)
    return 0.5 * agg, sum(clip_flags) / len(clip_flags), sum(preds) / len(preds)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("c", [0.2, 0.5, 10.0])
def test_value_loss_matches_reference(mode, c):
    vpreds, returns, values, mask = _inputs(0)
    vp = vpreds.clone().requires_grad_()
    loss, metrics = compute_value_loss(vp, returns, values, mask, c, loss_agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, vp)
    vp_ref = vpreds.clone().requires_grad_()
    ref, clipfrac, vpred_mean = _reference(vp_ref, returns, values, mask, c, mode)
    (ref_grad,) = torch.autograd.grad(ref, vp_ref)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, ref_grad)
    assert math.isclose(metrics["vf_clipfrac"].item(), clipfrac, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(metrics["vpred_mean"].item(), vpred_mean, rel_tol=1e-9)
    assert not metrics["vpred_mean"].requires_grad
    if c == 10.0:
        assert metrics["vf_clipfrac"].item() == 0.0


def test_value_loss_global_normalisation():
    vpreds, returns, values, mask = _inputs(1)
    whole, _ = compute_value_loss(vpreds, returns, values, mask, 0.5)
    n = mask.sum().item()
    parts = sum(
        compute_value_loss(vpreds[s], returns[s], values[s], mask[s], 0.5, agg_kwargs={"global_num_tokens": n, "dp_size": 1})[0]
        for s in (slice(0, 1), slice(1, 4))
    )
    torch.testing.assert_close(parts, whole)


def test_the_critics_loss_divides_by_its_loss_scale_factor():
    """critic.loss_scale_factor: the constant of seq-mean-token-sum-norm (the padded length T
    without it), as the actor's loss_scale_factor is for the policy loss."""
    from omegaconf import OmegaConf

    from hybrid_rl.workers.critic import critic_loss

    vpreds, returns, values, mask = _inputs(2)
    agg = {"global_num_tokens": float(mask.sum()), "global_num_seqs": float((mask.sum(-1) > 0).sum()), "dp_size": 1}
    losses = {}
    for factor in (None, 3.0):
        cfg = OmegaConf.create({"cliprange_value": 0.5, "loss_agg_mode": "seq-mean-token-sum-norm",
                                "loss_scale_factor": factor})
        losses[factor], _ = critic_loss(cfg)({"values": vpreds}, {"returns": returns, "values": values,
                                                                  "response_mask": mask}, agg)
    torch.testing.assert_close(losses[3.0], losses[None] * vpreds.shape[1] / 3.0)
