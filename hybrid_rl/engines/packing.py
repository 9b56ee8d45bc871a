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

Rows of units are padded to the longest unit; with `flat` the model itself runs on one row of
real tokens and only attention sees the padded rows (the attention function gathers its inputs
into them through `grid_tokens` and its output back through `token_slots`: see
`hf_model._sdpa_in_float32`), so the linear layers, norms and activations skip the padding.

`head_log_probs` then computes the response tokens' log-probs and entropies from the final
hidden states in chunks of positions, so no (tokens x vocab) float32 logits tensor is built for
the micro-batch; backward recomputes each chunk's log-softmax, except for those a CPU forward
kept within its budget.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (R, L) real tokens, right-padded to the longest row; (1, N) when flat
    position_ids: torch.Tensor  # the same shape
    attention_mask: torch.Tensor | None  # (R, 1, L, L) bool, or None for varlen kernels (R = 1)
    keep: torch.Tensor  # (K,) flat positions of input_ids whose hidden state predicts a response token
    targets: torch.Tensor  # (K,) the response token each of them predicts
    rows: torch.Tensor  # (K,) where that prediction belongs in the (B, T) response grid
    cols: torch.Tensor  # (K,)
    own: torch.Tensor  # (K,) flat positions of the response tokens themselves (for per-token scores)
    num_tokens: int  # real tokens, padding excluded
    slots: torch.Tensor  # (B, prompt_len + T): each real token's position in input_ids flattened, -1 at padding
    # With `flat`: the token each slot of the R x L attention grid holds (padding: any token,
    # masked to attend only to itself), and the grid slot of each of the N tokens.
    grid_tokens: torch.Tensor | None = None  # (R * L,)
    token_slots: torch.Tensor | None = None  # (N,)


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
    spans: list[tuple[torch.Tensor, torch.Tensor]]  # (flat micro-batch positions, offsets in the unit)


def _units(ids: torch.Tensor, real: torch.Tensor, prompt_len: int, share_prompts: bool,
           routes: torch.Tensor | None) -> list[_Unit]:
    groups: dict[object, list[int]] = {}
    width = ids.shape[1]
    for b in range(ids.shape[0]):
        key = b
        if share_prompts:
            key = tuple(ids[b, :prompt_len][real[b, :prompt_len]].tolist())
            if routes is not None:  # one copy of a prompt runs one set of experts
                key = (key, routes[b, :prompt_len][real[b, :prompt_len]].numpy().tobytes())
        groups.setdefault(key, []).append(b)
    units = []
    for members in groups.values():
        prompt = ids[members[0], :prompt_len][real[members[0], :prompt_len]]
        p = len(prompt)
        unit = _Unit([prompt], [torch.arange(p)], [0] * p, [], [], [], [], [], [])
        offset = p
        for b in members:
            # Every member's prompt tokens are the unit's one copy.
            unit.spans.append((b * width + real[b, :prompt_len].nonzero().flatten(), torch.arange(p)))
            response = ids[b, prompt_len:][real[b, prompt_len:]]
            r = len(response)
            if r == 0:
                continue
            unit.spans.append((b * width + prompt_len + torch.arange(r), torch.arange(offset, offset + r)))
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
              share_prompts: bool, dense_mask: bool, flat: bool = False,
              routes: torch.Tensor | None = None) -> PackedRows:
    """Pack (B, prompt_len + T) padded rows into rows of real tokens (see the module doc).

    Rows whose prompt tokens are identical share one prompt copy when `share_prompts` (needs
    `dense_mask`), and with a route table `routes` (router replay) also their prompts' experts;
    an empty response contributes no predictions. With a dense mask, units (a
    prompt and its responses) are placed first-fit into rows as long as the longest unit, because
    the mask makes attention cost grow with the square of a row's length; a varlen kernel gets
    everything in one row. `flat` (with a dense mask) lays the tokens out as one row without
    padding and maps them to the rows of the mask (`grid_tokens`, `token_slots`).
    """
    if share_prompts and not dense_mask:
        raise ValueError("Sharing prompts between responses needs a dense attention mask (SDPA).")
    device = input_ids.device
    units = _units(input_ids.cpu(), attention_mask.cpu().bool(), prompt_len, share_prompts,
                   None if routes is None else routes.cpu())
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
    slots = torch.full((input_ids.numel(),), -1, dtype=torch.long)
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
            for places, offsets in unit.spans:
                slots[places] = r * width + offset + offsets
            offset += n

    mask = grid_tokens = token_slots = None
    keep, own = torch.as_tensor(keep, dtype=torch.long), torch.as_tensor(own, dtype=torch.long)
    if dense_mask:
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same_segment = segment[:, :, None] == segment[:, None, :]
        own_prompt = (unit_of[:, :, None] == unit_of[:, None, :]) & is_prompt[:, None, :]
        mask = (causal & (same_segment | own_prompt))[:, None].to(device)
        if flat:
            real = (unit_of >= 0).flatten()
            token_slots = real.nonzero().flatten()
            grid_tokens = (real.cumsum(0) - 1).clamp(min=0)
            input_ids_out = input_ids_out.flatten()[token_slots][None]
            positions = positions.flatten()[token_slots][None]
            keep, own = grid_tokens[keep], grid_tokens[own]
            slots = torch.where(slots >= 0, grid_tokens[slots.clamp(min=0)], -1)
            grid_tokens, token_slots = grid_tokens.to(device), token_slots.to(device)
    as_long = lambda values: torch.as_tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedRows(
        input_ids=input_ids_out.to(device), position_ids=positions.to(device), attention_mask=mask,
        keep=keep.to(device), targets=torch.cat(targets).to(device) if targets else as_long([]),
        rows=as_long(out_rows), cols=as_long(out_cols), own=own.to(device), num_tokens=sum(lengths),
        slots=slots.view(input_ids.shape).to(device),
        grid_tokens=grid_tokens, token_slots=token_slots)


def unpack(values: torch.Tensor, packed: PackedRows, shape: tuple[int, ...]) -> torch.Tensor:
    """Scatter per-prediction values (K, ...) into a zero (B, T, ...) grid."""
    out = values.new_zeros(shape + values.shape[1:])
    out[packed.rows, packed.cols] = values
    return out


class _HeadLogProbs(torch.autograd.Function):
    """log p(target) and (optionally) entropy of softmax(h W^T / tau), chunk by chunk over
    positions.

    With z = h W^T / tau, log p = log_softmax(z) and H = -sum_v p_v log p_v:
        d log p_y / dz = onehot(y) - p,        dH / dz = -p * (log p + H),
    and dz flows to h (dz W / tau) and W (dz^T h / tau). Backward needs each chunk's log-softmax:
    on CPU a forward that will be differentiated keeps them, up to `KEPT_LOG_SOFTMAX_BYTES`
    (SmolLM2's head: 48 MiB per chunk of 256 positions), and backward computes
    the rest again from the logits, as it does on GPU, where memory is scarcer. Every chunk is
    written into the same few (chunk x vocab) buffers (`_ChunkBuffers`): on CPU a fresh tensor
    of that size costs more in page faults than the element-wise op that fills it. Without
    entropy (log-prob-only passes) the forward skips the pass over the vocabulary that entropy
    needs and returns zeros. With `sum_pi_squared` that pass gives Σ_v p_v² instead (for the
    optimal token baseline), a constant to backward.

    With `into_grad` the weight's gradient is added straight into a float32 `weight.grad` (as
    megatron's gradient-accumulation fusion does) and autograd gets None for it: no fresh
    (vocab x hidden) gradient per backward, and a tied input embedding can add its rows to it
    as a sparse gradient in place. `torch.autograd.grad` then sees no gradient for the weight.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, compute_dtype, with_entropy, into_grad,
                sum_pi_squared=False):
        log_probs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        entropy = torch.zeros_like(log_probs)
        w = weight.to(compute_dtype)
        buffers = _chunk_buffers(chunk_size, hidden.shape[0], w, compute_dtype)
        ctx.kept = buffers.start_keeping() if any(ctx.needs_input_grad[:2]) else None
        for chunk, start in enumerate(range(0, hidden.shape[0], chunk_size)):
            end = start + chunk_size
            log_p = buffers.log_softmax(hidden[start:end], w, temperature, keep_as=chunk if ctx.kept else None)
            log_probs[start:end] = log_p.gather(-1, targets[start:end, None]).squeeze(-1)
            if sum_pi_squared:
                p = torch.exp(log_p, out=buffers.probs[:len(log_p)])
                entropy[start:end] = p.mul_(p).sum(-1)
            elif with_entropy:
                p = torch.exp(log_p, out=buffers.probs[:len(log_p)])
                entropy[start:end] = -p.mul_(log_p).sum(-1)
        # The cast weight is kept for backward rather than cast again (one head's worth of memory).
        ctx.save_for_backward(hidden, w, targets, entropy)
        ctx.weight_dtype = weight.dtype
        ctx.grad_owner = weight if into_grad and weight.is_leaf and weight.dtype == torch.float32 else None
        ctx.temperature, ctx.chunk_size, ctx.compute_dtype = temperature, chunk_size, compute_dtype
        ctx.with_entropy = with_entropy and not sum_pi_squared
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, w, targets, entropy = ctx.saved_tensors
        tau, dtype = ctx.temperature, ctx.compute_dtype
        if not ctx.with_entropy:
            grad_entropy = None  # the zeros returned are constants
        # dz/dh and dz/dW carry 1/tau: fold it into the per-position coefficients.
        g = (grad_log_probs / tau) if grad_log_probs is not None else torch.zeros_like(entropy)
        ge = grad_entropy / tau if grad_entropy is not None else None
        grad_hidden = hidden.new_empty(hidden.shape, dtype=dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None  # float32, summed over chunks
        if ctx.needs_input_grad[1]:
            owner = ctx.grad_owner
            if owner is not None and owner.grad is None:
                owner.grad = torch.zeros_like(owner)
            grad_weight = owner.grad if owner is not None else w.new_zeros(w.shape, dtype=torch.float32)
        buffers = _chunk_buffers(ctx.chunk_size, hidden.shape[0], w, dtype)
        for chunk, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            end = start + ctx.chunk_size
            h = hidden[start:end].to(dtype)
            log_p = buffers.kept_log_softmax(ctx.kept, chunk, len(h))
            if log_p is None:
                log_p = buffers.log_softmax(h, w, tau)
            grad_z = torch.exp(log_p, out=buffers.probs[:len(log_p)])
            # grad_z = onehot(y) g - p (g + ge (log p + H)): the bracket is built in log_p's buffer.
            if ge is None:
                grad_z.mul_(-g[start:end, None])
            else:
                offset = -(g[start:end] + ge[start:end] * entropy[start:end])
                grad_z.mul_(torch.addcmul(offset[:, None], log_p, -ge[start:end, None], out=log_p))
            grad_z.scatter_add_(-1, targets[start:end, None], g[start:end, None])
            grad_z = buffers.in_compute_dtype(grad_z)
            if grad_hidden is not None:
                torch.mm(grad_z, w, out=grad_hidden[start:end])
            if ctx.needs_input_grad[1]:
                buffers.add_into(grad_weight, torch.mm(grad_z.T, h, out=buffers.weight_part))
        buffers.stop_keeping(ctx.kept)  # backward wrote over them
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if ctx.grad_owner is not None:
            grad_weight = None  # already added to the weight's .grad
        elif grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


KEPT_LOG_SOFTMAX_BYTES = 512 * 2**20  # per process, on CPU


class _ChunkBuffers:
    """The (chunk x vocab) tensors a head pass writes (and the weight gradient of one chunk), and
    on CPU the chunks' log-softmax kept from a forward for its backward. They belong to one
    forward at a time: a backward whose forward was followed by another one, or that runs a
    second time, computes them again."""

    def __init__(self, rows: int, vocab: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 keep_bytes: int = 0):
        self.dtype = dtype
        self.logits = torch.empty(rows, vocab, dtype=dtype, device=device)  # in the compute dtype
        self.float_logits = None if dtype == torch.float32 else torch.empty_like(self.logits, dtype=torch.float32)
        self.log_probs = torch.empty_like(self.logits, dtype=torch.float32)
        self.probs = torch.empty_like(self.log_probs)
        self.hidden_size = hidden_size
        self._weight_part = None
        self.max_kept = keep_bytes // self.log_probs.nbytes
        self._kept: list[torch.Tensor] = []  # allocated as forwards first need them, then reused
        self._kept_for: object | None = None  # the forward they hold

    def start_keeping(self) -> object | None:
        """Claim the kept chunks for a new forward; a token for its backward (None: none kept)."""
        self._kept_for = object() if self.max_kept else None
        return self._kept_for

    def stop_keeping(self, token: object | None) -> None:
        if token is not None and token is self._kept_for:
            self._kept_for = None

    def kept_log_softmax(self, token: object | None, chunk: int, rows: int) -> torch.Tensor | None:
        """The log-softmax the forward of `token` kept for `chunk`, or None (compute it again)."""
        if token is None or token is not self._kept_for or chunk >= self.max_kept:
            return None
        return self._kept[chunk][:rows]

    @property
    def weight_part(self) -> torch.Tensor:
        """One chunk's weight gradient (allocated by the first pass that trains the head)."""
        if self._weight_part is None:
            self._weight_part = self.logits.new_empty(self.logits.shape[1], self.hidden_size)
        return self._weight_part

    def log_softmax(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float,
                    keep_as: int | None = None) -> torch.Tensor:
        """log_softmax(h W^T / tau) in float32 for a chunk's hidden states; written into the kept
        buffer of chunk `keep_as` while the budget allows (see `start_keeping`)."""
        rows = hidden.shape[0]
        logits = torch.mm(hidden.to(self.dtype), weight.T, out=self.logits[:rows])
        z = logits if self.float_logits is None else self.float_logits[:rows].copy_(logits)
        if temperature != 1.0:
            z.div_(temperature)
        out = self.log_probs
        if keep_as is not None and keep_as < self.max_kept:
            if keep_as == len(self._kept):
                self._kept.append(torch.empty_like(self.log_probs))
            out = self._kept[keep_as]
        # aten's out= form of log_softmax: the public one allocates.
        return torch._log_softmax(z, -1, False, out=out[:rows])

    def add_into(self, total: torch.Tensor, part: torch.Tensor) -> None:
        """total += part, a float32 total and a weight gradient part in the compute dtype. On CPU
        an add across dtypes allocates a float32 copy of `part` (page faults again), so the part
        goes through the float32 probs buffer, block by block of vocabulary rows."""
        if part.dtype == total.dtype or part.device.type != "cpu":
            total.add_(part)
            return
        staging = self.probs.view(-1)
        rows = staging.numel() // part.shape[1]
        for start in range(0, part.shape[0], rows):
            block = part[start:start + rows]
            total[start:start + rows].add_(staging[:block.numel()].view(block.shape).copy_(block))

    def in_compute_dtype(self, values: torch.Tensor) -> torch.Tensor:
        """float32 chunk values in the compute dtype, in the logits buffer (free by then)."""
        if values.dtype == self.dtype:
            return values
        return self.logits[:values.shape[0]].copy_(values)


@functools.lru_cache(maxsize=1)
def _cached_chunk_buffers(rows: int, vocab: int, hidden_size: int, dtype: torch.dtype,
                          device: torch.device) -> _ChunkBuffers:
    return _ChunkBuffers(rows, vocab, hidden_size, dtype, device, keep_bytes=KEPT_LOG_SOFTMAX_BYTES)


def _chunk_buffers(chunk_size: int, positions: int, weight: torch.Tensor, dtype: torch.dtype) -> _ChunkBuffers:
    """On CPU one set of buffers per process, kept from pass to pass (the actor's and the
    reference's passes share it): each fresh tensor of this size would be paid again in page
    faults. CUDA's caching allocator reuses memory by itself, so there they live for one pass,
    no larger than its `positions` need."""
    if weight.device.type != "cpu":
        return _ChunkBuffers(min(chunk_size, positions), *weight.shape, dtype, weight.device)
    return _cached_chunk_buffers(chunk_size, *weight.shape, dtype, weight.device)


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                   chunk_size: int, compute_dtype: torch.dtype | None = None,
                   with_entropy: bool = True, into_grad: bool = False,
                   sum_pi_squared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` and entropies under the LM head `weight` for hidden states (..., H)
    with targets (...); both float32 of the targets' shape (entropies zero unless `with_entropy`;
    with `sum_pi_squared` the second is Σ_v π_v² instead, not differentiated). `into_grad`: a
    float32 leaf `weight` gets its gradient added to `weight.grad` directly (see `_HeadLogProbs`)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    dtype = compute_dtype or hidden.dtype
    log_probs, entropy = _HeadLogProbs.apply(flat, weight, targets.reshape(-1), temperature, chunk_size, dtype,
                                             with_entropy, into_grad, sum_pi_squared)
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
