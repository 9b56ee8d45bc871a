"""Reshard the trained weights into the rollout engine without touching disk.

The training engine yields one full tensor at a time with its Hugging Face name
(`TrainEngine.per_tensor_weights`, a collective every rank runs in the same order), and the
rollout engine loads it, so the extra memory is bounded by the largest single tensor rather than
the whole model. The tensors come as gathered (float32): the engine's loaders cast them as they
copy them into its own weights, which saves a pass over every weight (12 % of a push of the
135M model into a bf16 engine on CPU).
"""

from __future__ import annotations

from hybrid_rl.engines import TrainEngine


def sync_weights(engine: TrainEngine, rollout, only_trained: bool = False) -> int:
    """Push the engine's weights into `rollout` (with `only_trained`, those training can have
    changed since the last push: under LoRA the adapted ones); returns the number of bytes that
    land in the rollout engine's dtype."""
    sent = 0

    def counted():
        nonlocal sent
        for name, tensor in engine.per_tensor_weights(None, only_trained):
            sent += tensor.numel() * rollout.dtype.itemsize
            yield name, tensor

    rollout.load_weights(counted())
    return sent
