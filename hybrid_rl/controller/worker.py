"""Base class for every Ray actor driven by a worker group."""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
from typing import Any, Dict, Optional, Tuple

from hybrid_rl.controller.decorator import Dispatch, register

__all__ = ["Worker", "get_node_ip", "get_free_port", "set_env"]

logger = logging.getLogger(__name__)


# Ray's default worker ports are 10002-19999; listening ports are picked above them.
_LISTEN_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux; the IANA range's elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def get_free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago on this machine, outside the range the kernel gives
    to outgoing connections: a port picked from that range (binding port 0 picks one) can become
    some connection's local port before the rendezvous listens on it (EADDRINUSE; seen when Ray's
    processes start between the pick and the listen)."""
    low = _ephemeral_low()
    # A generator of its own: the global one's state belongs to the seeded run.
    candidates = random.Random().sample(range(_LISTEN_PORTS_FROM, low), min(64, max(low - _LISTEN_PORTS_FROM, 0)))
    for port in [*candidates, 0]:  # 0: the kernel's pick, when nothing below the range is free
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free TCP port on this machine")


def get_node_ip() -> str:
    """IP address of this node as Ray sees it (falls back to a socket probe)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover - ray missing / odd network setups
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:  # pragma: no cover
        return "127.0.0.1"


def set_env(values: dict[str, str]) -> None:
    """Set each environment variable that does not have its value yet. A Ray worker runs threads
    of Ray's own (its metrics exporter) that read the environment, and a write racing such a read
    can crash the process; the worker group sets these variables before the process starts
    (`trainer.worker_env`), so in a worker this writes nothing."""
    for key, value in values.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


class Worker:
    """Base class for the workers of a :class:`RayWorkerGroup`.

    The group passes the torchrun-style variables ``RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT`` through the Ray
    runtime env; ``__init__`` only reads them (it never touches
    ``os.environ``), with single-process defaults 0/1/0/1/127.0.0.1/free port.
    """

    def __init__(self) -> None:
        env = os.environ
        self.rank: int = int(env.get("RANK", "0"))
        self.world_size: int = int(env.get("WORLD_SIZE", "1"))
        self.local_rank: int = int(env.get("LOCAL_RANK", "0"))
        self.local_world_size: int = int(env.get("LOCAL_WORLD_SIZE", "1"))
        self.master_addr: str = env.get("MASTER_ADDR", "127.0.0.1")
        port = env.get("MASTER_PORT")
        self.master_port: int = int(port) if port else get_free_port()
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"invalid RANK={self.rank} for WORLD_SIZE={self.world_size}")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def get_master_addr_port() -> Tuple[str, int]:
        """(ip of this node, a free port on it): used for rank 0's rendezvous."""
        return get_node_ip(), get_free_port()

    def init_process_group(self, backend: Optional[str] = None, timeout_s: float = 600) -> None:
        """Join the default ``torch.distributed`` process group (idempotent).

        ``backend`` defaults to NCCL for CUDA tensors and gloo for CPU ones
        (FSDP2's CPU-offloaded shards) when CUDA is available, else to
        ``"gloo"``.  A second call in the same process (e.g. another colocated
        role) is a no-op.
        """
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise RuntimeError(
                    f"a process group already exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                    f"but this worker is rank {self.rank}/{self.world_size}"
                )
            return
        if backend is None:
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if "nccl" in backend and torch.cuda.is_available():
            # Ray restricts CUDA_VISIBLE_DEVICES per actor, so the local device is usually 0.
            n = torch.cuda.device_count()
            torch.cuda.set_device(self.local_rank % n if n > 1 else 0)
        init_method = f"tcp://{self.master_addr}:{self.master_port}"
        logger.debug("rank %d/%d joining %s (%s)", self.rank, self.world_size, init_method, backend)
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def get_node_info(self) -> Dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "ip": get_node_ip(),
            "pid": os.getpid(),
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"
