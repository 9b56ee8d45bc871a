"""Padding-free forward passes over rollout micro-batches.

A micro-batch arrives as rows of [left-padded prompt | right-padded response]. `pack_rows` turns
it into a single row holding only real tokens. With a dense attention mask (SDPA, the CPU path),
the n responses sampled from one prompt share a single copy of that prompt: each response
attends to the prompt and to itself, with positions continuing after the prompt, which is exactly
the attention it gets in its own padded row, so the prompt is computed once per group instead of
n times. With a varlen kernel (flash-attention on GPU) sequence boundaries come from the
position ids alone, so each response keeps its own copy of the prompt.

`head_log_probs` then computes the response tokens' log-probs and entropies from the final
hidden states in chunks of positions, recomputing each chunk's logits in the backward pass, so
no (tokens x vocab) float32 logits tensor is kept for the micro-batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # (1, N) real tokens only
    position_ids: torch.Tensor  # (1, N)
    attention_mask: torch.Tensor | None  # (1, 1, N, N) bool, or None for varlen kernels
    keep: torch.Tensor  # (K,) positions whose hidden state predicts a response token
    targets: torch.Tensor  # (K,) the response token each of them predicts
    rows: torch.Tensor  # (K,) where that prediction belongs in the (B, T) response grid
    cols: torch.Tensor  # (K,)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
              share_prompts: bool, dense_mask: bool) -> PackedRow:
    """Pack (B, prompt_len + T) padded rows into one row of real tokens (see the module doc).

    Rows whose prompt tokens are identical share one prompt copy when `share_prompts` (needs
    `dense_mask`); an empty response contributes no predictions.
    """
    if share_prompts and not dense_mask:
        raise ValueError("Sharing prompts between responses needs a dense attention mask (SDPA).")
    device = input_ids.device
    ids, real = input_ids.cpu(), attention_mask.cpu().bool()
    groups: dict[object, list[int]] = {}
    for b in range(ids.shape[0]):
        key = tuple(ids[b, :prompt_len][real[b, :prompt_len]].tolist()) if share_prompts else b
        groups.setdefault(key, []).append(b)

    tokens, positions, segment, group_of, is_prompt = [], [], [], [], []
    keep, targets, rows, cols = [], [], [], []
    offset = segment_id = 0
    for g, members in enumerate(groups.values()):
        prompt = ids[members[0], :prompt_len][real[members[0], :prompt_len]]
        p = len(prompt)
        tokens.append(prompt)
        positions.append(torch.arange(p))
        segment += [segment_id] * p
        group_of += [g] * p
        is_prompt += [True] * p
        last_prompt = offset + p - 1
        offset += p
        segment_id += 1
        for b in members:
            response = ids[b, prompt_len:][real[b, prompt_len:]]
            r = len(response)
            if r == 0:
                continue
            tokens.append(response)
            positions.append(torch.arange(p, p + r))
            segment += [segment_id] * r
            segment_id += 1
            group_of += [g] * r
            is_prompt += [False] * r
            # Token t is predicted by the state before it: the prompt's last token, then the response's own.
            keep += [last_prompt, *range(offset, offset + r - 1)]
            targets.append(response)
            rows += [b] * r
            cols += range(r)
            offset += r

    mask = None
    if dense_mask:
        seg = torch.tensor(segment)
        grp = torch.tensor(group_of)
        pos = torch.arange(offset)
        causal = pos[None, :] <= pos[:, None]
        shared_prompt = (grp[:, None] == grp[None, :]) & torch.tensor(is_prompt)[None, :]
        mask = (causal & ((seg[:, None] == seg[None, :]) | shared_prompt))[None, None].to(device)
    as_long = lambda values: torch.as_tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedRow(
        input_ids=torch.cat(tokens)[None].to(device), position_ids=torch.cat(positions)[None].to(device),
        attention_mask=mask, keep=as_long(keep),
        targets=torch.cat(targets).to(device) if targets else as_long([]),
        rows=as_long(rows), cols=as_long(cols))


def unpack(values: torch.Tensor, packed: PackedRow, shape: tuple[int, ...]) -> torch.Tensor:
    """Scatter per-prediction values (K, ...) into a zero (B, T, ...) grid."""
    out = values.new_zeros(shape + values.shape[1:])
    out[packed.rows, packed.cols] = values
    return out


class _HeadLogProbs(torch.autograd.Function):
    """log p(target) and entropy of softmax(h W^T / tau), chunk by chunk over positions.

    With z = h W^T / tau, p = softmax(z) and H = logsumexp(z) - sum_v p_v z_v:
        d log p_y / dz = onehot(y) - p,        dH / dz = -p * (z - sum_v p_v z_v),
    and dz flows to h (dz W / tau) and W (dz^T h / tau). Only logsumexp per position is saved;
    each chunk's logits are recomputed in backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, compute_dtype):
        log_probs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        entropy = torch.empty_like(log_probs)
        lse = torch.empty_like(log_probs)
        w = weight.to(compute_dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            z = (hidden[start:end].to(compute_dtype) @ w.T).float() / temperature
            lse[start:end] = torch.logsumexp(z, dim=-1)
            log_p = z - lse[start:end, None]
            log_probs[start:end] = log_p.gather(-1, targets[start:end, None]).squeeze(-1)
            # -sum p log p rather than lse - sum p z: no cancellation between two large terms.
            entropy[start:end] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.compute_dtype = temperature, chunk_size, compute_dtype
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        tau, dtype = ctx.temperature, ctx.compute_dtype
        w = weight.to(dtype)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end].to(dtype)
            z = (h @ w.T).float() / tau
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
            if grad_weight is not None:
                grad_weight += (grad_z.T @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                   chunk_size: int, compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` and entropies under the LM head `weight` for hidden states (..., H)
    with targets (...); both float32 of the targets' shape."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    dtype = compute_dtype or hidden.dtype
    log_probs, entropy = _HeadLogProbs.apply(flat, weight, targets.reshape(-1), temperature, chunk_size, dtype)
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
