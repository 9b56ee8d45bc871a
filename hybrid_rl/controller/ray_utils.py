"""Starting or joining Ray."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Dict, Optional

__all__ = ["init_ray"]

logger = logging.getLogger(__name__)


def init_ray(
    address: Optional[str] = None,
    num_cpus: Optional[float] = None,
    runtime_env: Optional[Dict[str, Any]] = None,
) -> str:
    """Make sure Ray is running in this process and return the mode used.

    * Ray already initialized -> nothing is done (``"existing"``).
    * ``address`` given, or ``RAY_ADDRESS`` set -> join that cluster
      (``"cluster"``); ``num_cpus`` is ignored there (the cluster's resources
      are fixed when its nodes start).
    * otherwise start a local single-node Ray with ``num_cpus`` (default
      ``os.cpu_count()``) and no dashboard (``"local"``).
    """
    import ray

    if ray.is_initialized():
        logger.info("init_ray: Ray already initialized; reusing it")
        return "existing"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_reachable(address)
        kwargs: Dict[str, Any] = {"address": address}
        if runtime_env is not None:
            kwargs["runtime_env"] = runtime_env
        logger.info("init_ray: joining existing Ray cluster at %s", address)
        ray.init(**kwargs, logging_level=logging.ERROR)
        return "cluster"
    n = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
    logger.debug("init_ray: starting a local Ray instance with num_cpus=%s (no dashboard)", n)
    # ERROR: Ray's start-up notices (token file written, instance started) are not news to a user.
    # address="local": a new instance even when `ray start` runs on this machine (Ray would join it).
    ray.init(address="local", num_cpus=n, include_dashboard=False, runtime_env=runtime_env,
             logging_level=logging.ERROR)
    return "local"


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail within `timeout_s` when nothing listens at a `host:port` cluster address: Ray's own
    connect retries take many minutes there. (`auto` and `ray://` addresses are left to Ray.)"""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address}: {exc}") from exc
