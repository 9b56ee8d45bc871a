import math

import pytest
import torch

from hybrid_rl.algorithms import LOSS_AGG_MODES, aggregate_loss

MODES = sorted(LOSS_AGG_MODES.names())


def _reference(loss, mask, mode, scale=None):
    """Whole-batch loss with plain loops (float64)."""
    rows = [[(v, m) for v, m in zip(lr, mr)] for lr, mr in zip(loss.tolist(), mask.tolist())]
    nonempty = [row for row in rows if sum(m for _, m in row) > 0]
    n_seq = max(len(nonempty), 1)
    if mode == "token-mean":
        return math.fsum(v * m for row in rows for v, m in row) / max(sum(m for row in rows for _, m in row), 1)
    if mode == "seq-mean-token-sum":
        return math.fsum(v * m for row in nonempty for v, m in row) / n_seq
    if mode == "seq-mean-token-mean":
        return math.fsum(math.fsum(v * m for v, m in row) / sum(m for _, m in row) for row in nonempty) / n_seq
    if mode == "seq-mean-token-sum-norm":
        c = scale if scale is not None else loss.shape[-1]
        return math.fsum(v * m for row in nonempty for v, m in row) / (c * n_seq)
    raise AssertionError(mode)


def _data(seed, batch=8, length=6):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=g) < 0.6).double()
    mask[3] = 0  # an empty sequence
    return loss, mask


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(mode):
    loss, mask = _data(0)
    got = aggregate_loss(loss, mask, mode)
    assert math.isclose(got.item(), _reference(loss, mask, mode), rel_tol=1e-12)
    if mode == "seq-mean-token-sum-norm":
        got = aggregate_loss(loss, mask, mode, loss_scale_factor=100.0)
        assert math.isclose(got.item(), _reference(loss, mask, mode, scale=100.0), rel_tol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_split_over_ranks_and_micro_batches_is_exact(mode):
    """1 rank × 1 micro-batch == 2 ranks × 2 micro-batches (grads averaged over ranks): loss and gradient."""
    loss_base, mask = _data(1)
    # uneven token counts per shard, and one shard fully masked
    mask[6:8] = 0
    mask[6, 0] = 1
    mask[7] = 0
    weight = torch.randn_like(loss_base, requires_grad=True)

    full = aggregate_loss(loss_base * weight, mask, mode, loss_scale_factor=5.0)
    (full_grad,) = torch.autograd.grad(full, weight)

    dp_size, shards = 2, [slice(0, 3), slice(3, 4), slice(4, 7), slice(7, 8)]  # rank0: 0,1; rank1: 2,3
    global_tokens = mask.sum()
    global_seqs = int((mask.sum(-1) > 0).sum())
    rank_losses, rank_grads = [], []
    for rank in range(dp_size):
        rank_loss = sum(
            aggregate_loss(
                (loss_base * weight)[s],
                mask[s],
                mode,
                global_num_tokens=global_tokens,
                global_num_seqs=global_seqs,
                dp_size=dp_size,
                loss_scale_factor=5.0,
            )
            for s in shards[2 * rank : 2 * rank + 2]
        )
        rank_losses.append(rank_loss.detach())
        rank_grads.append(torch.autograd.grad(rank_loss, weight)[0])
    torch.testing.assert_close(sum(rank_losses) / dp_size, full.detach())
    torch.testing.assert_close(sum(rank_grads) / dp_size, full_grad)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("global_counts", [False, True])
def test_all_masked_call_is_finite_zero_with_grad(mode, global_counts):
    loss = torch.full((2, 3), float("nan")).requires_grad_()
    kwargs = {"global_num_tokens": 10, "global_num_seqs": 4, "dp_size": 2} if global_counts else {}
    out = aggregate_loss(loss, torch.zeros(2, 3), mode, **kwargs)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 3))


def test_global_counts_as_tensors_and_bool_mask():
    loss, mask = _data(2)
    out = aggregate_loss(loss, mask.bool(), "token-mean", global_num_tokens=torch.tensor(50), dp_size=4)
    torch.testing.assert_close(out, (loss * mask).sum() / 50 * 4)
