"""verl's `model.enable_activation_offload`: what a training forward saves for its backward pass
waits in host memory instead of the accelerator's.

Autograd's saved-tensor hooks move each saved activation to (pinned) host memory as the forward
saves it and bring it back when the backward pass needs it. Under gradient checkpointing the
checkpointed layers save only their inputs (their recomputation runs inside the backward pass,
outside these hooks), so what goes to the host is one hidden state per layer plus the LM head's
and the loss's tensors: the pairing verl's performance guide recommends. Parameters stay where
they are (FSDP2 gathers them for the backward pass anyway), as do tensors too small to be worth
a copy. The copies are asynchronous on the compute stream, which orders them before any kernel
that reuses the freed memory; verl's own handler also overlaps them with the next layer's compute
on a second stream, which this one does not.
"""

from __future__ import annotations

import torch

# Smaller saved tensors (norm statistics, masks, scalars) free little and cost a copy each way.
MIN_OFFLOAD_BYTES = 1 << 20


def is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight transposed)."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors on `device` of at least MIN_OFFLOAD_BYTES, parameters excepted, wait in host
    memory (pinned where the device is an accelerator). `offloaded_bytes` counts what went."""

    def __init__(self, device: torch.device):
        self.offloaded_bytes = 0
        pinned = device.type != "cpu"

        def pack(tensor: torch.Tensor):
            size = tensor.numel() * tensor.element_size()
            if tensor.device.type != device.type or is_weight(tensor) or size < MIN_OFFLOAD_BYTES:
                return tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
            host.copy_(tensor, non_blocking=pinned)
            self.offloaded_bytes += size
            return tensor.device, host

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            origin, host = packed
            return host.to(origin, non_blocking=pinned)

        super().__init__(pack, unpack)
