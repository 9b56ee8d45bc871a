"""Deterministic, exactly-resumable batch sampler over dataset indices."""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["EpochSampler"]


class EpochSampler:
    """Yield batches (``list[int]``) of dataset indices, epoch after epoch.

    With ``shuffle=True`` every epoch uses a fresh permutation drawn from
    ``torch.Generator().manual_seed(seed + epoch)``, so the order depends only
    on ``(seed, epoch)`` and can be reproduced after a restart. With
    ``drop_last=True`` (training) the incomplete tail batch of each epoch is
    skipped.

    ``state_dict()`` records the position of the *next* batch, so a sampler
    restored with ``load_state_dict`` continues with exactly the batch that
    would have come next.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int | None = 0,
        drop_last: bool = True,
        total_epochs: int = 1,
    ):
        n, batch_size, total_epochs = int(n), int(batch_size), int(total_epochs)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size} (data.train_batch_size)")
        if n < 1:
            raise ValueError("cannot sample from an empty dataset (n=0)")
        if drop_last and n < batch_size:
            raise ValueError(
                f"dataset has {n} prompts, fewer than the batch size {batch_size}, so with "
                "drop_last=True there is not a single full batch. Lower data.train_batch_size "
                f"to at most {n} or use more data."
            )
        if total_epochs < 1:
            raise ValueError(f"total_epochs must be >= 1, got {total_epochs} (trainer.total_epochs)")
        self.n = n
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        # A null seed (data.seed=null) falls back to a fixed default so runs stay reproducible.
        self.seed = 1 if seed is None else int(seed)
        self.drop_last = bool(drop_last)
        self.total_epochs = total_epochs
        self.epoch = 0
        self.batch_in_epoch = 0

    # ----------------------------------------------------------------- sizes
    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.n // self.batch_size
        return -(-self.n // self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.total_epochs

    # -------------------------------------------------------------- ordering
    def epoch_order(self, epoch: int) -> list[int]:
        """All indices of ``epoch`` in the order they are served."""
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + int(epoch))
        return torch.randperm(self.n, generator=g).tolist()

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        order = self.epoch_order(epoch)
        return [
            order[b * self.batch_size : (b + 1) * self.batch_size]
            for b in range(self.steps_per_epoch)
        ]

    def __iter__(self) -> Iterator[list[int]]:
        cached_epoch, batches = None, []
        while self.epoch < self.total_epochs:
            if cached_epoch != self.epoch:
                cached_epoch, batches = self.epoch, self.epoch_batches(self.epoch)
            batch = batches[self.batch_in_epoch]
            # Advance before yielding: a state_dict() taken after receiving a batch
            # points at the next one.
            self.batch_in_epoch += 1
            if self.batch_in_epoch >= len(batches):
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            yield batch

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        if epoch < 0 or batch < 0 or batch >= self.steps_per_epoch:
            raise ValueError(
                f"sampler state {state} does not fit this sampler "
                f"({self.steps_per_epoch} batches per epoch); was the checkpoint saved with a "
                "different dataset size or data.train_batch_size?"
            )
        self.epoch, self.batch_in_epoch = epoch, batch
