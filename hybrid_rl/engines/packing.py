"""Padding-free forward passes over rollout micro-batches.

A micro-batch arrives as rows of [left-padded prompt | right-padded response]. `pack_rows` turns
it into rows holding only real tokens. With a dense attention mask (SDPA, the CPU path), the n
responses sampled from one prompt share a single copy of that prompt: each response attends to
the prompt and to itself, with positions continuing after the prompt, which is exactly the
attention it gets in its own padded row, so the prompt is computed once per group instead of n
times. Such units (a prompt and its responses) are spread over several short rows, since a dense
mask costs the square of a row's length. With a varlen kernel (flash-attention on GPU) sequence
boundaries come from the position ids alone, so everything goes into one row and each response
keeps its own copy of the prompt.

`head_log_probs` then computes the response tokens' log-probs and entropies from the final
hidden states in chunks of positions, recomputing each chunk's logits in the backward pass, so
no (tokens x vocab) float32 logits tensor is kept for the micro-batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (R, L) real tokens, right-padded to the longest row
    position_ids: torch.Tensor  # (R, L)
    attention_mask: torch.Tensor | None  # (R, 1, L, L) bool, or None for varlen kernels (R = 1)
    keep: torch.Tensor  # (K,) flat positions in the R x L grid whose hidden state predicts a response token
    targets: torch.Tensor  # (K,) the response token each of them predicts
    rows: torch.Tensor  # (K,) where that prediction belongs in the (B, T) response grid
    cols: torch.Tensor  # (K,)
    own: torch.Tensor  # (K,) flat positions of the response tokens themselves (for per-token scores)
    num_tokens: int  # real tokens, padding excluded


@dataclass
class _Unit:
    """A prompt and the responses packed after it (one response, or a whole group when shared)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    segment: list[int]  # 0 for the prompt, 1, 2, ... for each response
    keep: list[int]  # offsets within the unit
    own: list[int]
    targets: list[torch.Tensor]
    rows: list[int]
    cols: list[int]


def _units(ids: torch.Tensor, real: torch.Tensor, prompt_len: int, share_prompts: bool) -> list[_Unit]:
    groups: dict[object, list[int]] = {}
    for b in range(ids.shape[0]):
        key = tuple(ids[b, :prompt_len][real[b, :prompt_len]].tolist()) if share_prompts else b
        groups.setdefault(key, []).append(b)
    units = []
    for members in groups.values():
        prompt = ids[members[0], :prompt_len][real[members[0], :prompt_len]]
        p = len(prompt)
        unit = _Unit([prompt], [torch.arange(p)], [0] * p, [], [], [], [], [])
        offset = p
        for b in members:
            response = ids[b, prompt_len:][real[b, prompt_len:]]
            r = len(response)
            if r == 0:
                continue
            unit.tokens.append(response)
            unit.positions.append(torch.arange(p, p + r))
            unit.segment += [len(unit.targets) + 1] * r
            # Token t is predicted by the state before it: the prompt's last token, then the response's own.
            unit.keep += [p - 1, *range(offset, offset + r - 1)]
            unit.own += range(offset, offset + r)
            unit.targets.append(response)
            unit.rows += [b] * r
            unit.cols += range(r)
            offset += r
        unit.tokens, unit.positions = torch.cat(unit.tokens), torch.cat(unit.positions)
        units.append(unit)
    return units


def _rows_first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Unit indices per row: first-fit decreasing into rows of `capacity` tokens."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((r for r, load in enumerate(loads) if load + lengths[i] <= capacity), None)
        if fit is None:
            rows.append([i])
            loads.append(lengths[i])
        else:
            rows[fit].append(i)
            loads[fit] += lengths[i]
    return rows


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
              share_prompts: bool, dense_mask: bool) -> PackedRows:
    """Pack (B, prompt_len + T) padded rows into rows of real tokens (see the module doc).

    Rows whose prompt tokens are identical share one prompt copy when `share_prompts` (needs
    `dense_mask`); an empty response contributes no predictions. With a dense mask, units (a
    prompt and its responses) are placed first-fit into rows as long as the longest unit, because
    the mask makes attention cost grow with the square of a row's length; a varlen kernel gets
    everything in one row.
    """
    if share_prompts and not dense_mask:
        raise ValueError("Sharing prompts between responses needs a dense attention mask (SDPA).")
    device = input_ids.device
    units = _units(input_ids.cpu(), attention_mask.cpu().bool(), prompt_len, share_prompts)
    lengths = [len(u.tokens) for u in units]
    rows = _rows_first_fit(lengths, max(lengths)) if dense_mask else [list(range(len(units)))]
    width = max(sum(lengths[i] for i in row) for row in rows)

    input_ids_out = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    # Per token: a segment id unique in its row (each padding token gets its own, so that it
    # attends to itself and stays finite), its unit, and whether it is a prompt token.
    segment = -1 - torch.arange(width).repeat(len(rows), 1)
    unit_of = segment.clone()
    is_prompt = torch.zeros(len(rows), width, dtype=torch.bool)
    keep, own, targets, out_rows, out_cols = [], [], [], [], []
    for r, members in enumerate(rows):
        offset = 0
        for i in members:
            unit, n = units[i], lengths[i]
            span = slice(offset, offset + n)
            input_ids_out[r, span] = unit.tokens
            positions[r, span] = unit.positions
            segment[r, span] = torch.tensor(unit.segment) + 2 * width * i
            unit_of[r, span] = i
            is_prompt[r, span] = torch.tensor(unit.segment) == 0
            keep += [r * width + offset + k for k in unit.keep]
            own += [r * width + offset + k for k in unit.own]
            targets += unit.targets
            out_rows += unit.rows
            out_cols += unit.cols
            offset += n

    mask = None
    if dense_mask:
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same_segment = segment[:, :, None] == segment[:, None, :]
        own_prompt = (unit_of[:, :, None] == unit_of[:, None, :]) & is_prompt[:, None, :]
        mask = (causal & (same_segment | own_prompt))[:, None].to(device)
    as_long = lambda values: torch.as_tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedRows(
        input_ids=input_ids_out.to(device), position_ids=positions.to(device), attention_mask=mask,
        keep=as_long(keep), targets=torch.cat(targets).to(device) if targets else as_long([]),
        rows=as_long(out_rows), cols=as_long(out_cols), own=as_long(own), num_tokens=sum(lengths))


def unpack(values: torch.Tensor, packed: PackedRows, shape: tuple[int, ...]) -> torch.Tensor:
    """Scatter per-prediction values (K, ...) into a zero (B, T, ...) grid."""
    out = values.new_zeros(shape + values.shape[1:])
    out[packed.rows, packed.cols] = values
    return out


class _HeadLogProbs(torch.autograd.Function):
    """log p(target) and (optionally) entropy of softmax(h W^T / tau), chunk by chunk over
    positions.

    With z = h W^T / tau, p = softmax(z) and H = logsumexp(z) - sum_v p_v z_v:
        d log p_y / dz = onehot(y) - p,        dH / dz = -p * (z - sum_v p_v z_v),
    and dz flows to h (dz W / tau) and W (dz^T h / tau). Only logsumexp per position is saved;
    each chunk's logits are recomputed in backward. Without entropy (log-prob-only passes) the
    forward skips the pass over the vocabulary that entropy needs and returns zeros.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, compute_dtype, with_entropy):
        log_probs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        entropy = torch.zeros_like(log_probs)
        lse = torch.empty_like(log_probs)
        w = weight.to(compute_dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            z = _chunk_logits(hidden[start:end], w, compute_dtype, temperature)
            lse[start:end] = torch.logsumexp(z, dim=-1)
            log_p = z.sub_(lse[start:end, None])  # z is a fresh float32 tensor: reuse it
            log_probs[start:end] = log_p.gather(-1, targets[start:end, None]).squeeze(-1)
            if with_entropy:
                # -sum p log p rather than lse - sum p z: no cancellation between two large terms.
                entropy[start:end] = -(log_p.exp() * log_p).sum(-1)
        # The cast weight is kept for backward rather than cast again (one head's worth of memory).
        ctx.save_for_backward(hidden, w, targets, lse, entropy)
        ctx.weight_dtype = weight.dtype
        ctx.temperature, ctx.chunk_size, ctx.compute_dtype = temperature, chunk_size, compute_dtype
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, w, targets, lse, entropy = ctx.saved_tensors
        tau, dtype = ctx.temperature, ctx.compute_dtype
        if not ctx.with_entropy:
            grad_entropy = None  # the zeros returned are constants
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None  # accumulated in float32 over chunks
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end].to(dtype)
            z = _chunk_logits(h, w, dtype, tau)
            p = torch.exp(z - lse[start:end, None])
            grad_z = torch.zeros_like(z)
            if grad_log_probs is not None:
                g = grad_log_probs[start:end]
                grad_z -= p * g[:, None]
                grad_z.scatter_add_(-1, targets[start:end, None], g[:, None])
            if grad_entropy is not None:
                mean_z = (lse[start:end] - entropy[start:end])[:, None]  # sum_v p_v z_v
                grad_z -= p * (z - mean_z) * grad_entropy[start:end, None]
            grad_z = (grad_z / tau).to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_z @ w).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                part = grad_z.T @ h
                grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    z = (hidden.to(dtype) @ weight.T).float()
    return z.div_(temperature) if temperature != 1.0 else z


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                   chunk_size: int, compute_dtype: torch.dtype | None = None,
                   with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` and entropies under the LM head `weight` for hidden states (..., H)
    with targets (...); both float32 of the targets' shape (entropies zero unless `with_entropy`)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    dtype = compute_dtype or hidden.dtype
    log_probs, entropy = _HeadLogProbs.apply(flat, weight, targets.reshape(-1), temperature, chunk_size, dtype,
                                             with_entropy)
    return log_probs.view(targets.shape), entropy.view(targets.shape)


@contextmanager
def replaced_head(head: torch.nn.Module, head_fn):
    """Within the block the model's output-embedding module `head` computes `head_fn(hidden)`
    instead of logits. The module itself (and so parameter names, FSDP units and tied weights) is
    unchanged; the call still happens inside the model's forward, where FSDP has gathered the
    head weight."""
    head.forward = head_fn
    try:
        yield
    finally:
        del head.forward
