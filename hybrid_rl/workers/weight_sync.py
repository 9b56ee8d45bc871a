"""Reshard trained FSDP2 weights into the rollout engine without touching disk.

Each rank gathers one full tensor at a time (`DTensor.full_tensor`, a collective every rank runs
in the same order), casts it to the engine's dtype and hands it to the engine, so the extra
memory is bounded by the largest single tensor rather than the whole model.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.distributed.tensor import DTensor


def iter_full_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach().to(dtype=dtype)


def sync_weights(model: torch.nn.Module, rollout) -> int:
    """Push the model's weights into `rollout`; returns the number of bytes sent."""
    sent = 0

    def counted():
        nonlocal sent
        for name, tensor in iter_full_tensors(model, rollout.dtype):
            sent += tensor.numel() * tensor.element_size()
            yield name, tensor

    rollout.load_weights(counted())
    return sent
