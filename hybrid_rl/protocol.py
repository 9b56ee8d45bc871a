"""`Batch`: the unit of data passed between the Ray driver and the workers.

A batch has three parts:

* ``tensors``: a :class:`tensordict.TensorDict` with ``batch_size=[B]``;
* ``non_tensors``: per-sample Python objects, one 1-D ``dtype=object`` numpy array of length B
  per key (strings, ragged token-id lists, dicts, ...);
* ``meta``: a :class:`BatchMeta`, the typed batch-level facts the workers act on (training
  step, temperature, how to sample).

Row operations (indexing, repeat, chunk, concat, padding) apply to tensors and non-tensors
alike; ``meta`` (immutable) is carried along.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["Batch", "BatchMeta", "Sampling"]


class Sampling(enum.Enum):
    """How the rollout samples a batch's responses (the value also seeds the sampler)."""

    TRAIN = 0  # the rollout's sampling settings
    VALIDATE = 1  # rollout.val_kwargs
    GREEDY = 2  # greedy decoding (ReMax's baseline)


@dataclass(frozen=True)
class BatchMeta:
    """Batch-level facts the workers act on."""

    step: int = 0  # the training step: seeds the sampler and the update's shuffling
    temperature: float = 1.0  # the rollout's temperature, at which log-probs are computed
    sampling: Sampling = Sampling.TRAIN


def _to_object_array(values: Any, key: str) -> np.ndarray:
    """Return a 1-D object array with one element per item of `values`.

    Filled element by element because ``np.array(list_of_lists)`` would build a 2-D array
    (or fail) when the inner lists happen to have equal lengths.
    """
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype == object:
        return values
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise TypeError(
            f"non-tensor {key!r} must be a sequence with one element per row, "
            f"got {type(values).__name__}"
        )
    if isinstance(values, np.ndarray) and values.ndim == 0:
        raise TypeError(f"non-tensor {key!r} must have one element per row, got a 0-d array")
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _equal(a: Any, b: Any) -> bool:
    """Structural equality that also works for tensors, arrays and containers of them."""
    if isinstance(a, TensorDictBase) or isinstance(b, TensorDictBase):
        return (
            isinstance(a, TensorDictBase)
            and isinstance(b, TensorDictBase)
            and set(a.keys(True, True)) == set(b.keys(True, True))
            and bool((a == b).all())
        )
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _check_keys(requested: Iterable[str] | None, available: Iterable[str], kind: str) -> list[str]:
    available = list(available)
    if requested is None:
        return available
    requested = [requested] if isinstance(requested, str) else list(requested)
    for key in requested:
        if key not in available:
            raise KeyError(f"{kind} key {key!r} not found; available {kind} keys: {available}")
    return requested


class Batch:
    """B rows of tensors and per-row Python objects, plus batch-level ``meta``."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | TensorDictBase | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: BatchMeta | None = None,
    ):
        tensors = {} if tensors is None else tensors
        non_tensors = {k: _to_object_array(v, k) for k, v in (non_tensors or {}).items()}
        self.meta: BatchMeta = meta or BatchMeta()

        # (kind, key, length) of every entry, so a mismatch can name both sides.
        lengths: list[tuple[str, str, int]] = []
        batched_td = isinstance(tensors, TensorDictBase) and tensors.batch_dims == 1
        if batched_td:
            lengths.append(("TensorDict", "batch_size", tensors.batch_size[0]))
        else:
            for k, v in tensors.items():
                if v.ndim == 0:
                    raise ValueError(f"tensor {k!r} is 0-d; every tensor needs a batch dim 0")
                lengths.append(("tensor", k, v.shape[0]))
        lengths += [("non-tensor", k, len(v)) for k, v in non_tensors.items()]
        for kind, key, n in lengths[1:]:
            if n != lengths[0][2]:
                ref_kind, ref_key, ref_n = lengths[0]
                raise ValueError(
                    f"length mismatch: {kind} {key!r} has {n} rows but "
                    f"{ref_kind} {ref_key!r} has {ref_n}"
                )
        size = lengths[0][2] if lengths else 0

        if not batched_td:
            tensors = TensorDict(dict(tensors.items()), batch_size=[size])
        both = set(tensors.keys()) & set(non_tensors)
        if both:
            raise ValueError(f"keys {sorted(both)} given both as tensors and non-tensors")
        self.tensors: TensorDictBase = tensors
        self.non_tensors: dict[str, np.ndarray] = non_tensors

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | TensorDictBase | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: BatchMeta | None = None,
    ) -> Batch:
        """Same as the constructor."""
        return cls(tensors, non_tensors, meta)

    # ----------------------------------------------------------------------------- access

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def __contains__(self, key: str) -> bool:
        return key in self.non_tensors or key in self.tensors.keys()

    def response_lengths(self) -> torch.Tensor:
        """Tokens in each row's response, tokens that tools wrote into a multi-turn trajectory
        included (the attention over the response columns; `response_mask` marks the trained ones)."""
        return self["attention_mask"][:, -self["response_mask"].shape[1]:].sum(-1)

    def keys(self) -> list[str]:
        """Tensor keys followed by non-tensor keys."""
        return list(self.tensors.keys()) + list(self.non_tensors)

    def _has_keys(self) -> bool:
        return bool(self.non_tensors) or len(self.tensors.keys()) > 0

    def __getitem__(self, key):
        """``str`` -> that tensor / object array; anything else selects rows -> ``Batch``.

        Row selectors: int (kept as a 1-row batch), slice, list, numpy array or tensor of
        ints or bools. Slices give views, like numpy and torch.
        """
        if isinstance(key, str):
            if key in self.non_tensors:
                return self.non_tensors[key]
            if key in self.tensors.keys():
                return self.tensors[key]
            raise KeyError(f"{key!r} not in batch; available keys: {self.keys()}")
        index = self._row_index(key)
        np_index = index if isinstance(index, slice) else index.cpu().numpy()
        return Batch(
            self.tensors[index],
            {k: v[np_index] for k, v in self.non_tensors.items()},
            self.meta,
        )

    def _row_index(self, key) -> slice | torch.Tensor:
        n = len(self)
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            i = int(key) + n if key < 0 else int(key)
            if not 0 <= i < n:
                raise IndexError(f"row {int(key)} out of range for batch of length {n}")
            return slice(i, i + 1)
        if isinstance(key, slice):
            return key
        if isinstance(key, torch.Tensor):
            index = key
        else:
            arr = np.asarray(key)
            index = torch.from_numpy(arr if arr.size else arr.astype(np.int64))
        if index.dtype == torch.bool:
            if index.shape != (n,):
                raise IndexError(f"bool mask of shape {tuple(index.shape)} for batch of length {n}")
        elif index.is_floating_point() or index.is_complex() or index.ndim != 1:
            raise IndexError(
                f"row index must be a 1-D int or bool sequence, got dtype {index.dtype} "
                f"with shape {tuple(index.shape)}"
            )
        return index

    def __setitem__(self, key: str, value) -> None:
        """Tensors (and TensorDicts) go to ``tensors``, anything else to ``non_tensors``.

        A batch with no tensor or non-tensor keys takes the length of the first value set.
        """
        is_tensor = isinstance(value, (torch.Tensor, TensorDictBase))
        if is_tensor and value.ndim == 0:
            raise ValueError(f"tensor {key!r} is 0-d; every tensor needs a batch dim 0")
        if not is_tensor:
            value = _to_object_array(value, key)
        n = value.shape[0] if is_tensor else len(value)
        if not self._has_keys():
            self.tensors.batch_size = [n]
        elif n != len(self):
            raise ValueError(f"length mismatch: {key!r} has {n} rows but the batch has {len(self)}")
        # A key lives in exactly one of the two stores.
        if is_tensor:
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            if key in self.tensors.keys():
                del self.tensors[key]
            self.non_tensors[key] = value

    # ------------------------------------------------------------------ key manipulation

    def select(
        self,
        keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
    ) -> Batch:
        """New batch sharing the chosen entries (and the meta); ``None`` keeps every entry of that kind."""
        keys = _check_keys(keys, self.tensors.keys(), "tensor")
        non_tensor_keys = _check_keys(non_tensor_keys, self.non_tensors, "non-tensor")
        return Batch(
            self.tensors.select(*keys),
            {k: self.non_tensors[k] for k in non_tensor_keys},
            self.meta,
        )

    def pop(
        self,
        keys: Iterable[str] = (),
        non_tensor_keys: Iterable[str] = (),
    ) -> Batch:
        """Remove the given entries from this batch and return them as a new batch."""
        popped = self.select(keys, non_tensor_keys)
        for k in popped.tensors.keys():
            del self.tensors[k]
        for k in popped.non_tensors:
            del self.non_tensors[k]
        return popped

    def union(self, other: Batch) -> Batch:
        """Add ``other``'s entries to this batch in place and return ``self``.

        Keys present in both must hold equal values; nothing is changed if any conflict. A
        default meta (a worker's result) takes the other's; two set ones must be equal.
        """
        if self._has_keys() and other._has_keys() and len(self) != len(other):
            raise ValueError(f"cannot union batches of length {len(self)} and {len(other)}")
        for k in other.tensors.keys():
            if k in self.non_tensors or (
                k in self.tensors.keys() and not _equal(self.tensors[k], other.tensors[k])
            ):
                raise ValueError(f"union: tensor {k!r} differs between the two batches")
        for k, v in other.non_tensors.items():
            if k in self.tensors.keys() or (
                k in self.non_tensors and not _equal(self.non_tensors[k], v)
            ):
                raise ValueError(f"union: non-tensor {k!r} differs between the two batches")
        if BatchMeta() not in (self.meta, other.meta) and self.meta != other.meta:
            raise ValueError(f"union: meta differs: {self.meta} vs {other.meta}")

        if not self._has_keys():
            self.tensors.batch_size = [len(other)]
        for k in other.tensors.keys():
            self.tensors[k] = other.tensors[k]
        self.non_tensors.update(other.non_tensors)
        if self.meta == BatchMeta():
            self.meta = other.meta
        return self

    # ------------------------------------------------------------------- row operations

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: ``[a, a, b, b]`` if ``interleave`` else ``[a, b, a, b]``."""
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, got {n}")
        rows = torch.arange(len(self))
        return self[rows.repeat_interleave(n) if interleave else rows.repeat(n)]

    def chunk(self, k: int) -> list[Batch]:
        """``k`` equal consecutive pieces; the length must be divisible by ``k``."""
        if k < 1:
            raise ValueError(f"chunk count must be >= 1, got {k}")
        if len(self) % k:
            raise ValueError(
                f"batch of length {len(self)} is not divisible into {k} chunks; "
                f"call pad_to_divisor({k}) first (and unpad the results afterwards)"
            )
        size = len(self) // k
        return [self[i * size : (i + 1) * size] for i in range(k)]

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` rows; the last one may be smaller."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Stack batches row-wise.

        All parts must have the same keys and the same ``meta``.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            for kind, mine, theirs in (
                ("tensor", first.tensors.keys(), b.tensors.keys()),
                ("non-tensor", first.non_tensors.keys(), b.non_tensors.keys()),
            ):
                if set(mine) != set(theirs):
                    raise ValueError(
                        f"concat: batch {i} has {kind} keys {sorted(theirs)}, "
                        f"batch 0 has {sorted(mine)}"
                    )

        for i, b in enumerate(batches):
            if b.meta != first.meta:
                raise ValueError(f"concat: batch {i} has meta {b.meta}, batch 0 has {first.meta}")
        return Batch(
            torch.cat([b.tensors for b in batches], dim=0),
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            first.meta,
        )

    def pad_to_divisor(self, k: int) -> tuple[Batch, int]:
        """Append copies of the first rows (cyclically) until ``len % k == 0``.

        Returns ``(padded, pad_size)``; with nothing to pad, ``(self, 0)``.
        """
        if k < 1:
            raise ValueError(f"divisor must be >= 1, got {k}")
        pad = -len(self) % k
        if pad == 0:
            return self, 0
        return Batch.concat([self, self[torch.arange(pad) % len(self)]]), pad

    def unpad(self, pad_size: int) -> Batch:
        """Drop the last ``pad_size`` rows (undoes :meth:`pad_to_divisor`)."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"pad_size {pad_size} out of range for batch of length {len(self)}")
        return self if pad_size == 0 else self[: len(self) - pad_size]

    def to(self, device) -> Batch:
        """Move the tensors to ``device``; non-tensor arrays and meta are shared."""
        return Batch(self.tensors.to(device), dict(self.non_tensors), self.meta)

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            for k, v in self.tensors.items()
        )
        return (
            f"Batch(len={len(self)}, tensors={{{tensors}}}, "
            f"non_tensors={list(self.non_tensors)}, meta={self.meta})"
        )


class DataProtoView:
    """A ``Batch`` as verl's ``DataProto`` shows it to code written for verl (a curriculum
    sampler's ``update``, a reward manager of one's own): ``batch`` (the tensors, a TensorDict),
    ``non_tensor_batch`` (object arrays) and ``meta_info``; ``view[i]`` is one row (its
    ``batch[key]`` that row's tensor, its ``non_tensor_batch[key]`` that row's object), ``view[a:b]``
    a view of those rows."""

    def __init__(self, tensors: TensorDictBase, non_tensors: dict[str, np.ndarray], meta_info: dict | None = None):
        self.batch = tensors
        self.non_tensor_batch = non_tensors
        self.meta_info = {} if meta_info is None else meta_info

    @classmethod
    def of(cls, batch: Batch) -> DataProtoView:
        return cls(batch.tensors, dict(batch.non_tensors))

    def __len__(self) -> int:
        return int(self.batch.batch_size[0])

    def __getitem__(self, index):
        rows = {key: values[index] for key, values in self.non_tensor_batch.items()}
        return DataProtoView(self.batch[index], rows, self.meta_info)
