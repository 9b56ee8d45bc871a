"""Reduction of a per-token loss matrix to the scalar a micro-batch backpropagates.

Exact global normalisation: a mini-batch is split over micro-batches and ``dp_size`` data-parallel
ranks. Each rank sums its micro-batch losses and the gradients are then *averaged* over ranks. If
every call divides by the mini-batch-wide count (``global_num_tokens`` / ``global_num_seqs``) and
multiplies by ``dp_size`` (undoing the rank average), the accumulated gradient equals that of the
loss over the whole mini-batch, however it is split. Without the global counts the call normalises
by its own counts, i.e. it is exact for a single call. Denominators are clamped at 1, so an
all-masked call gives 0 (with a graph) instead of verl's NaN.
"""

from __future__ import annotations

import torch

from .functional import masked_sum
from .registry import Registry

LOSS_AGG_MODES = Registry("loss aggregation mode")


def _count(n: int | float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(n, dtype=like.dtype, device=like.device).clamp_min(1)


def _num_seqs(loss_mat: torch.Tensor, mask: torch.Tensor, global_num_seqs) -> torch.Tensor:
    """N_seq: the given global count, else the number of sequences with at least one loss token."""
    local = (mask.sum(-1) > 0).sum()
    return _count(local if global_num_seqs is None else global_num_seqs, loss_mat)


@LOSS_AGG_MODES.register("token-mean")
def _token_mean(loss_mat, mask, *, global_num_tokens, global_num_seqs, loss_scale_factor):
    """Σ_{i,t} L·m / N_tok, N_tok = global_num_tokens or Σ m."""
    num_tokens = mask.sum() if global_num_tokens is None else global_num_tokens
    return masked_sum(loss_mat, mask) / _count(num_tokens, loss_mat)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, *, global_num_tokens, global_num_seqs, loss_scale_factor):
    """Σ_i Σ_t L·m / N_seq."""
    return masked_sum(loss_mat, mask) / _num_seqs(loss_mat, mask, global_num_seqs)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, *, global_num_tokens, global_num_seqs, loss_scale_factor):
    """Σ_i [Σ_t L·m / Σ_t m] / N_seq; empty sequences contribute 0 and are not counted."""
    per_seq = masked_sum(loss_mat, mask, dim=-1) / mask.sum(-1).clamp_min(1)
    return per_seq.sum() / _num_seqs(loss_mat, mask, global_num_seqs)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, *, global_num_tokens, global_num_seqs, loss_scale_factor):
    """Dr. GRPO: Σ_i Σ_t L·m / (C·N_seq), C = loss_scale_factor or the padded length T.

    verl omits the 1/N_seq, which makes the loss scale with the micro-batch size.
    """
    constant = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return masked_sum(loss_mat, mask) / (_num_seqs(loss_mat, mask, global_num_seqs) * constant)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_num_tokens: int | torch.Tensor | None = None,
    global_num_seqs: int | torch.Tensor | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """This call's share of the mini-batch loss: mode-specific normalised sum × dp_size (see module doc).

    ``loss_mat`` and ``mask`` are (batch, response_len). Modes: see ``LOSS_AGG_MODES``.
    """
    reduce = LOSS_AGG_MODES.get(mode)
    local = reduce(
        loss_mat,
        mask,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return local * dp_size
