"""Resource pools, worker groups and colocation on top of Ray.

``RayWorkerGroup`` starts one Ray actor per placement-group bundle and turns
every ``@register``-ed method of the worker class into a method of the group
object that dispatches the call over the ranks and collects the results.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from hybrid_rl.controller.decorator import (
    DISPATCH_ATTR,
    Dispatch,
    DispatchInfo,
    collect_dp_compute,
    RankLayout,
    output_ranks,
    registered_methods,
    split_all_to_all,
    split_by_layout,
    split_dp_compute,
)
from hybrid_rl.controller.worker import Worker

__all__ = [
    "ResourcePool",
    "ClassWithInitArgs",
    "RayWorkerGroup",
    "WorkerError",
    "create_colocated_worker_cls",
]

logger = logging.getLogger(__name__)

# Environment variables the group sets itself; user env_vars may not override them.
_RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class PlacementError(RuntimeError):
    """The Ray cluster cannot host the requested processes (checked with a bounded wait)."""


class WorkerError(RuntimeError):
    """A remote worker method failed.  ``rank``, ``method``, ``cause`` (the
    original exception, when Ray could deserialize it) and ``out_of_memory``
    (Ray's memory monitor killed the worker) are attributes; the Ray error is
    chained as ``__cause__``."""

    def __init__(self, message: str, rank: int, method: str, cause: Optional[BaseException],
                 out_of_memory: bool = False):
        super().__init__(message)
        self.rank = rank
        self.method = method
        self.cause = cause
        self.out_of_memory = out_of_memory


def exception_text(traceback_str: str) -> str:
    """The exception's own lines at the end of a formatted traceback (after the last frame)."""
    lines = traceback_str.rstrip().splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1)
    rest = lines[last_frame + 1:]
    while rest and rest[0][:1].isspace():  # the frame's source line and its ^^^ markers
        rest.pop(0)
    return "\n".join(rest) or traceback_str


# ---------------------------------------------------------------------------
# Resource pool
# ---------------------------------------------------------------------------


PLACEMENT_STRATEGIES = ("PACK", "STRICT_SPREAD")


class ResourcePool:
    """One STRICT_PACK placement group per node.

    ``process_on_nodes[i]`` processes (bundles) are reserved on node ``i``;
    every bundle is ``{"CPU": cpus_per_process}`` (+ ``{"GPU": 1}`` when
    ``use_gpu``).  ``strategy`` says how the groups relate: ``PACK`` lets Ray
    put several groups on one Ray node that has room for them, ``STRICT_SPREAD``
    gives every group a Ray node of its own (each group is placed after the
    previous one, on a node not taken yet).  The constructor waits up to
    ``timeout_s`` for the groups to be placed and raises ``PlacementError``
    (after freeing what it reserved) when the cluster cannot host them.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = False,
        cpus_per_process: float = 1.0,
        name_prefix: str = "",
        timeout_s: float = 120.0,
        strategy: str = "PACK",
    ) -> None:
        process_on_nodes = [int(n) for n in process_on_nodes]
        if not process_on_nodes or any(n <= 0 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must be a non-empty list of positive ints, got {process_on_nodes}")
        if cpus_per_process < 0:
            raise ValueError(f"cpus_per_process must be >= 0, got {cpus_per_process}")
        if not use_gpu and cpus_per_process == 0:
            raise ValueError("cpus_per_process must be > 0 when use_gpu=False (a bundle needs some resource)")
        if strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized; call hybrid_rl.controller.init_ray() first")

        self.process_on_nodes = process_on_nodes
        self.use_gpu = bool(use_gpu)
        self.cpus_per_process = float(cpus_per_process)
        self.name_prefix = name_prefix
        self.timeout_s = float(timeout_s)
        self.strategy = strategy

        bundle: Dict[str, float] = {}
        if self.cpus_per_process > 0:
            bundle["CPU"] = self.cpus_per_process
        if self.use_gpu:
            bundle["GPU"] = 1
        self.bundle = bundle

        pgs, taken_nodes = [], []
        deadline = time.monotonic() + self.timeout_s
        try:
            for node_idx, n in enumerate(process_on_nodes):
                name = f"{name_prefix}pg{node_idx}_{uuid.uuid4().hex[:6]}" if name_prefix else ""
                # Ray's default node label; "!in(...)" keeps this group off the nodes already taken.
                selector = [{"ray.io/node-id": f"!in({','.join(taken_nodes)})"}] * n if taken_nodes else None
                pgs.append(placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK", name=name,
                                           bundle_label_selector=selector))
                if strategy == "STRICT_SPREAD":
                    ray.get(pgs[-1].ready(), timeout=max(0.0, deadline - time.monotonic()))
                    taken_nodes.append(placement_group_table(pgs[-1])["bundles_to_node_id"][0])
            ray.get([pg.ready() for pg in pgs], timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            for pg in pgs:
                try:
                    remove_placement_group(pg)
                except Exception:  # pragma: no cover
                    pass
            raise PlacementError(self._not_enough_resources_message()) from None
        self.placement_groups = pgs

    # -- info
    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundles(self) -> List[Tuple[Any, int, int, int]]:
        """``[(placement_group, bundle_index, node_index, local_rank)]`` in rank order."""
        out = []
        for node_idx, (pg, n) in enumerate(zip(self.placement_groups, self.process_on_nodes)):
            for local_rank in range(n):
                out.append((pg, local_rank, node_idx, local_rank))
        return out

    def node_id_of(self, node_index: int) -> Optional[str]:
        table = placement_group_table(self.placement_groups[node_index])
        return (table.get("bundles_to_node_id") or {}).get(0)

    def remove(self) -> None:
        """Free the placement groups (the actors using them die)."""
        for pg in getattr(self, "placement_groups", []):
            try:
                remove_placement_group(pg)
            except Exception:  # pragma: no cover
                pass
        self.placement_groups = []

    def _not_enough_resources_message(self) -> str:
        n = self.world_size
        cpu_req = n * self.cpus_per_process
        gpu_req = n if self.use_gpu else 0
        try:
            total = ray.cluster_resources()
            avail = ray.available_resources()
            nodes = [n for n in ray.nodes() if n.get("Alive")]
        except Exception:  # pragma: no cover
            total, avail, nodes = {}, {}, []
        # Per node: several Ray nodes on one host share its address (resource "node:<ip>").
        node_list = "; ".join(f"{n.get('NodeManagerAddress', '?')} CPU={n['Resources'].get('CPU', 0):g} "
                              f"GPU={n['Resources'].get('GPU', 0):g}" for n in nodes)
        per_node = ", ".join(
            f"node{i}: {k} x {self.bundle}" for i, k in enumerate(self.process_on_nodes)
        )
        spread = ", each on a Ray node of its own (trainer.placement_strategy=STRICT_SPREAD)" \
            if self.strategy == "STRICT_SPREAD" else ""
        return (
            f"ResourcePool could not be placed within {self.timeout_s:g} s: requested {n} processes "
            f"on {len(self.process_on_nodes)} node(s) ({per_node}) = {cpu_req:g} CPUs and {gpu_req} GPUs "
            f"(each node's processes must fit on ONE Ray node{spread}), but the Ray cluster has "
            f"CPU={total.get('CPU', 0):g} GPU={total.get('GPU', 0):g} in total "
            f"(currently available: CPU={avail.get('CPU', 0):g} GPU={avail.get('GPU', 0):g}, "
            f"{len(nodes)} node(s): {node_list}). "
            f"Fix: lower trainer.n_gpus_per_node and/or trainer.nnodes, or lower trainer.cpus_per_worker "
            f"(fractions such as 0.5 are allowed), or start Ray with more resources "
            f"(ray.init(num_cpus=...)/ray start --num-cpus=... --num-gpus=...)."
        )


# ---------------------------------------------------------------------------
# Deferred construction
# ---------------------------------------------------------------------------


class ClassWithInitArgs:
    """A class plus its constructor arguments, to be instantiated later (in a
    Ray actor, or locally via ``__call__``)."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs expects a class, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.cls.__name__}, args={self.args!r}, kwargs={self.kwargs!r})"


# ---------------------------------------------------------------------------
# Colocation
# ---------------------------------------------------------------------------


def _make_role_forwarder(role: str, method: str, info: DispatchInfo, is_async: bool) -> Callable:
    if is_async:

        async def forward(self, *args, **kwargs):
            return await getattr(self._role_workers[role], method)(*args, **kwargs)

    else:

        def forward(self, *args, **kwargs):
            return getattr(self._role_workers[role], method)(*args, **kwargs)

    forward.__name__ = f"{role}_{method}"
    forward.__qualname__ = forward.__name__
    setattr(forward, DISPATCH_ATTR, info)
    return forward


def create_colocated_worker_cls(class_dict: Dict[str, ClassWithInitArgs]) -> ClassWithInitArgs:
    """Build one Worker class whose actor process hosts every role.

    Each role's class is instantiated inside the actor (after the group's env
    vars are in place, so each role sees the right RANK/... and may call
    ``init_process_group``; only the first call does anything).  Every
    registered method ``m`` of role ``r`` is exposed as ``f"{r}_{m}"`` with the
    same dispatch info.  Use :meth:`RayWorkerGroup.spawn` to get per-role views.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles: Dict[str, ClassWithInitArgs] = {}
    for role, cwia in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise ValueError(f"role names must be identifiers, got {role!r}")
        if not isinstance(cwia, ClassWithInitArgs):
            raise TypeError(f"class_dict[{role!r}] must be a ClassWithInitArgs, got {type(cwia).__name__}")
        roles[role] = cwia

    def __init__(self) -> None:
        Worker.__init__(self)
        self._role_workers = {}
        for r, c in roles.items():
            self._role_workers[r] = c()

    namespace: Dict[str, Any] = {"__init__": __init__, "_colocated_roles": tuple(roles), "__module__": __name__}
    for role, cwia in roles.items():
        for method, info in registered_methods(cwia.cls).items():
            fn = inspect.getattr_static(cwia.cls, method)
            name = f"{role}_{method}"
            if name in namespace or hasattr(Worker, name):
                raise ValueError(f"colocated method name clash: {name}")
            namespace[name] = _make_role_forwarder(role, method, info, inspect.iscoroutinefunction(fn))

    cls_name = "Colocated_" + "_".join(roles)
    colocated_cls = type(cls_name, (Worker,), namespace)
    return ClassWithInitArgs(colocated_cls)


# ---------------------------------------------------------------------------
# Worker group
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class PendingCall:
    """A worker-group call in flight (`group.method.submit(...)`): `result()` waits for every
    rank and gathers their results as the blocking call does."""

    group: "RayWorkerGroup"
    method: str
    info: DispatchInfo
    refs: List[Any]
    pad_size: int

    def result(self) -> Any:
        return self.group._finish(self)


@ray.remote(num_cpus=0)
def _remote_master_addr_port() -> Tuple[str, int]:
    return Worker.get_master_addr_port()


class RayWorkerGroup:
    """One Ray actor per bundle of ``resource_pool``; rank = global bundle order.

    Every method of the worker class tagged with ``@register`` becomes a
    method of this object with the same name.  Calls go
    dispatch -> ``actor.method.remote`` on the right ranks -> ``ray.get``
    (if blocking) -> collect.
    """

    # attribute names a registered worker method may not shadow
    _RESERVED_NAMES = frozenset(
        {"world_size", "workers", "worker_names", "execute_all", "execute_rank_zero", "execute_all_async",
         "spawn", "resource_pool", "worker_cls", "kill", "env_vars", "master_addr", "master_port"}
    )

    def __init__(
        self,
        resource_pool: ResourcePool,
        cls_with_init: ClassWithInitArgs,
        name_prefix: Optional[str] = None,
        env_vars: Optional[Dict[str, str]] = None,
    ) -> None:
        if not isinstance(cls_with_init, ClassWithInitArgs):
            raise TypeError("cls_with_init must be a ClassWithInitArgs")
        if not (isinstance(cls_with_init.cls, type) and issubclass(cls_with_init.cls, Worker)):
            raise TypeError(f"{cls_with_init.cls!r} must be a subclass of hybrid_rl.controller.Worker")
        env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        clash = sorted(set(env_vars) & set(_RESERVED_ENV))
        if clash:
            raise ValueError(f"env_vars may not set {clash}; the worker group sets them itself")

        self.resource_pool = resource_pool
        self.worker_cls = cls_with_init.cls
        self.env_vars = env_vars
        self._name_prefix = name_prefix if name_prefix is not None else f"{uuid.uuid4().hex[:6]}_"
        self._method_prefix = ""
        self._layouts: Dict[Tuple[str, str], List[RankLayout]] = {}  # shared with the role views

        bundles = resource_pool.bundles()
        self._world_size = len(bundles)
        self.master_addr, self.master_port = self._get_master_addr_port()

        remote_cls = ray.remote(self.worker_cls)
        workers, names = [], []
        for rank, (pg, bundle_idx, node_idx, local_rank) in enumerate(bundles):
            env = dict(env_vars)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(self._world_size),
                LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(resource_pool.process_on_nodes[node_idx]),
                MASTER_ADDR=str(self.master_addr),
                MASTER_PORT=str(self.master_port),
            )
            name = f"{self._name_prefix}{self.worker_cls.__name__}_{node_idx}:{local_rank}"
            options: Dict[str, Any] = dict(
                num_cpus=resource_pool.cpus_per_process,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle_idx
                ),
                runtime_env={"env_vars": env},
                name=name,
            )
            if resource_pool.use_gpu:
                options["num_gpus"] = 1
            workers.append(remote_cls.options(**options).remote(*cls_with_init.args, **cls_with_init.kwargs))
            names.append(name)
        self._workers = workers
        self._worker_names = names
        self._bind_methods()

    # ----------------------------------------------------------------- setup
    def _get_master_addr_port(self) -> Tuple[str, int]:
        node_id = self.resource_pool.node_id_of(0)
        here = ray.get_runtime_context().get_node_id()
        if node_id is None or node_id == here:
            return Worker.get_master_addr_port()
        strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        return ray.get(_remote_master_addr_port.options(scheduling_strategy=strategy).remote())

    def _bind_methods(self) -> None:
        prefix = self._method_prefix
        self._bound_names = set()
        for name, info in registered_methods(self.worker_cls).items():
            if prefix:
                if not name.startswith(prefix):
                    continue
                public = name[len(prefix):]
            else:
                public = name
            if public in self._RESERVED_NAMES or public.startswith("_"):
                raise ValueError(
                    f"registered method {self.worker_cls.__name__}.{name} would shadow RayWorkerGroup.{public}"
                )
            setattr(self, public, self._make_group_method(name, info))
            self._bound_names.add(public)

    def _make_group_method(self, remote_name: str, info: DispatchInfo) -> Callable:
        def group_method(*args, **kwargs):
            return self._call(remote_name, info, args, kwargs)

        # `group.method.submit(...)` starts the call and returns at once; `.result()` of what it
        # returns waits and gathers as the plain call does.
        group_method.submit = lambda *args, **kwargs: self._start(remote_name, info, args, kwargs)
        group_method.__name__ = remote_name
        group_method.__doc__ = f"{info.dispatch.name} call of {self.worker_cls.__name__}.{remote_name}"
        return group_method

    # ------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def workers(self) -> List[Any]:
        return list(self._workers)

    @property
    def worker_names(self) -> List[str]:
        return list(self._worker_names)

    # ------------------------------------------------------------- execution
    def _remote_name(self, method_name: str) -> str:
        if self._method_prefix and hasattr(self.worker_cls, self._method_prefix + method_name):
            return self._method_prefix + method_name
        if not callable(getattr(self.worker_cls, method_name, None)) or method_name.startswith("__"):
            raise AttributeError(f"{self.worker_cls.__name__} has no method {method_name!r}")
        return method_name

    def _submit(self, rank: int, method: str, args: Sequence[Any], kwargs: Dict[str, Any]):
        return getattr(self._workers[rank], method).remote(*args, **kwargs)

    def _get(self, refs: List[Any], ranks: List[int], method: str) -> List[Any]:
        """``ray.get`` in completion order so the first failure surfaces at once
        (a failed rank must not leave us waiting on peers stuck in a collective)."""
        index = {ref: i for i, ref in enumerate(refs)}
        results: List[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise self._wrap_error(e, ranks[i], method) from e
        return results

    def _wrap_error(self, err: BaseException, rank: int, method: str) -> WorkerError:
        cause = getattr(err, "cause", None)
        if isinstance(err, ray.exceptions.RayTaskError) and type(cause) is ray.exceptions.RayError:
            # Ray replaced an exception it could not pickle (e.g. pydantic's, raised in vLLM's
            # config) by a note; the original's text is at the end of the worker's traceback.
            what = exception_text(err.traceback_str)
        elif isinstance(err, ray.exceptions.RayTaskError) and cause is not None:
            what = f"{type(cause).__name__}: {cause}"
        elif isinstance(err, ray.exceptions.RayActorError):
            what = f"worker actor died ({err})"
        else:
            what = f"{type(err).__name__}: {err}"
        name = self._worker_names[rank] if rank < len(self._worker_names) else "?"
        msg = f"{self.worker_cls.__name__}.{method} failed on rank {rank} (actor {name}): {what}"
        return WorkerError(msg, rank=rank, method=method, cause=cause if isinstance(cause, BaseException) else None,
                           out_of_memory=isinstance(err, ray.exceptions.OutOfMemoryError))

    def _broadcast_args(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[tuple, dict]:
        """Put non-trivial arguments into the object store once instead of
        serializing them once per rank (Ray resolves top-level refs)."""
        if self._world_size == 1:
            return tuple(args), dict(kwargs)

        def put(x: Any) -> Any:
            if x is None or isinstance(x, (bool, int, float, str, bytes, ray.ObjectRef)):
                return x
            return ray.put(x)

        return tuple(put(a) for a in args), {k: put(v) for k, v in kwargs.items()}

    def _call(self, method: str, info: DispatchInfo, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        pending = self._start(method, info, args, kwargs)
        return pending.result() if info.blocking else pending.refs

    def _start(self, method: str, info: DispatchInfo, args: Sequence[Any], kwargs: Dict[str, Any]) -> "PendingCall":
        ws = self._world_size
        mode = info.dispatch
        if mode is Dispatch.RANK_ZERO:
            return PendingCall(self, method, info, [self._submit(0, method, args, kwargs)], 0)
        pad_size = 0
        if mode is Dispatch.ONE_TO_ALL:
            a, kw = self._broadcast_args(args, kwargs)
            per_args, per_kwargs = [a] * ws, [kw] * ws
        elif mode is Dispatch.ALL_TO_ALL:
            per_args, per_kwargs = split_all_to_all(ws, args, kwargs)
        elif mode is Dispatch.DP_COMPUTE and info.mesh is not None:
            layout = self._layout(info.mesh)
            per_args, per_kwargs, pad_size = split_by_layout(layout, args, kwargs)
        elif mode is Dispatch.DP_COMPUTE:
            per_args, per_kwargs, pad_size = split_dp_compute(ws, args, kwargs)
        else:  # pragma: no cover
            raise ValueError(f"unknown dispatch mode {mode}")
        return PendingCall(self, method, info, [self._submit(r, method, per_args[r], per_kwargs[r]) for r in range(ws)],
                           pad_size)

    def _finish(self, pending: "PendingCall") -> Any:
        info = pending.info
        if info.dispatch is Dispatch.RANK_ZERO:
            return self._get(pending.refs, [0], pending.method)[0]
        results = self._get(pending.refs, list(range(len(pending.refs))), pending.method)
        if info.dispatch is Dispatch.DP_COMPUTE:
            if info.mesh is not None:
                results = [results[rank] for rank in output_ranks(self._layout(info.mesh))]
            return collect_dp_compute(results, pending.pad_size)
        return results

    def _layout(self, mesh: str) -> List[RankLayout]:
        """Every rank's place in `mesh`'s data-parallel layout, asked once (after the model
        is built) and kept."""
        key = (self._method_prefix, mesh)
        if key not in self._layouts:
            method = self._remote_name("dispatch_layout")
            refs = [self._submit(r, method, (mesh,), {}) for r in range(self._world_size)]
            self._layouts[key] = self._get(refs, list(range(self._world_size)), method)
        return self._layouts[key]

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> List[Any]:
        """Run ``method_name`` (registered or not) on every rank with the same
        arguments and return the list of results (blocking)."""
        method = self._remote_name(method_name)
        a, kw = self._broadcast_args(args, kwargs)
        refs = [self._submit(r, method, a, kw) for r in range(self._world_size)]
        return self._get(refs, list(range(self._world_size)), method)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> List[Any]:
        """Like :meth:`execute_all` but returns the ObjectRefs."""
        method = self._remote_name(method_name)
        a, kw = self._broadcast_args(args, kwargs)
        return [self._submit(r, method, a, kw) for r in range(self._world_size)]

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method_name`` on rank 0 only and return its result (blocking)."""
        method = self._remote_name(method_name)
        return self._get([self._submit(0, method, args, kwargs)], [0], method)[0]

    # ------------------------------------------------------------ colocation
    def spawn(self, prefix_set: Iterable[str]) -> Dict[str, "RayWorkerGroup"]:
        """Per-role views of a group built from :func:`create_colocated_worker_cls`.

        Each view shares this group's actors; its methods are the role's
        registered methods, bound without the ``f"{role}_"`` prefix.
        """
        roles = tuple(getattr(self.worker_cls, "_colocated_roles", ()))
        views: Dict[str, RayWorkerGroup] = {}
        for role in prefix_set:
            if role not in roles:
                raise ValueError(f"{role!r} is not a role of {self.worker_cls.__name__} (roles: {list(roles)})")
            view = object.__new__(type(self))
            view.__dict__.update(
                {k: v for k, v in self.__dict__.items() if k not in self._bound_names}
            )
            view._method_prefix = f"{role}_"
            view._bind_methods()
            views[role] = view
        return views

    def kill(self) -> None:
        """Kill this group's actors (views share them)."""
        for w in self._workers:
            try:
                ray.kill(w)
            except Exception:  # pragma: no cover
                pass

    def __repr__(self) -> str:
        role = f", role={self._method_prefix[:-1]!r}" if self._method_prefix else ""
        return f"RayWorkerGroup({self.worker_cls.__name__}, world_size={self._world_size}{role})"
