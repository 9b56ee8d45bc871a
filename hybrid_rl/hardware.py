"""What this machine computes fast: the `dtype: auto` of the trainer and the rollout engine,
chosen from the CPU's instruction set or the GPU's compute capability (and, on CPU, how the host
allocator reuses freed memory: `keep_freed_host_memory`).

Without bf16 instructions a CPU runs bfloat16 matmuls in software: on an AVX2-only AMD EPYC a
1024x1024 matmul on 2 threads runs at 1.0 GFLOP/s in bf16 against 155 GFLOP/s in float32, so
`auto` means bfloat16 only where the hardware has it (AVX512_BF16 or AMX on x86, the BF16
extension on Arm, CUDA capability 8.0 or newer) and float32 (on pre-Ampere GPUs, float16 for the
engine) elsewhere. An explicit bf16 where it is slow still runs, with one warning that says what
it costs.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

# Instruction-set flags (as /proc/cpuinfo spells them) that make bf16 matmuls fast.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# The flags worth naming when a choice is explained, strongest first.
CPU_SIMD_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx_vnni", "avx2", "fma",
                  "f16c", "sve", "asimd", "bf16")
CANONICAL = {"auto": "auto", "fp32": "float32", "float32": "float32", "bf16": "bfloat16",
             "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
PURPOSES = ("train", "engine")
# Every spelling a config may use for a concrete dtype, as torch names it.
TORCH_DTYPES = {name: getattr(torch, dtype) for name, dtype in CANONICAL.items() if dtype != "auto"}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # float32, bfloat16 or float16
    reason: str  # why, in words, for the one start-up line
    slow_because: str | None = None  # set when an explicit choice is slow or unsupported here

    def warning(self) -> str | None:
        """What the explicit choice costs, measured on a CPU (a ~0.1 s probe), or None."""
        if self.slow_because is None:
            return None
        cost = f", {slowdown_text(self.dtype)}" if self.slow_because.startswith("this CPU") else ""
        return (f"{self.dtype} was set explicitly, but {self.slow_because}{cost}. Set the dtype to auto "
                "to compute at full speed.")


def cpu_model() -> str:
    return _cpuinfo_field(("model name", "Model name")) or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features` of /proc/cpuinfo); empty where unknown,
    which `auto` treats as "no bf16 instructions"."""
    return frozenset((_cpuinfo_field(("flags", "Features")) or "").split())


def _cpuinfo_field(names: tuple[str, ...]) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in names:
                    return value.strip()
    except OSError:
        pass
    return None


def simd_summary(flags: frozenset[str]) -> str:
    named = [f for f in CPU_SIMD_FLAGS if f in flags]
    return " ".join(named) if named else "no SIMD flags reported"


def cuda_capability() -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def resolve_dtype(requested: str, device_type: str, purpose: str = "train",
                  flags: frozenset[str] | None = None,
                  capability: tuple[int, int] | None = None) -> DtypeChoice:
    """The dtype that `requested` (auto, or an explicit name) means on this hardware.

    `purpose` is "train" (the trainer's compute dtype; fp32 master weights are kept either way) or
    "engine" (the rollout engine's weights). `flags` and `capability` default to this machine's;
    tests pass their own.
    """
    if requested not in CANONICAL:
        raise ValueError(f"dtype {requested!r} is not one of {', '.join(CANONICAL)}")
    if purpose not in PURPOSES:
        raise ValueError(f"purpose {purpose!r} is not one of {', '.join(PURPOSES)}")
    requested = CANONICAL[requested]
    if device_type == "cuda":
        return _resolve_cuda(requested, purpose, capability if capability is not None else cuda_capability())
    return _resolve_cpu(requested, cpu_flags() if flags is None else flags)


def _resolve_cpu(requested: str, flags: frozenset[str]) -> DtypeChoice:
    fast_bf16 = [f for f in CPU_BF16_FLAGS if f in flags]
    simd = simd_summary(flags)
    if requested == "auto":
        if fast_bf16:
            return DtypeChoice("bfloat16", f"this CPU has bf16 instructions ({simd})")
        return DtypeChoice("float32", f"this CPU has no bf16 instructions ({simd})")
    if requested == "float32":
        return DtypeChoice("float32", "set explicitly")
    half_flags = fast_bf16 if requested == "bfloat16" else [f for f in ("avx512_fp16", "amx_fp16") if f in flags]
    if half_flags:
        return DtypeChoice(requested, "set explicitly")
    return DtypeChoice(requested, "set explicitly",
                       slow_because=f"this CPU has no {requested} instructions ({simd}): its matmuls run in software")


def _resolve_cuda(requested: str, purpose: str, capability: tuple[int, int] | None) -> DtypeChoice:
    has_bf16 = capability is not None and capability >= (8, 0)
    arch = f"compute capability {capability[0]}.{capability[1]}" if capability else "unknown compute capability"
    if requested == "auto":
        if has_bf16:
            return DtypeChoice("bfloat16", f"this GPU supports bf16 ({arch})")
        if purpose == "engine":
            return DtypeChoice("float16", f"this GPU has no bf16 ({arch}); the engine runs in float16")
        # fp16 training needs loss scaling, which the trainer does not do: train in fp32.
        return DtypeChoice("float32", f"this GPU has no bf16 ({arch})")
    if requested == "bfloat16" and not has_bf16:
        return DtypeChoice(requested, "set explicitly",
                           slow_because=f"this GPU has no bf16 support ({arch}; needs 8.0+): it is emulated or fails")
    return DtypeChoice(requested, "set explicitly")


def slowdown_text(dtype: str) -> str:
    """`dtype` matmul speed against float32's on this CPU, from a short probe (~0.1 s)."""
    fp32, half = matmul_gflops("float32"), matmul_gflops(dtype)
    return f"{fp32 / max(half, 1e-9):.0f}x slower than float32 here ({half:.1f} vs {fp32:.1f} GFLOP/s)"


def matmul_gflops(dtype: str, size: int = 256, min_seconds: float = 0.05) -> float:
    """Measured GFLOP/s of a size x size matmul on the CPU in `dtype`."""
    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    a @ b  # first call: kernel selection
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 2:
        a @ b
        calls += 1
    return 2 * size**3 * calls / elapsed / 1e9


# glibc's mallopt parameters (malloc.h) and the largest block kept in its heap.
def enable_full_determinism() -> None:
    """verl's `fsdp_config.full_determinism`: torch's deterministic kernels wherever it has a
    choice (warning where an op has none), cuDNN's too, and the settings cuBLAS, NCCL and
    flash-attention read for theirs. The switches are per process, so every engine in the worker
    gets them (as verl's do). cuBLAS reads its workspace setting when the process first uses it,
    so it holds only where this runs before the first matmul on the GPU (engines are built
    first). Seeds stay as trainer.seed sets them."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    os.environ["NCCL_DETERMINISTIC"] = "1"
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"  # read by transformers' flash-attention path
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCK_LIMIT = 1 << 30


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse in a CPU training process: blocks up to
    1 GiB come from its heap, and the heap is never trimmed. By default a freed block over a
    threshold of at most 32 MiB (SmolLM2's 113 MB embedding gradient) goes back to the kernel, as
    does free memory at the heap's top, and the next step faults it in again page by page as
    zeroes: ~64,000 page faults per default update in the engine alone, none with this (the
    update ~4 % shorter); in the job's worker ~45,000 become ~15,000. Resident memory then stays
    at its peak, which rose by up to 0.2 GB in the jobs measured (docs/benchmarks.md).
    Returns whether it applied (glibc only; other C libraries keep their behaviour)."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT)
                                     and libc.mallopt(_M_TRIM_THRESHOLD, -1))


def return_large_freed_blocks() -> bool:
    """The opposite of `keep_freed_host_memory`, for measuring: every freed block over 128 KiB
    goes back to the kernel at once (a fixed mmap threshold), so the resident set follows the
    live tensors. Returns whether it applied (glibc only)."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024))


def return_freed_host_memory() -> None:
    """Hand the free memory in glibc's heap back to the kernel once (`malloc_trim`): after
    load-time copies are freed, which `keep_freed_host_memory` would otherwise keep resident."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc():
    """This process's glibc (ctypes), or None under another C library or OS."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    import ctypes

    return ctypes.CDLL("libc.so.6")


# A container's memory limit: cgroup v2, then v1 (whose "no limit" is a huge number).
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """This machine's memory, or the control group's limit where one is set lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_MEMORY_LIMITS:
        try:
            with open(path) as limit:
                return min(total, int(limit.read()))
        except (OSError, ValueError):  # no such file, or v2's "max"
            continue
    return total


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA allocations on GPU, the peak resident set on CPU
    (in a worker: trainer, reference and the vLLM engine together)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
