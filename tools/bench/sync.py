#!/usr/bin/env python
"""Weight-push speed: our sync path (`weight_sync.sync_weights`, the actor's training engine -> in-process vLLM)
against a plain memory copy of the same size measured in the same process.

    python tools/bench/sync.py [--models smollm2-135m,qwen2.5-0.5b-shape] [--dtype float32,bfloat16]
                               [--pushes 5] [--device cpu|cuda] [--json out.json]

Each (model, engine dtype) case runs in its own process, set up as one worker rank: a 1-rank
process group, the actor's engine as the worker builds it (`engines.build_engine`: FSDP2, fp32
masters), then a `VLLMRollout` with `rollout.dtype` set to the engine dtype. Before every push
a one-token generate leaves the engine as a training step leaves it (on GPU: asleep). One warm-up
push, then the median of `--pushes`. Also timed: the gather alone
(`TrainEngine.per_tensor_weights`, no engine), and `Tensor.copy_` of the same number of elements from fp32 into preallocated memory
of the engine dtype (a plain copy for fp32, a cast for bf16), through 64 Mi-element buffers. Every GB/s
counts the bytes that land in the engine's dtype, as `sync_weights` does.

`qwen2.5-0.5b-shape` is a seeded random model with Qwen2.5-0.5B's shape (494M parameters, tied
embeddings) and SmolLM2's tokenizer, built once in the hybrid_rl cache folder (`common.random_model`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import common

MODELS = ("smollm2-135m", "qwen2.5-0.5b-shape")


def model_path(name: str) -> str:
    from hybrid_rl.models import resolve_model_path

    if name == "smollm2-135m":
        return resolve_model_path(None)
    return common.random_model("qwen2.5-0.5b")


def timed(fn, device_type: str) -> float:
    import torch

    start = time.perf_counter()
    fn()
    if device_type == "cuda":
        torch.cuda.synchronize()  # copies into the engine are asynchronous on GPU
    return time.perf_counter() - start


def copy_reference(numel: int, dtype, device, repeats: int, chunk: int = 2**26) -> list[float]:
    """Seconds per `copy_` of `numel` fp32 elements into preallocated memory of `dtype`, through
    buffers of at most `chunk` elements: far larger than any cache, so the rate is the memory
    bandwidth, without holding another copy of the model next to the actor and the engine."""
    import torch

    size = min(numel, chunk)
    full, rest = divmod(numel, size)
    src = torch.ones(size, dtype=torch.float32, device=device)
    dst = torch.empty(size, dtype=dtype, device=device)

    def copy():
        for _ in range(full):
            dst.copy_(src)
        if rest:
            dst[:rest].copy_(src[:rest])

    timed(copy, device.type)  # first touch of dst's pages
    return [timed(copy, device.type) for _ in range(repeats)]


def measure(cfg_dict: dict, path: str, device_type: str, pushes: int) -> dict:
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from hybrid_rl.engines import ModelSpec, build_engine
    from hybrid_rl.protocol import Batch
    from hybrid_rl.workers.actor_rollout_ref import eos_ids
    from hybrid_rl.workers.rollout import VLLMRollout, greedy_settings
    from hybrid_rl.workers.weight_sync import sync_weights

    common.init_single_rank(device_type)
    cfg = OmegaConf.create(cfg_dict)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    # As ActorRolloutRefWorker.init_model: the actor's engine (fp32 masters, bf16 compute only on GPU).
    actor_cfg = cfg.actor_rollout_ref.actor
    engine = build_engine(ModelSpec("actor", path, cfg.actor_rollout_ref.model, optim_cfg=actor_cfg.optim),
                          actor_cfg, device)
    params = engine.num_params()

    tokenizer = AutoTokenizer.from_pretrained(path)
    rollout_cfg = cfg.actor_rollout_ref.rollout
    rollout = VLLMRollout(path, rollout_cfg, device, eos_ids(path, tokenizer))
    ids = tokenizer("Calculate 2 + 3.")["input_ids"]
    prompt = Batch({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)})

    sent = []

    def push() -> float:
        rollout.generate(prompt, greedy_settings(), 1)
        return timed(lambda: sent.append(sync_weights(engine, rollout)), device_type)

    warmup = push()
    push_s = [push() for _ in range(pushes)]
    # Our side of the push alone: gather each full tensor, as sync_weights does, no engine.
    gather_s = [timed(lambda: deque(engine.per_tensor_weights(None), maxlen=0), device_type)
                for _ in range(pushes)]
    pushed = sent[-1]
    numel = pushed // torch.empty(0, dtype=rollout.dtype).element_size()
    copy_s = copy_reference(numel, rollout.dtype, device, pushes)

    push_med, copy_med = statistics.median(push_s), statistics.median(copy_s)
    return {
        "params": params, "engine_dtype": str(rollout.dtype), "bytes_pushed": pushed,
        "tensors_pushed": sum(1 for _ in engine.per_tensor_weights(rollout.dtype)),
        "warmup_push_seconds": warmup, "push_seconds": push_s, "median_push_seconds": push_med,
        "push_gb_per_s": pushed / push_med / 1e9,
        # The least disturbed push: on a shared machine the median can still carry others' load.
        "best_push_gb_per_s": pushed / min(push_s) / 1e9,
        "gather_seconds": gather_s, "median_gather_seconds": statistics.median(gather_s),
        "copy_kind": f"float32->{str(rollout.dtype).removeprefix('torch.')}",
        "copy_seconds": copy_s, "copy_gb_per_s": pushed / copy_med / 1e9,
        "push_over_copy": copy_med / push_med,  # push GB/s as a fraction of copy GB/s
        "torch_threads": torch.get_num_threads(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--dtype", default="float32,bfloat16", help="engine dtypes, comma-separated")
    ap.add_argument("--pushes", type=int, default=5, help="timed pushes after the warm-up")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")

    import torch
    from omegaconf import OmegaConf

    from hybrid_rl.main import compose_config

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for name in models:
        path = model_path(name)
        for dtype in dtypes:
            cfg = compose_config([f"actor_rollout_ref.model.path={path}", f"actor_rollout_ref.rollout.dtype={dtype}"])
            case = common.run_isolated(measure, OmegaConf.to_container(cfg, resolve=True), path, device_type,
                                       args.pushes)
            results.append({"model": name, "model_path": path, **case})

    result = common.header({"device": device_type, "models": models, "dtypes": dtypes, "pushes": args.pushes})
    result["results"] = results

    print(f"\nweight push, {device_type}, median of {args.pushes} pushes (GB = 1e9 bytes in the engine dtype)")
    print(f"{'model':<20}{'engine':<10}{'GB':>7}{'s/push':>9}{'GB/s':>8}{'gather s':>15}"
          f"{'copy':>18}{'copy GB/s':>11}{'push/copy':>11}")
    for r in results:
        print(f"{r['model']:<20}{r['engine_dtype'].removeprefix('torch.'):<10}{r['bytes_pushed'] / 1e9:>7.3f}"
              f"{r['median_push_seconds']:>9.3f}{r['push_gb_per_s']:>8.2f}{r['median_gather_seconds']:>15.3f}"
              f"{r['copy_kind']:>18}{r['copy_gb_per_s']:>11.2f}{r['push_over_copy']:>11.3f}")
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
