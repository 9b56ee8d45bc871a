"""Dispatch modes and the ``register`` decorator for worker methods.

A worker method tagged with :func:`register` keeps its normal behaviour when it
is called directly (inside the actor).  The tag only tells a
:class:`~hybrid_rl.controller.worker_group.RayWorkerGroup` how to fan the
arguments out over the ranks, which ranks run the call, how to fan the results
back in, and whether to wait for them.

The split / merge helpers in this module are pure functions (no Ray), so they
can be unit-tested and reused by other group implementations.
"""

from __future__ import annotations

import dataclasses
import inspect
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hybrid_rl.profiler import profiled_method

__all__ = [
    "Dispatch",
    "DispatchInfo",
    "register",
    "get_dispatch_info",
    "registered_methods",
    "DISPATCH_ATTR",
    "RankLayout",
]

# The single attribute in which ``register`` stores its information.
DISPATCH_ATTR = "__hybrid_rl_dispatch__"


class Dispatch(Enum):
    """How a worker-group call maps onto the ranks."""

    #: Same arguments to every rank; a list of per-rank results is returned.
    ONE_TO_ALL = "one_to_all"
    #: Only rank 0 runs; its result is returned (not wrapped in a list).
    RANK_ZERO = "rank_zero"
    #: Every argument is already a list of length world_size; rank i gets
    #: element i of each; a list of per-rank results is returned.
    ALL_TO_ALL = "all_to_all"
    #: Every ``Batch`` argument is padded to a multiple of the data-parallel
    #: size, chunked, and each rank gets its data-parallel rank's chunk; other
    #: arguments are broadcast.  If every rank returns a ``Batch`` the outputs
    #: are concatenated and the padding rows removed, otherwise the list of
    #: per-rank results is returned.  Without a ``mesh`` every rank is its own
    #: data-parallel rank; with one, the worker's ``dispatch_layout(mesh)``
    #: says which ranks share rows (tensor / pipeline parallel peers) and
    #: which one of them returns the results.
    DP_COMPUTE = "dp_compute"


@dataclasses.dataclass(frozen=True)
class DispatchInfo:
    dispatch: Dispatch
    blocking: bool = True
    mesh: Optional[str] = None  # DP_COMPUTE over this model's data-parallel layout


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """One rank's place in a model's data-parallel layout."""

    dp_rank: int
    dp_size: int
    is_output: bool  # returns the results of its data-parallel replica


def register(dispatch: Dispatch = Dispatch.ALL_TO_ALL, blocking: bool = True, mesh: Optional[str] = None) -> Callable:
    """Tag a worker method with its dispatch mode.

    Calling the method directly inside the worker behaves as before; while the
    process is being profiled (`hybrid_rl.profiler`) each call is a named range
    in the trace.  ``blocking=False`` makes the worker-group call return Ray ``ObjectRef``s
    instead of results.  ``mesh`` (DP_COMPUTE only) names the model whose
    data-parallel layout splits the batch.
    """
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register(dispatch=...) expects a Dispatch member, got {dispatch!r}")
    if mesh is not None and dispatch is not Dispatch.DP_COMPUTE:
        raise ValueError("register(mesh=...) applies to Dispatch.DP_COMPUTE only")

    def decorator(fn: Callable) -> Callable:
        if isinstance(fn, (staticmethod, classmethod)):
            raise TypeError("@register can only decorate plain instance methods")
        method = profiled_method(fn)
        setattr(method, DISPATCH_ATTR, DispatchInfo(dispatch=dispatch, blocking=bool(blocking), mesh=mesh))
        return method

    return decorator


def get_dispatch_info(fn: Any) -> Optional[DispatchInfo]:
    info = getattr(fn, DISPATCH_ATTR, None)
    return info if isinstance(info, DispatchInfo) else None


def registered_methods(cls: type) -> Dict[str, DispatchInfo]:
    """Return ``{method_name: DispatchInfo}`` for every tagged method of ``cls``
    (including inherited ones), in a stable (sorted) order."""
    out: Dict[str, DispatchInfo] = {}
    for name in sorted(dir(cls)):
        if name.startswith("__"):
            continue
        try:
            attr = inspect.getattr_static(cls, name)
        except AttributeError:
            continue
        info = get_dispatch_info(attr)
        if info is not None:
            out[name] = info
    return out


# ---------------------------------------------------------------------------
# split / merge helpers (pure python)
# ---------------------------------------------------------------------------


def _batch_cls():
    # Imported lazily so that the controller does not depend on the protocol
    # module at import time.
    from hybrid_rl.protocol import Batch

    return Batch


def _is_batch(x: Any) -> bool:
    try:
        Batch = _batch_cls()
    except ImportError:  # pragma: no cover - protocol module missing
        return False
    return isinstance(x, Batch)


def split_all_to_all(
    world_size: int, args: Sequence[Any], kwargs: Dict[str, Any]
) -> Tuple[List[tuple], List[dict]]:
    def check(name: str, v: Any) -> None:
        if not isinstance(v, (list, tuple)) or len(v) != world_size:
            got = f"{type(v).__name__} of length {len(v)}" if isinstance(v, (list, tuple)) else type(v).__name__
            raise ValueError(
                f"Dispatch.ALL_TO_ALL expects every argument to be a list of length world_size={world_size}; "
                f"argument {name} is a {got}"
            )

    for i, a in enumerate(args):
        check(f"#{i}", a)
    for k, v in kwargs.items():
        check(repr(k), v)
    per_args = [tuple(a[r] for a in args) for r in range(world_size)]
    per_kwargs = [{k: v[r] for k, v in kwargs.items()} for r in range(world_size)]
    return per_args, per_kwargs


def split_dp_compute(
    world_size: int, args: Sequence[Any], kwargs: Dict[str, Any]
) -> Tuple[List[tuple], List[dict], int]:
    """Chunk every Batch argument over ``world_size`` ranks (with padding).

    Returns per-rank args, per-rank kwargs and the number of padding rows that
    were appended (0 if no Batch argument was given).
    """
    lengths = {}
    for i, a in enumerate(args):
        if _is_batch(a):
            lengths[f"#{i}"] = len(a)
    for k, v in kwargs.items():
        if _is_batch(v):
            lengths[repr(k)] = len(v)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"Dispatch.DP_COMPUTE needs all Batch arguments to have the same length, got {lengths}")

    pad_size = 0

    def chunks_of(x: Any) -> List[Any]:
        nonlocal pad_size
        if not _is_batch(x):
            return [x] * world_size
        padded, pad = x.pad_to_divisor(world_size)
        pad_size = int(pad)
        parts = padded.chunk(world_size)
        if len(parts) != world_size:
            raise RuntimeError(f"Batch.chunk({world_size}) returned {len(parts)} chunks")
        return list(parts)

    split_args = [chunks_of(a) for a in args]
    split_kwargs = {k: chunks_of(v) for k, v in kwargs.items()}
    per_args = [tuple(a[r] for a in split_args) for r in range(world_size)]
    per_kwargs = [{k: v[r] for k, v in split_kwargs.items()} for r in range(world_size)]
    return per_args, per_kwargs, pad_size


def split_by_layout(layout: Sequence[RankLayout], args: Sequence[Any], kwargs: Dict[str, Any]
                    ) -> Tuple[List[tuple], List[dict], int]:
    """``split_dp_compute`` over the data-parallel ranks of ``layout``; every
    rank gets its data-parallel rank's chunk."""
    sizes = {entry.dp_size for entry in layout}
    if len(sizes) != 1:
        raise ValueError(f"ranks disagree on the data-parallel size: {sorted(sizes)}")
    per_args, per_kwargs, pad_size = split_dp_compute(sizes.pop(), args, kwargs)
    return ([per_args[entry.dp_rank] for entry in layout], [per_kwargs[entry.dp_rank] for entry in layout],
            pad_size)


def output_ranks(layout: Sequence[RankLayout]) -> List[int]:
    """The ranks whose results stand for their replicas, in data-parallel order."""
    outputs = sorted((entry.dp_rank, rank) for rank, entry in enumerate(layout) if entry.is_output)
    if [dp_rank for dp_rank, _ in outputs] != list(range(layout[0].dp_size)):
        raise ValueError(f"each data-parallel rank needs exactly one output rank, got {layout}")
    return [rank for _, rank in outputs]


def collect_dp_compute(results: List[Any], pad_size: int) -> Any:
    if results and all(_is_batch(r) for r in results):
        merged = _batch_cls().concat(list(results))
        if pad_size:
            merged = merged.unpad(pad_size)
        return merged
    return list(results)
