#!/usr/bin/env python
"""A training engine alone (FSDP or Megatron, CPU or GPU): update time, how close the update gets
to the matmul peak measured in the same run (MFU; before and after the steps, the higher counts), log-prob inference time, the time to gather
the full weights for a rollout sync, and peak memory. No Ray, no rollout engine.

    python tools/bench/engine.py --strategy fsdp|megatron [--shape qwen2.5-0.5b | --model DIR]
        [--prompts 16 --responses 8 --prompt-len 256 --response-len 768] [--steps 4] [--json out.json]
        [dotted overrides ...]
    torchrun --nproc-per-node 2 tools/bench/engine.py --strategy megatron \\
        actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2

The batch is a GRPO batch of `--prompts` prompts x `--responses` responses: each group shares its prompt,
response lengths are uniform between half and all of `--response-len` (the same on every run of
the same arguments), advantages are random. One update is one optimizer step over the whole
batch (ppo_mini_batch_size = prompts) with the on-policy GRPO loss; every other setting is the
config's (`--config-name` ppo_trainer or ppo_megatron_trainer) plus the overrides. Figures are the
mean over the steps after the first (warm-up).

FLOPs are counted as in `step.py`: 6 x non-embedding parameters x tokens the forward computes,
plus 6 x LM-head parameters x response tokens; attention scores are left out, so MFU is a slight
underestimate. `--shape` builds random weights of a public checkpoint's shape (speed does not
depend on the values).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def init_process_group(device_type: str) -> None:
    """torchrun's process group when launched by it, else a one-rank group (no port needed)."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        folder = tempfile.mkdtemp(prefix="bench_engine_pg_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        init_method = f"file://{os.path.join(folder, 'init')}"
    else:
        init_method = "env://"
    backend = "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "cpu:gloo,cuda:nccl"  # what Worker.init_process_group picks on GPU
    dist.init_process_group(backend, init_method=init_method, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def grpo_batch(prompts: int, n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """`prompts` x `n` rows: full-length prompts shared within each group, right-padded responses."""
    import torch

    from hybrid_rl.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    rows = prompts * n
    prompt = torch.randint(100, vocab, (prompts, prompt_len), generator=g).repeat_interleave(n, 0)
    responses = torch.randint(100, vocab, (rows, response_len), generator=g)
    lengths = torch.randint(response_len // 2, response_len + 1, (rows,), generator=g)
    response_mask = (torch.arange(response_len) < lengths[:, None]).long()
    responses = responses * response_mask
    mask = torch.cat([torch.ones_like(prompt), response_mask], 1)
    return Batch(tensors={"input_ids": torch.cat([prompt, responses], 1), "attention_mask": mask,
                          "position_ids": (mask.cumsum(1) - 1).clamp_min(0), "responses": responses,
                          "response_mask": response_mask.float(),
                          "advantages": torch.randn(rows, 1, generator=g).expand(-1, response_len).contiguous()})


def grpo_loss(actor_cfg):
    """The actor's on-policy loss (ratio 1), as `update_actor` computes it without a KL term."""
    from hybrid_rl.algorithms import aggregate_loss
    from hybrid_rl.algorithms.policy_loss import get_policy_loss

    policy_loss = get_policy_loss(actor_cfg.policy_loss.loss_mode)
    mode = actor_cfg.loss_agg_mode

    def loss_fn(out, micro, agg_kwargs):
        log_prob, mask = out["log_probs"], micro["response_mask"]
        loss, _ = policy_loss(log_prob.detach(), log_prob, micro["advantages"], mask, loss_agg_mode=mode,
                              config=actor_cfg, agg_kwargs=agg_kwargs)
        entropy = aggregate_loss(out["entropy"].detach(), mask, mode, **agg_kwargs)
        return loss, {"pg_loss": float(loss.detach()), "entropy": float(entropy)}

    return loss_fn


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", choices=("fsdp", "megatron"), default="fsdp")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--model", help="a Hugging Face folder (default: the default model)")
    source.add_argument("--shape", choices=sorted(common.MODEL_SHAPES), help="random weights of this shape")
    ap.add_argument("--stored-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="with --shape: the dtype its weights are written in (Qwen2.5's checkpoints: bfloat16)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--responses", type=int, default=8, help="responses per prompt (rollout.n)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=768)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when there is one")
    ap.add_argument("--matmul-size", type=int, default=None, help="default 2048 on CPU, 8192 on CUDA")
    ap.add_argument("--live-memory", action="store_true",
                    help="CPU: malloc returns every freed block over 128 KiB (instead of keeping freed memory "
                         "as the job does), so that the resident set follows live tensors, and the last update's "
                         "peak above the memory held before it is reported (activations, gradients)")
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--profile", help="after the timed steps, profile one more update with torch.profiler and "
                                      "write its operators, most time first, to this text file (rank 0)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # overrides may come before and after options

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.engines import ModelSpec, Output, build_engine
    from hybrid_rl.engines.lora import enabled as lora_enabled
    from hybrid_rl.hardware import keep_freed_host_memory, peak_memory_gb, return_large_freed_blocks

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    init_process_group(device.type)
    if device.type == "cpu" and args.live_memory:
        return_large_freed_blocks()
    elif device.type == "cpu":
        keep_freed_host_memory()  # as the job's workers do
    rank0 = dist.get_rank() == 0
    if args.shape:
        model_path = broadcast_path(common.random_model(args.shape, stored_dtype=args.stored_dtype) if rank0 else "")
    else:
        from hybrid_rl.models import resolve_model_path

        model_path = resolve_model_path(args.model)  # None: the default model
    config_name = "ppo_megatron_trainer" if args.strategy == "megatron" else "ppo_trainer"
    cfg = compose_config([f"actor_rollout_ref.actor.strategy={args.strategy}",
                          f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
                          f"actor_rollout_ref.rollout.n={args.responses}", *args.overrides], config_name=config_name)
    actor = cfg.actor_rollout_ref.actor
    compute_dtype = common.update_dtype(cfg, device.type)
    peaks_before, size = common.matmul_peaks(device.type, compute_dtype, args.matmul_size)

    start = time.perf_counter()
    engine = build_engine(ModelSpec("actor", model_path, cfg.actor_rollout_ref.model, optim_cfg=actor.optim,
                                    total_steps=args.steps), actor, device)
    synchronize(device)
    build_seconds = time.perf_counter() - start
    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    world = dist.get_world_size()
    # Every rank holds its data-parallel share of the batch, as the dispatch gives it.
    full = grpo_batch(args.prompts, args.responses, args.prompt_len, args.response_len, vocab)
    rows = len(full) // engine.dp_size
    batch = full[torch.arange(engine.dp_rank * rows, (engine.dp_rank + 1) * rows)]
    loss_fn = grpo_loss(actor)
    rollout = cfg.actor_rollout_ref.rollout
    max_log_prob_tokens = rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz else None

    def update() -> dict:
        return engine.update(batch, actor, rollout_n=args.responses, seed=0, output=Output.LOG_PROBS_ENTROPY,
                             temperature=1.0, loss_fn=loss_fn)

    timings: dict[str, list[float]] = {"update": [], "log_probs": [], "gather_weights": []}
    update_tokens, sync_bytes, first_step, update_peak_above_held = [], 0, None, None
    for _ in range(args.steps):
        synchronize(device)
        start = time.perf_counter()
        engine.infer(batch, Output.LOG_PROBS, 1.0, rollout.log_prob_micro_batch_size_per_gpu, max_log_prob_tokens)
        synchronize(device)
        timings["log_probs"].append(time.perf_counter() - start)
        held = common.reset_peak_resident_gb() if args.live_memory else None
        start = time.perf_counter()
        metrics = update()
        synchronize(device)
        timings["update"].append(time.perf_counter() - start)
        update_peak_above_held = common.peak_resident_gb() - held if args.live_memory else None
        update_tokens.append(metrics["actor/update_tokens"])
        # The first step's numbers: equal weights and batch give equal ones on either engine.
        first_step = first_step or {k: metrics[f"actor/{k}"] for k in ("pg_loss", "grad_norm")}
        start, sync_bytes = time.perf_counter(), 0
        for _, tensor in engine.per_tensor_weights(torch.bfloat16):
            sync_bytes += tensor.numel() * tensor.element_size()
        synchronize(device)
        timings["gather_weights"].append(time.perf_counter() - start)
    if args.profile:
        profile_update(update, device, args.profile if rank0 else None)
    peaks_after, _ = common.matmul_peaks(device.type, compute_dtype, size)
    peaks = common.higher_peaks(peaks_before, peaks_after)
    measured = {k: statistics.mean(v[1:] if len(v) > 1 else v) for k, v in timings.items()}
    tokens = statistics.mean(update_tokens[1:] if len(update_tokens) > 1 else update_tokens)

    nonembed, head = common.parameter_counts(model_path)
    response_tokens = float(batch["response_mask"].sum())
    # With tensor or pipeline parallelism each rank computes its share of every token's FLOPs.
    model_parallel = world // engine.dp_size
    lora = lora_enabled(cfg.actor_rollout_ref.model)
    flops = common.update_flops(nonembed, head, tokens, response_tokens, frozen_base=lora) / model_parallel
    achieved = flops / measured["update"] / 1e12
    result = common.header({"strategy": args.strategy, "model": args.shape or model_path, "device": device.type,
                            "ranks": world, "dp_size": engine.dp_size, "prompts": args.prompts, "n": args.responses,
                            "prompt_len": args.prompt_len, "response_len": args.response_len,
                            "steps": args.steps, "overrides": args.overrides, "matmul_size": size},
                           packages=("torch", "transformers", "megatron-core"))
    result.update({
        "build_seconds": build_seconds,
        "first_step": first_step,
        "seconds": measured,
        "seconds_per_step": timings,  # the first is the warm-up; this CPU varies by ~10 % from run to run
        "update": {"tokens_per_rank": tokens, "response_tokens_per_rank": response_tokens,
                   "nonembedding_params": nonembed, "head_params": head, "flops_per_rank": flops,
                   "achieved_tflops": achieved, "compute_dtype": compute_dtype,
                   "fraction_of_matmul_peak": achieved / peaks[compute_dtype],
                   "tokens_per_second_per_rank": tokens / measured["update"]},
        "matmul_peak_tflops": peaks,
        "matmul_peak_tflops_before_after": [peaks_before, peaks_after],
        "gather_weights": {"gb": sync_bytes / 1e9, "gb_per_s": sync_bytes / 1e9 / measured["gather_weights"]},
        "peak_memory_gb_per_rank": peak_memory_gb(device),
        "last_update_peak_above_held_gb": update_peak_above_held,  # --live-memory
        # What the engine holds while the rollout runs (with offloading, little): GPU only.
        "memory_between_steps_gb": torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    })
    if rank0:
        print(f"{args.strategy} on {common.machine()}: {world} rank(s), {compute_dtype}, built in {build_seconds:.1f} s")
        for phase, seconds in measured.items():
            print(f"{phase:<16}{seconds:>9.3f} s")
        print(f"update: {tokens:.0f} tokens per data-parallel replica of {model_parallel} rank(s), "
              f"{achieved:.2f} TFLOP/s = "
              f"{result['update']['fraction_of_matmul_peak']:.1%} of the {compute_dtype} matmul peak "
              f"({peaks[compute_dtype]:.1f} TFLOP/s)")
        print(f"weights gathered for a sync: {sync_bytes / 1e9:.3f} GB bf16 at {result['gather_weights']['gb_per_s']:.1f} GB/s")
        if result["memory_between_steps_gb"] is not None:
            print(f"GPU memory held between steps: {result['memory_between_steps_gb']:.2f} GB")
        if update_peak_above_held is not None:
            print(f"last update's peak above the memory held before it: {update_peak_above_held:.2f} GB (rank 0)")
        print(f"peak memory per rank: {result['peak_memory_gb_per_rank']:.2f} GB; first step: pg_loss "
              f"{first_step['pg_loss']:.6f}, grad_norm {first_step['grad_norm']:.6f}")
        common.write_json(args.json, result)
    dist.destroy_process_group()
    return 0


def profile_update(update, device, path: str | None) -> None:
    """One `update()` under torch.profiler; its operator table (self time, most first) into `path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        update()
        synchronize(device)
    if path:
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by=key, row_limit=40))
        print(f"wrote {path}")


def broadcast_path(path: str) -> str:
    """Rank 0's `path` on every rank (ranks share the machine's file system)."""
    import torch.distributed as dist

    box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    raise SystemExit(main())
