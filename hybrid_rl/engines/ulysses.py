"""Ulysses sequence parallelism for the FSDP engine (verl's `ulysses_sequence_parallel_size`).

The ranks of a sequence-parallel group share each micro-batch. Its padding-free row of N tokens
(`packing.pack_rows`: one row with flat packing on CPU or a varlen kernel on GPU) is padded to a
multiple of the group's size and cut into equal slices, one per rank, so the embeddings, linear
layers, norms, MLPs and LM head of each rank see only its slice. Attention needs every token:
an all-to-all around it trades the split (this rank's tokens, all heads) for (all tokens, this
rank's heads), and a second one trades it back (DeepSpeed-Ulysses). Heads are dealt out as evenly
as they go (SmolLM2's 9 over 2 ranks: 5 and 4); when query and key/value heads do not both divide
by the group, each key/value head is first repeated for the queries that read it, so every rank
holds the keys its queries need.

The per-token outputs (log-probs, values, scores) are all-gathered, so every rank of a group
computes the same loss on the whole micro-batch. The gather's backward sums the group's
gradients (each rank's loss counts once), and FSDP's mean over all ranks divides by the group's
size as well as by the data-parallel size: the gradient is exactly the one without sequence
parallelism.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as collectives
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@functools.cache
def sequence_parallel_mesh(device_type: str, size: int) -> DeviceMesh:
    """The (dp, sp) mesh of `size` consecutive ranks per sequence-parallel group, one per size and
    process (the actor, reference and critic share it when their sizes agree)."""
    world = dist.get_world_size()
    return init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "sp"))


def configured_size(role_cfg):
    """A role's group size: verl's `ulysses_sequence_parallel_size`, or (its newer place, read
    when the first is 1) `fsdp_config.ulysses_sequence_parallel_size`."""
    size = role_cfg.get("ulysses_sequence_parallel_size", 1)
    if size == 1:
        size = (role_cfg.get("fsdp_config") or {}).get("ulysses_sequence_parallel_size", 1)
    return size


def head_counts(heads: int, size: int) -> list[int]:
    """Heads per rank, as even as they go (the first ranks take one more)."""
    return [heads // size + (rank < heads % size) for rank in range(size)]


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group."""

    group: dist.ProcessGroup
    size: int
    rank: int

    def split(self, inputs: dict[str, torch.Tensor]) -> dict:
        """The model inputs of one padding-free row (`input_ids` and `position_ids` of shape
        (1, N)) as this rank runs them: its slice of the row padded to a multiple of the group
        size, and the `sequence_parallel` argument the attention function reads."""
        n = inputs["input_ids"].shape[1]
        local_len = -(-n // self.size)
        pad = local_len * self.size - n
        # Padding tokens: id 0 at position 0, each a sequence of its own for a varlen kernel.
        ids, positions = (torch.nn.functional.pad(inputs[key], (0, pad)) for key in ("input_ids", "position_ids"))
        start = self.rank * local_len
        split = dict(inputs, input_ids=ids[:, start:start + local_len], position_ids=positions[:, start:start + local_len])
        split["sequence_parallel"] = SequenceSlice(self, local_len, positions)
        return split


@dataclass(frozen=True)
class SequenceSlice:
    """One row as split over a group: each rank holds `local_len` of its `local_len * size` tokens."""

    parallel: SequenceParallel
    local_len: int
    position_ids: torch.Tensor  # (1, local_len * size) of the whole padded row, for varlen kernels

    @property
    def start(self) -> int:
        return self.parallel.rank * self.local_len

    def local_offsets(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of the row's `positions` fall in this rank's slice, and where (a bool mask over
        `positions` and the offsets of those it selects)."""
        mine = (positions >= self.start) & (positions < self.start + self.local_len)
        return mine, positions[mine] - self.start

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(local_len, ...) of every rank -> (local_len * size, ...), differentiable."""
        return collectives.all_gather_single_autograd(local.contiguous(), 0, self.parallel.group)

    def gather_at(self, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of `values` computed at this rank's share of the row's `positions` (in their
        order, see `local_offsets`) -> the values for all of `positions`, from every rank. A
        position may repeat (a shared prompt's last token predicts each response's first token,
        a different target each time), so values are placed by their index in `positions`: each
        rank fills its own, and the group's zero-padded copies are summed (exactly)."""
        mine, _ = self.local_offsets(positions)
        local = values.new_zeros((len(positions), *values.shape[1:])).index_put((mine.nonzero().flatten(),), values)
        return self.gather(local).unflatten(0, (self.parallel.size, len(positions))).sum(0)

    def heads_to_sequence(self, states: torch.Tensor) -> torch.Tensor:
        """(1, heads, local_len, d): all heads of this rank's tokens -> (1, own heads, all tokens, d)."""
        group, size = self.parallel, self.parallel.size
        counts = head_counts(states.shape[1], size)
        own = counts[group.rank]
        out = collectives.all_to_all_single_autograd(states[0].contiguous(), [own] * size, counts, group.group)
        return out.unflatten(0, (size, own)).transpose(0, 1).flatten(1, 2)[None]

    def sequence_to_heads(self, out: torch.Tensor, heads: int) -> torch.Tensor:
        """(1, all tokens, own heads, d), an attention output -> (1, local_len, heads, d)."""
        group, size = self.parallel, self.parallel.size
        counts = head_counts(heads, size)
        own = counts[group.rank]
        chunks = out[0].unflatten(0, (size, self.local_len)).transpose(1, 2).flatten(0, 1)  # (size * own, local, d)
        back = collectives.all_to_all_single_autograd(chunks.contiguous(), counts, [own] * size, group.group)
        return back.transpose(0, 1)[None]


def sequence_parallel_attention(attention):
    """A transformers attention function that also runs sequence-parallel: with a
    `sequence_parallel` argument (`SequenceSlice`) it exchanges tokens for heads around
    `attention`, which sees every token of the row and this rank's heads (and, for a varlen
    kernel, the whole row's position ids); without one it is `attention` itself."""

    @functools.wraps(attention)
    def wrapped(module, query, key, value, attention_mask, sequence_parallel: SequenceSlice | None = None, **kwargs):
        if sequence_parallel is None:
            return attention(module, query, key, value, attention_mask, **kwargs)
        size, heads, kv_heads = sequence_parallel.parallel.size, query.shape[1], key.shape[1]
        if heads % size or kv_heads % size:
            # An uneven deal would give a rank queries whose key/value head sits on another rank.
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        query, key, value = (sequence_parallel.heads_to_sequence(t) for t in (query, key, value))
        if "position_ids" in kwargs:
            kwargs["position_ids"] = sequence_parallel.position_ids
        out, _ = attention(module, query, key, value, attention_mask, **kwargs)
        padding = query.shape[2] - out.shape[1]  # a flat CPU attention returns only the real tokens
        if padding:
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, padding))
        return sequence_parallel.sequence_to_heads(out, heads), None

    return wrapped
