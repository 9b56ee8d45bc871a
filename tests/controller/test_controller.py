"""Single-controller layer on a local 2-CPU Ray cluster (no GPU)."""

from __future__ import annotations

import os
import re
import socket
import time

import pytest
import ray
import torch
from omegaconf import OmegaConf

from hybrid_rl.controller import (
    ClassWithInitArgs,
    Dispatch,
    PlacementError,
    RayWorkerGroup,
    ResourcePool,
    Worker,
    create_colocated_worker_cls,
    init_ray,
    register,
)
from hybrid_rl.controller.decorator import DISPATCH_ATTR, registered_methods
from hybrid_rl.controller.ray_utils import check_reachable
from hybrid_rl.controller.worker_group import WorkerError
from hybrid_rl.protocol import Batch, BatchMeta
from hybrid_rl.trainer import default_cpus_per_worker

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


# --------------------------------------------------------------------------- workers


class ProbeWorker(Worker):
    def __init__(self, marker: int = 0):
        super().__init__()
        self.marker = marker

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def env(self):
        return {
            "env": {k: os.environ.get(k) for k in ENV_KEYS},
            "attrs": (self.rank, self.world_size, self.local_rank),
            "pid": os.getpid(),
            "marker": self.marker,
        }

    @register(dispatch=Dispatch.RANK_ZERO)
    def whoami(self, tag):
        return (self.rank, tag)

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def echo(self, x, y=None):
        return (self.rank, x, y)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def tag_rows(self, batch, offset=0):
        n = len(batch)
        return Batch(
            tensors={
                "x": batch["x"] + offset,
                "rank": torch.full((n,), self.rank),
                "n": torch.full((n,), n),
            },
            non_tensors={"s": list(batch["s"])},
        )

    @register(dispatch=Dispatch.DP_COMPUTE)
    def count(self, batch):
        return (self.rank, len(batch), batch["x"].tolist())

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def fail_on_rank_one(self, msg):
        if self.rank == 1:
            raise ValueError(f"boom {msg}")
        return "ok"

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def fail_unpicklably(self):
        import threading

        class LockedError(ValueError):  # as pydantic's errors: Ray cannot pickle it
            def __init__(self, message):
                super().__init__(message)
                self.lock = threading.Lock()

        raise LockedError("bad setting\n  Value error, heads (9) must be divisible by 2")

    @register(dispatch=Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, v):
        return v * 10 + self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_reduce(self):
        import torch.distributed as dist

        self.init_process_group()
        self.init_process_group()  # idempotent
        t = torch.full((4,), float(self.rank + 1))
        dist.all_reduce(t)
        return dist.get_backend(), t.tolist()

    def plain(self):  # not registered: reachable through execute_all only
        return self.rank * 2


class ActorRole(Worker):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.init_process_group()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self):
        return (self.rank, os.getpid())

    @register(dispatch=Dispatch.DP_COMPUTE)
    def scale_rows(self, batch):
        return Batch(tensors={"x": batch["x"] * self.scale})


class CriticRole(Worker):
    def __init__(self):
        super().__init__()
        self.init_process_group()  # second call in the same process: no-op

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self):
        return (self.rank, os.getpid())

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sum_ranks(self):
        import torch.distributed as dist

        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return t.item()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    if ray.is_initialized():
        ray.shutdown()
    # Ray workers unpickle the worker classes of this module by reference, so
    # they need this directory (and the repo root) on their import path.
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    path = os.pathsep.join(p for p in (here, repo, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def _batch(n):
    return Batch(
        tensors={"x": torch.arange(n, dtype=torch.float32)},
        non_tensors={"s": [f"row{i}" for i in range(n)]},
        meta=BatchMeta(temperature=0.5),
    )


# --------------------------------------------------------------------------- pure tests


def test_register_keeps_direct_behaviour():
    w = ProbeWorker(marker=3)  # plain process: defaults
    assert (w.rank, w.world_size, w.local_rank) == (0, 1, 0)
    assert w.whoami("t") == (0, "t")
    assert getattr(ProbeWorker.whoami, DISPATCH_ATTR).dispatch is Dispatch.RANK_ZERO
    infos = registered_methods(ProbeWorker)
    assert "plain" not in infos and "get_node_info" in infos
    assert infos["later"].blocking is False


def test_init_ray_reuses_running_session():
    assert init_ray() == "existing"


def test_resource_pool_too_big_fails_clearly():
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as exc:
        ResourcePool([3], use_gpu=False, cpus_per_process=1.0, timeout_s=3)
    assert time.monotonic() - t0 < 20
    msg = str(exc.value)
    assert "3 CPUs" in msg and "CPU=2" in msg
    assert re.search(r"1 node\(s\): [\d.]+ CPU=2 GPU=0\)", msg)  # each node's resources
    assert "n_gpus_per_node" in msg and "cpus_per_worker" in msg


def test_a_cluster_address_where_nothing_listens_fails_at_once():
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"nothing answers at 127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10
    check_reachable("auto")  # left to Ray
    check_reachable("ray://head:10001")


def test_default_cpus_per_worker_is_a_share_of_the_smallest_node():
    trainer = OmegaConf.create({"device": "cpu", "n_gpus_per_node": 4})
    assert default_cpus_per_worker(trainer) == 0.5  # this session's one node has 2 CPUs
    assert default_cpus_per_worker(OmegaConf.merge(trainer, {"n_gpus_per_node": 1})) == 2


# --------------------------------------------------------------------------- 2 x 1.0 CPU


@pytest.fixture(scope="class")
def wg():
    pool = ResourcePool([2], use_gpu=False, cpus_per_process=1.0)
    group = RayWorkerGroup(
        pool, ClassWithInitArgs(ProbeWorker, marker=7), name_prefix="t1_", env_vars={"OMP_NUM_THREADS": "2"}
    )
    yield group
    group.kill()
    pool.remove()


class TestFullCpuWorkers:
    def test_one_to_all_env(self, wg):
        assert wg.world_size == 2 and len(wg.workers) == 2
        out = wg.env()
        assert isinstance(out, list) and len(out) == 2
        for rank, o in enumerate(out):
            e = o["env"]
            assert e["RANK"] == str(rank) and e["WORLD_SIZE"] == "2"
            assert e["LOCAL_RANK"] == str(rank) and e["LOCAL_WORLD_SIZE"] == "2"
            assert e["MASTER_ADDR"] and int(e["MASTER_PORT"]) > 0
            assert e["OMP_NUM_THREADS"] == "2"
            assert o["attrs"] == (rank, 2, rank)
            assert o["marker"] == 7
        assert out[0]["env"]["MASTER_PORT"] == out[1]["env"]["MASTER_PORT"]
        assert out[0]["pid"] != out[1]["pid"]
        assert wg.worker_names == ["t1_ProbeWorker_0:0", "t1_ProbeWorker_0:1"]
        info = wg.get_node_info()
        assert [i["rank"] for i in info] == [0, 1]

    def test_rank_zero_and_all_to_all(self, wg):
        assert wg.whoami("hi") == (0, "hi")
        assert wg.echo([1, 2], y=["a", "b"]) == [(0, 1, "a"), (1, 2, "b")]
        with pytest.raises(ValueError, match="ALL_TO_ALL"):
            wg.echo([1, 2, 3])

    @pytest.mark.parametrize("n", [4, 5, 7, 1])
    def test_dp_compute(self, wg, n):
        out = wg.tag_rows(_batch(n), offset=0.5)
        assert isinstance(out, Batch) and len(out) == n
        assert torch.equal(out["x"], torch.arange(n, dtype=torch.float32) + 0.5)
        assert list(out["s"]) == [f"row{i}" for i in range(n)]
        half = (n + 1) // 2  # padded length / 2
        assert out["rank"].tolist() == [0] * half + [1] * (n - half)
        assert set(out["n"].tolist()) == {half}
        # Batch as keyword argument
        out_kw = wg.tag_rows(batch=_batch(n))
        assert torch.equal(out_kw["x"], torch.arange(n, dtype=torch.float32))
        assert out_kw["rank"].tolist() == [0] * half + [1] * (n - half)

    def test_dp_compute_non_batch_result(self, wg):
        out = wg.count(_batch(5))
        assert out == [(0, 3, [0.0, 1.0, 2.0]), (1, 3, [3.0, 4.0, 0.0])]  # last row is padding

    def test_error_surfaces_with_rank(self, wg):
        with pytest.raises(WorkerError, match=r"rank 1.*ValueError: boom xyz") as exc:
            wg.fail_on_rank_one("xyz")
        assert exc.value.rank == 1 and isinstance(exc.value.cause, ValueError)
        assert wg.fail_on_rank_one.__name__ == "fail_on_rank_one"
        with pytest.raises(AttributeError, match="no_such_method"):
            wg.execute_all("no_such_method")

    def test_an_exception_ray_cannot_pickle_keeps_its_message(self, wg):
        with pytest.raises(WorkerError, match=r"rank \d.*LockedError: bad setting\n  Value error, heads \(9\) must"):
            wg.fail_unpicklably()

    def test_non_blocking_and_execute_helpers(self, wg):
        refs = wg.later(4)
        assert all(isinstance(r, ray.ObjectRef) for r in refs)
        assert ray.get(refs) == [40, 41]
        assert wg.execute_all("plain") == [0, 2]
        assert wg.execute_rank_zero("whoami", "z") == (0, "z")

    def test_gloo_all_reduce(self, wg):
        out = wg.all_reduce()
        assert out == [("gloo", [3.0] * 4)] * 2


# --------------------------------------------------------------------------- 0.5 CPU + colocation


class TestHalfCpuAndColocation:
    def test_half_cpu_colocated_roles(self):
        pool = ResourcePool([2], cpus_per_process=0.5)
        colo_cls = create_colocated_worker_cls(
            {"actor": ClassWithInitArgs(ActorRole, 3.0), "critic": ClassWithInitArgs(CriticRole)}
        )
        colo = RayWorkerGroup(pool, colo_cls, name_prefix="colo_")
        try:
            assert [i["rank"] for i in colo.get_node_info()] == [0, 1]
            # colocated: both roles live in the same process on every rank
            assert hasattr(colo, "actor_scale_rows") and hasattr(colo, "critic_sum_ranks")
            views = colo.spawn({"actor", "critic"})
            actor, critic = views["actor"], views["critic"]
            assert actor.workers == colo.workers
            assert actor.pid() == critic.pid()
            assert [r for r, _ in actor.pid()] == [0, 1]
            assert len({p for _, p in actor.pid()}) == 2
            out = actor.scale_rows(_batch(5))
            assert torch.equal(out["x"], torch.arange(5, dtype=torch.float32) * 3.0)
            assert critic.sum_ranks() == [1.0, 1.0]  # process group made by the actor role
            assert not hasattr(actor, "sum_ranks") and not hasattr(critic, "scale_rows")
            assert actor.execute_all("pid") == actor.pid()
            with pytest.raises(ValueError):
                colo.spawn({"reward"})
        finally:
            colo.kill()
            pool.remove()


def test_a_failed_join_is_told_by_its_telling_line():
    from hybrid_rl.main import join_failure

    try:
        try:
            raise RuntimeError("Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
                               "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication "
                               "token is missing or incorrect. Note: RAY_AUTH_MODE is currently 'disabled'")
        except RuntimeError as inner:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from inner
    except ConnectionError as exc:
        assert join_failure(exc) == ("ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: "
                                     "Authentication token is missing or incorrect")
    assert join_failure(ConnectionError("nothing answers at h:1: [Errno 111] Connection refused")) == (
        "nothing answers at h:1: [Errno 111] Connection refused")


def test_rendezvous_ports_come_from_below_the_ephemeral_range_and_leave_the_seeded_rng_alone():
    """Outgoing connections take their local ports from the kernel's ephemeral range, so a
    rendezvous port picked there can be taken before rank 0 listens on it."""
    import random

    from hybrid_rl.controller.worker import _ephemeral_low, get_free_port

    low = _ephemeral_low()
    state = random.getstate()
    ports = {get_free_port("127.0.0.1") for _ in range(5)}
    assert random.getstate() == state
    assert all(20000 <= port < low for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()
