"""verl's `model.tiled_mlp` on the FSDP engine: each decoder layer's MLP runs over its tokens in
`num_shards` slices. A dense MLP's intermediate activations (several tensors of
intermediate_size, 3-4x the hidden size, per token) are the widest a layer makes; tiled, they
exist for one slice at a time. Under autograd each slice runs in torch's (non-reentrant)
activation checkpoint, so the forward keeps only the MLP's input for backward and the backward
recomputes one slice's intermediates at a time. The result is the untiled one up to float
rounding: every token's MLP output depends on that token alone."""

from __future__ import annotations

import functools
import logging

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)


def tile_mlps(layers: list[torch.nn.Module], num_shards: int, key: str) -> int:
    """Tile the dense MLP (`layer.mlp`) of each of `layers`; mixture-of-experts blocks stay whole
    (their routers see every token at once, and router replay records one call per layer).
    Returns how many were tiled; `key` names the setting in errors (`config.check_fsdp_model_features`
    has checked num_shards)."""
    mlps = [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]
    dense = [mlp for mlp in mlps if not hasattr(mlp, "experts")]
    if not dense:
        raise ValueError(f"{key}.enabled=true tiles dense MLPs (a decoder layer's `mlp`), and this model's "
                         f"{len(layers)} layers have none ({len(mlps)} expert blocks); set it to false.")
    if len(dense) < len(layers):
        logger.warning("%s: %d of %d decoder layers' MLPs tiled; the other layers' expert blocks stay whole.",
                       key, len(dense), len(layers))
    for mlp in dense:
        mlp.forward = functools.partial(_tiled_forward, mlp.forward, num_shards)
    return len(dense)


def _tiled_forward(forward, num_shards: int, hidden: torch.Tensor) -> torch.Tensor:
    """`forward` over slices of the token dimension (-2: packed rows or padded sequences)."""
    slices = hidden.chunk(num_shards, dim=-2)
    if torch.is_grad_enabled():  # a training forward (log-prob passes run without autograd)
        outputs = [checkpoint(forward, piece, use_reentrant=False) for piece in slices]
    else:
        outputs = [forward(piece) for piece in slices]
    return torch.cat(outputs, dim=-2)
