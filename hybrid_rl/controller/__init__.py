"""Single-controller layer: a driver process steers groups of Ray actors.

See ``decorator.py`` (dispatch modes), ``worker.py`` (actor base class),
``worker_group.py`` (resource pools, worker groups, colocation) and
``ray_utils.py`` (starting / joining Ray).
"""

from hybrid_rl.controller.decorator import Dispatch, DispatchInfo, RankLayout, register
from hybrid_rl.controller.ray_utils import init_ray
from hybrid_rl.controller.worker import Worker
from hybrid_rl.controller.worker_group import (
    ClassWithInitArgs,
    PlacementError,
    RayWorkerGroup,
    ResourcePool,
    WorkerError,
    create_colocated_worker_cls,
)

__all__ = [
    "Dispatch",
    "DispatchInfo",
    "RankLayout",
    "register",
    "Worker",
    "ResourcePool",
    "PlacementError",
    "ClassWithInitArgs",
    "RayWorkerGroup",
    "WorkerError",
    "create_colocated_worker_cls",
    "init_ray",
]
