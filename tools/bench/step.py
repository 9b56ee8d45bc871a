#!/usr/bin/env python
"""One GRPO step, phase by phase: where the time goes, tokens/s, how close the update phase
gets to this machine's matmul peak, and peak memory.

    python tools/bench/step.py [--steps 4] [--config-name ppo_trainer] [--json out.json] [dotted overrides ...]

Runs the default job (or the one the overrides describe) for a few steps without validation and
reports the mean of each phase over the steps after the first (warm-up). The matmul peak is
measured before and after the steps, in the update's compute dtype; the higher counts. The update's FLOP count is the usual
6 x parameters x tokens of forward + backward: the non-embedding parameters over every token the
padding-free forward computes (`actor/update_tokens`) plus the LM head over the response tokens
only (the head runs nowhere else); attention score FLOPs are left out, so the fraction is a
slight underestimate.

`--head-memory` adds the peak memory of one forward + backward over a default-sized batch with the
chunked LM head (what training uses) and with full (B, T, V) logits, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights",
          "step", "save_checkpoint")
# Shown only when the run has them: a critic's, and the time a checkpoint holds the step up
# (trainer.save_freq; with checkpoint.async_save only the copy to host memory).
OPTIONAL_PHASES = ("values", "update_critic", "save_checkpoint")


def head_memory_case(model_path: str, chunked: bool, rows: int, prompt: int, response: int) -> dict:
    """Peak resident memory of one forward + backward in this (fresh) process."""
    import resource

    import torch

    from hybrid_rl.algorithms import token_log_probs
    from hybrid_rl.engines import hf_model
    from hybrid_rl.main import compose_config

    torch.manual_seed(0)
    model_cfg = compose_config().actor_rollout_ref.model
    model = hf_model.load_causal_lm(model_path, model_cfg, torch.device("cpu"), trainable=True)
    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab, (rows, prompt + response))
    ids[:, :prompt] = ids[0, :prompt]  # one prompt per group of 4 in the default step
    micro = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(prompt + response).expand(rows, -1), "responses": ids[:, prompt:]}
    options = hf_model.ForwardOptions(remove_padding=True, share_prompts=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if chunked:
        log_probs, _ = hf_model.response_log_probs(model, micro, 1.0, options)
    else:
        logits = hf_model.response_logits(model, micro, 1.0, options)
        log_probs = token_log_probs(logits, micro["responses"])
    log_probs.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_gb": peak / 2**20, "increase_gb": (peak - before) / 2**20}


def run_steps(steps: int, overrides: list[str], config_name: str = "ppo_trainer") -> tuple[dict, list[dict]]:
    from hybrid_rl.main import build_trainer, compose_config

    run_dir = tempfile.mkdtemp(prefix="bench_step_")
    cfg = compose_config([f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
                          "trainer.test_freq=-1", "data.val_files=null", "trainer.logger=[jsonl]",
                          f"trainer.default_local_dir={run_dir}", "trainer.progress_bar=false", *overrides],
                         config_name=config_name)
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    finally:
        trainer.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"cfg": cfg, "model_path": trainer.model_path}, rows[1:] if len(rows) > 1 else rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--config-name", default="ppo_trainer", help="ppo_megatron_trainer for the Megatron engine")
    ap.add_argument("--matmul-size", type=int, default=None, help="default 2048 on CPU, 8192 on CUDA")
    ap.add_argument("--head-memory", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    from hybrid_rl.engines.lora import enabled as lora_enabled
    from hybrid_rl.main import compose_config

    compute_dtype = common.update_dtype(compose_config(args.overrides, args.config_name), device)
    peaks_before, size = common.matmul_peaks(device, compute_dtype, args.matmul_size)

    run, measured = run_steps(args.steps, args.overrides, args.config_name)
    peaks_after, _ = common.matmul_peaks(device, compute_dtype, size)
    peaks = common.higher_peaks(peaks_before, peaks_after)
    cfg = run["cfg"]
    mean = lambda key: sum(r.get(key, 0.0) for r in measured) / len(measured)  # noqa: E731
    phases = {p: mean(f"timing_s/{p}") for p in PHASES
              if p not in OPTIONAL_PHASES or any(f"timing_s/{p}" in r for r in measured)}
    nonembed, head = common.parameter_counts(run["model_path"])
    ranks = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    sequences = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    response_tokens = mean("response_length/mean") * sequences / ranks
    update_flops = common.update_flops(nonembed, head, mean("actor/update_tokens"), response_tokens,
                                       frozen_base=lora_enabled(cfg.actor_rollout_ref.model))
    achieved = update_flops / phases["update_actor"] / 1e12
    result = common.header({"steps": args.steps, "config_name": args.config_name, "overrides": args.overrides,
                            "device": device, "ranks": ranks, "sequences_per_step": sequences,
                            "matmul_size": size}, packages=("torch", "vllm", "transformers", "megatron-core"))
    result.update({
        "steps_measured": len(measured),
        "phase_seconds": phases,
        "tokens_per_second_per_rank": mean("perf/throughput"),
        "update": {"tokens_per_rank": mean("actor/update_tokens"), "response_tokens_per_rank": response_tokens,
                   "nonembedding_params": nonembed, "head_params": head, "flops_per_rank": update_flops,
                   "achieved_tflops": achieved, "compute_dtype": compute_dtype,
                   "fraction_of_matmul_peak": achieved / peaks[compute_dtype]},
        "matmul_peak_tflops": peaks,
        "matmul_peak_tflops_before_after": [peaks_before, peaks_after],
        "peak_memory_gb_per_rank": max(r.get("perf/max_memory_gb", 0.0) for r in measured),
        "sync_gb_per_rank": mean("perf/sync_gb_per_rank"),
        "per_step": [{"step": r["step"], "update_actor_s": r.get("timing_s/update_actor"),
                      "step_s": r.get("timing_s/step"), "update_tokens": r.get("actor/update_tokens")}
                     for r in measured],
    })
    print(f"{'phase':<16}{'seconds':>10}{'share':>8}")
    for phase, seconds in phases.items():
        print(f"{phase:<16}{seconds:>10.2f}{seconds / phases['step']:>8.1%}")
    print(f"tokens/s per rank: {result['tokens_per_second_per_rank']:.1f}")
    print(f"weight sync: {result['sync_gb_per_rank']:.3f} GB per rank in {phases['update_weights']:.2f} s")
    print("matmul peak: " + ", ".join(f"{peak:.3f} TFLOP/s {dtype}" for dtype, peak in peaks.items()))
    print(f"update: {achieved:.3f} TFLOP/s ({compute_dtype}) = {result['update']['fraction_of_matmul_peak']:.1%} "
          f"of the matmul peak")
    print(f"peak memory per rank: {result['peak_memory_gb_per_rank']:.2f} GB")

    if args.head_memory:
        prompt = int(round(mean("prompt_length/mean")))
        shape = (sequences // ranks, prompt, cfg.data.max_response_length)
        result["head_memory"] = {"rows_prompt_response": shape, **{
            name: common.run_isolated(head_memory_case, run["model_path"], chunked, *shape)
            for name, chunked in (("chunked_head", True), ("full_logits", False))}}
        for name in ("chunked_head", "full_logits"):
            print(f"{name:<14} peak RSS increase of forward+backward: "
                  f"{result['head_memory'][name]['increase_gb']:.2f} GB")
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
