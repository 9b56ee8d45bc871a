#!/usr/bin/env python
"""LoRA: which way should the rollout engine get the adapter? Merged weights pushed into a plain
vLLM engine (our sync, `per_tensor_weights(only_trained=True)`), or the adapter alone loaded into
an engine started with vLLM's LoRA support and applied at every generated token.

    python tools/bench/lora_rollout.py [--rank 16] [--rounds 3] [--prompts 8] [--max-new-tokens 24]
                                       [--device cpu|cuda] [--json out.json] [overrides ...]

One round is what a LoRA training step asks of the rollout: hand over the new adapter, then
generate one step's batch (the first `--prompts` built-in arithmetic prompts, each `rollout.n`
times, as `rollout.py` builds them). Both routes start from the same actor engine with the same
adapter (peft's random A, B drawn from N(0, 0.01) so that it changes the policy a little, as after
some training); each runs in its own process, one warm-up round, then the median of `--rounds`.
The adapter route writes the adapter with peft into /dev/shm (memory, not disk), registers it
under a new id and drops the previous one, as a training loop would each step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import common
from rollout import SEED, count_tokens, training_batch

ROUTES = ("merged", "adapter")


def measure(route: str, cfg_dict: dict, model_path: str, batch, eos_ids: list[int], device_type: str,
            rounds: int) -> dict:
    import functools

    import torch
    from omegaconf import OmegaConf
    from vllm.lora.request import LoRARequest

    from hybrid_rl.engines import ModelSpec, build_engine
    from hybrid_rl.workers.rollout import VLLMRollout, sampling_settings
    from hybrid_rl.workers.weight_sync import sync_weights

    common.init_single_rank(device_type)
    cfg = OmegaConf.create(cfg_dict)
    device = torch.device(device_type)
    rank = int(cfg.actor_rollout_ref.model.lora_rank)
    torch.manual_seed(SEED)  # peft draws A from the global generator
    actor_cfg = cfg.actor_rollout_ref.actor
    engine = build_engine(ModelSpec("actor", model_path, cfg.actor_rollout_ref.model, optim_cfg=actor_cfg.optim),
                          actor_cfg, device)
    with torch.no_grad():
        for name, param in engine.peft.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.01)
    rollout_cfg = cfg.actor_rollout_ref.rollout
    if route == "adapter":
        rollout_cfg.engine_kwargs.vllm = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}
    rollout = VLLMRollout(model_path, rollout_cfg, device, eos_ids)
    sync_weights(engine, rollout)  # the base model's weights, once, as at a worker's start
    settings = sampling_settings(rollout_cfg, validate=False)
    folder = f"/dev/shm/hybrid_rl_lora_bench_{os.getpid()}"
    generate = rollout.llm.generate
    pushed = 0

    def hand_over(step: int) -> None:
        nonlocal pushed
        if route == "merged":
            pushed = sync_weights(engine, rollout, only_trained=True)
            return
        shutil.rmtree(folder, ignore_errors=True)
        engine.peft.save_pretrained(folder)
        pushed = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        request = LoRARequest(f"step{step}", step, folder)
        rollout.llm.llm_engine.add_lora(request)
        if step > 1:
            rollout.llm.llm_engine.remove_lora(step - 1)
        # Every generate of this step samples from the policy with this adapter.
        rollout.llm.generate = functools.partial(generate, lora_request=request)

    def one_round(step: int) -> dict:
        torch.manual_seed(SEED)
        start = time.perf_counter()
        hand_over(step)
        handed = time.perf_counter()
        sequences = rollout.generate(batch, settings, rollout_cfg.response_length)[0]
        end = time.perf_counter()
        return {"hand_over_seconds": handed - start, "generate_seconds": end - handed,
                "round_seconds": end - start,
                "tokens": count_tokens(sequences, eos_ids, rollout_cfg.response_length)}

    try:
        warmup = one_round(1)
        timed = [one_round(step) for step in range(2, rounds + 2)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    median = {key: statistics.median(r[key] for r in timed)
              for key in ("hand_over_seconds", "generate_seconds", "round_seconds")}
    return {"route": route, "lora_rank": rank, "bytes_handed_over": pushed, "warmup": warmup, "rounds": timed,
            **{f"median_{key}": value for key, value in median.items()},
            "tokens_per_second": statistics.median(r["tokens"] / r["generate_seconds"] for r in timed),
            "engine_dtype": str(rollout.dtype), "torch_threads": torch.get_num_threads()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16, help="actor_rollout_ref.model.lora_rank")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts (each sampled rollout.n times)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="sets data.max_response_length")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args(argv)

    import torch
    from omegaconf import OmegaConf

    from hybrid_rl.main import compose_config

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = compose_config([f"data.max_response_length={args.max_new_tokens}",
                          f"actor_rollout_ref.model.lora_rank={args.rank}", *args.overrides])
    model_path, batch, eos_ids = training_batch(cfg, args.prompts)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    results = [common.run_isolated(measure, route, cfg_dict, model_path, batch, eos_ids, device_type, args.rounds)
               for route in ROUTES]

    result = common.header({"model_path": model_path, "device": device_type, "lora_rank": args.rank,
                            "sequences": len(batch), "max_new_tokens": args.max_new_tokens,
                            "rounds": args.rounds, "overrides": args.overrides})
    result["results"] = results
    print(f"\nLoRA rank {args.rank}, {len(batch)} sequences of <= {args.max_new_tokens} new tokens, {device_type}; "
          f"median of {args.rounds} rounds")
    print(f"{'route':<10}{'MB handed over':>16}{'hand-over s':>13}{'generate s':>12}{'round s':>9}{'tok/s':>8}")
    for r in results:
        print(f"{r['route']:<10}{r['bytes_handed_over'] / 1e6:>16.1f}{r['median_hand_over_seconds']:>13.3f}"
              f"{r['median_generate_seconds']:>12.3f}{r['median_round_seconds']:>9.3f}{r['tokens_per_second']:>8.0f}")
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
