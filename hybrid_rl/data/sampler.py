"""Deterministic, exactly-resumable batch sampler over dataset indices, and a sampler of the
user's (verl's `data.sampler`) served the same way."""

from __future__ import annotations

import json
import logging
from abc import abstractmethod
from collections.abc import Sized
from typing import Any, Iterator

import torch

from hybrid_rl.protocol import DataProtoView

__all__ = ["AbstractCurriculumSampler", "AbstractSampler", "CustomSampler", "EpochSampler", "load_custom_sampler"]

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------- a sampler of the user's
class AbstractSampler(torch.utils.data.Sampler):
    """verl's interface for a sampler of one's own (`data.sampler.class_path` / `class_name`):
    built as ``cls(data_source=<the training dataset>, data_config=<the data section>)``, it
    yields dataset indices, and ``len()`` says how many one epoch yields."""

    @abstractmethod
    def __init__(self, data_source: Sized, data_config: Any):
        pass


class AbstractCurriculumSampler(AbstractSampler):
    """A sampler that also learns from each trained batch: ``update(batch)`` after every step."""

    @abstractmethod
    def update(self, batch: Any) -> None:
        pass


class CustomSampler:
    """A user's index sampler (verl's `data.sampler`) served in batches as ``EpochSampler`` serves
    them: ``batch_size`` indices per step, drawn from the sampler as each batch is needed (so a
    curriculum's update reorders what comes next), the tail of an epoch shorter than a batch
    dropped, epoch after epoch. Its position resumes exactly; the sampler's own state does when it
    has ``state_dict`` / ``load_state_dict`` (torch's stateful-sampler protocol), else it restarts
    the epoch and skips the indices already served (exact for an order fixed by its seed)."""

    def __init__(self, sampler, batch_size: int, total_epochs: int, key: str = "data.sampler"):
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.total_epochs = int(total_epochs)
        self.key = key
        try:
            per_epoch = len(sampler)
        except TypeError:
            raise ValueError(f"{key}: {type(sampler).__name__} has no __len__; a sampler must say how many indices "
                             "one epoch yields") from None
        if per_epoch < self.batch_size:
            raise ValueError(f"{key}: {type(sampler).__name__} yields {per_epoch} indices per epoch, fewer than the "
                             f"batch size {self.batch_size}: not a single full batch")
        self.steps_per_epoch = per_epoch // self.batch_size
        if callable(getattr(sampler, "state_dict", None)):
            try:  # checked now, not at the first checkpoint
                json.dumps(sampler.state_dict())
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{key}: {type(sampler).__name__}.state_dict() must return JSON values (numbers, "
                                 f"strings, lists, dicts), as the checkpoint's trainer state is JSON: {exc}") from None
        self.epoch = 0
        self.batch_in_epoch = 0
        self._skip = 0  # indices to pass over when an epoch resumes without the sampler's own state

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.total_epochs

    def __iter__(self) -> Iterator[list[int]]:
        while self.epoch < self.total_epochs:
            indices = iter(self.sampler)
            for _ in range(self._skip):
                next(indices)
            self._skip = 0
            while True:
                try:
                    batch = [int(next(indices)) for _ in range(self.batch_size)]
                except StopIteration:
                    raise ValueError(f"{self.key}: {type(self.sampler).__name__} stopped before the "
                                     f"{self.steps_per_epoch * self.batch_size} indices its len() promised") from None
                # Advance before yielding: a state_dict() taken after receiving a batch points at the next one.
                self.batch_in_epoch += 1
                last = self.batch_in_epoch == self.steps_per_epoch
                if last:
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                yield batch
                if last:
                    for _ in indices:  # the dropped tail, drawn as torch's batch sampler draws it
                        pass
                    break

    def update(self, batch) -> None:
        if isinstance(self.sampler, AbstractCurriculumSampler):
            self.sampler.update(batch=DataProtoView.of(batch))

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}
        if callable(getattr(self.sampler, "state_dict", None)):
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        if "sampler" in state and callable(getattr(self.sampler, "load_state_dict", None)):
            self.sampler.load_state_dict(state["sampler"])
            return
        self._skip = self.batch_in_epoch * self.batch_size
        if self._skip:
            logger.warning("%s: %s has no state_dict / load_state_dict: its epoch restarts and the %d indices already "
                           "served are skipped, exact only if its order does not depend on what it learnt.", self.key,
                           type(self.sampler).__name__, self._skip)


def load_custom_sampler(data_cfg, dataset, batch_size: int, total_epochs: int) -> CustomSampler:
    """verl's `data.sampler.class_path` (a .py file or pkg://module) and `class_name`, built on
    the training dataset; a verl user's file imports verl's sampler interface and gets ours."""
    from hybrid_rl.user_code import load_object, verl_stand_ins

    path, name = data_cfg.sampler.class_path, data_cfg.sampler.get("class_name")
    if not name:
        raise ValueError(f"data.sampler.class_path={path} needs data.sampler.class_name, the sampler class in it.")
    interface = {"AbstractSampler": AbstractSampler, "AbstractCurriculumSampler": AbstractCurriculumSampler}
    with verl_stand_ins({"verl": {"DataProto": DataProtoView}, "verl.experimental.dataset.sampler": interface}):
        cls = load_object(path, name, "data.sampler", f"class {name}(AbstractSampler)")
    if not (isinstance(cls, type) and issubclass(cls, AbstractSampler)):
        raise ValueError(f"data.sampler.class_name={name} in {path} must be a class derived from AbstractSampler "
                         "(from verl.experimental.dataset.sampler, or hybrid_rl.data.sampler) taking data_source and "
                         f"data_config; got {cls!r}.")
    return CustomSampler(cls(data_source=dataset, data_config=data_cfg), batch_size, total_epochs)
