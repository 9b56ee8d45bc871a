"""`dtype: auto` follows the hardware: CPU flag sets and CUDA capabilities are injected, so every
branch runs on any machine."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys

import pytest

from hybrid_rl import hardware
from hybrid_rl.config import validate_config
from hybrid_rl.main import compose_config

AVX2_EPYC = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2".split())
AMX_XEON = AVX2_EPYC | frozenset("avx512f avx512bw avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8".split())
AVX512_BF16_ONLY = AVX2_EPYC | frozenset("avx512f avx512_bf16".split())
GRAVITON3 = frozenset("fp asimd sve bf16 i8mm".split())


@pytest.mark.parametrize("flags, expected", [(AVX2_EPYC, "float32"), (AMX_XEON, "bfloat16"),
                                             (AVX512_BF16_ONLY, "bfloat16"), (GRAVITON3, "bfloat16"),
                                             (frozenset(), "float32")])
@pytest.mark.parametrize("purpose", ["train", "engine"])
def test_auto_on_cpu_follows_the_bf16_flags(flags, expected, purpose):
    choice = hardware.resolve_dtype("auto", "cpu", purpose, flags=flags)
    assert choice.dtype == expected and choice.slow_because is None


def test_auto_reason_names_the_flags():
    choice = hardware.resolve_dtype("auto", "cpu", flags=AVX2_EPYC)
    assert choice.reason == "this CPU has no bf16 instructions (avx2 fma f16c)"
    assert "amx_bf16" in hardware.resolve_dtype("auto", "cpu", flags=AMX_XEON).reason


@pytest.mark.parametrize("requested", ["bf16", "bfloat16"])
def test_explicit_bf16_without_instructions_runs_with_a_measured_warning(requested):
    choice = hardware.resolve_dtype(requested, "cpu", flags=AVX2_EPYC)
    assert choice.dtype == "bfloat16"
    warning = choice.warning()
    assert "no bfloat16 instructions (avx2 fma f16c)" in warning and "slower than float32 here" in warning
    assert "GFLOP/s" in warning and "auto" in warning


@pytest.mark.parametrize("flags, requested", [(AMX_XEON, "bf16"), (AVX2_EPYC, "fp32"), (AVX2_EPYC, "float32"),
                                              (AMX_XEON, "float32")])
def test_explicit_choices_are_kept_silently_where_fast(flags, requested):
    choice = hardware.resolve_dtype(requested, "cpu", flags=flags)
    assert choice.dtype == hardware.CANONICAL[requested] and choice.warning() is None


@pytest.mark.parametrize("capability, train, engine", [((9, 0), "bfloat16", "bfloat16"), ((8, 0), "bfloat16", "bfloat16"),
                                                       ((7, 5), "float32", "float16"), ((7, 0), "float32", "float16")])
def test_auto_on_cuda_follows_the_capability(capability, train, engine):
    assert hardware.resolve_dtype("auto", "cuda", "train", capability=capability).dtype == train
    assert hardware.resolve_dtype("auto", "cuda", "engine", capability=capability).dtype == engine


def test_explicit_bf16_on_an_old_gpu_warns():
    choice = hardware.resolve_dtype("bf16", "cuda", capability=(7, 0))
    assert choice.dtype == "bfloat16" and "compute capability 7.0" in choice.warning()
    assert hardware.resolve_dtype("bf16", "cuda", capability=(9, 0)).warning() is None


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="bf32"):
        hardware.resolve_dtype("bf32", "cpu", flags=AVX2_EPYC)


def test_matmul_probe_measures_something():
    assert hardware.matmul_gflops("float32", size=64, min_seconds=0.01) > 0


@pytest.mark.parametrize("flags, expected", [(AVX2_EPYC, "float32"), (AMX_XEON, "bfloat16")])
def test_config_resolves_every_auto_and_logs_once(flags, expected, monkeypatch, caplog):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    with caplog.at_level(logging.INFO):
        cfg = validate_config(compose_config(["trainer.device=cpu"]))
    assert cfg.actor_rollout_ref.actor.fsdp_config.dtype == expected
    assert cfg.actor_rollout_ref.ref.fsdp_config.dtype == expected
    assert cfg.critic.fsdp_config.dtype == expected
    assert cfg.actor_rollout_ref.rollout.dtype == expected
    assert cfg.actor_rollout_ref.rollout.enforce_eager is True  # CPU: compiling does not pay back
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compute dtype")]
    assert lines == [f"compute dtype {expected} (trainer and rollout engine): "
                     + hardware.resolve_dtype("auto", "cpu", flags=flags).reason]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_config_keeps_explicit_choices_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: AVX2_EPYC)
    with caplog.at_level(logging.INFO):
        cfg = validate_config(compose_config([
            "trainer.device=cpu", "actor_rollout_ref.actor.fsdp_config.dtype=bf16",
            "actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.enforce_eager=false"]))
    assert cfg.actor_rollout_ref.actor.fsdp_config.dtype == "bfloat16"
    assert cfg.actor_rollout_ref.rollout.dtype == "bfloat16"
    assert cfg.actor_rollout_ref.rollout.enforce_eager is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no bfloat16 instructions" in warnings[0]


REALLOCATE = """
import resource, sys
import torch
from hybrid_rl import hardware
applied = hardware.keep_freed_host_memory() if sys.argv[1] == "keep" else False
for _ in range(3):  # later rounds find the earlier ones' memory freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    gradient_sized = torch.ones(40 * 2**20)  # 160 MiB, over glibc's largest own mmap threshold
    activations = [torch.ones(2**20) for _ in range(16)]  # 4 MiB blocks
    del gradient_sized, activations
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_host_memory_is_reused_without_page_faults():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", REALLOCATE, mode], capture_output=True, text=True, check=True)
        applied, count = out.stdout.split()
        return applied == "True", int(count)

    kept, reused = faults("keep")
    default, refaulted = faults("default")
    assert kept and not default
    # The 160 MiB block alone is ~41,000 faults of 4 KiB pages when the kernel hands it out again.
    assert refaulted > 30_000 and reused < 1_000, (refaulted, reused)


def test_host_memory_is_the_containers_limit_where_lower(tmp_path, monkeypatch):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(hardware, "CGROUP_MEMORY_LIMITS", (str(v2), str(v1)))
    assert hardware.host_memory_bytes() == physical  # neither file
    v1.write_text("9223372036854771712\n")  # v1 without a limit
    assert hardware.host_memory_bytes() == physical
    v2.write_text(f"{2**30}\n")
    assert hardware.host_memory_bytes() == 2**30
    v2.write_text("max\n")  # v2 without a limit: v1's file is read next
    v1.write_text(f"{3 * 2**30}\n")
    assert hardware.host_memory_bytes() == min(physical, 3 * 2**30)
