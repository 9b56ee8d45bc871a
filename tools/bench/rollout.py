#!/usr/bin/env python
"""Rollout throughput: our engine (`VLLMRollout`, built and called as a worker does) against
`transformers` generate, in output tokens per second, on the same prompts and sampling settings.

    python tools/bench/rollout.py [--prompts 8] [--max-new-tokens 24] [--dtype float32,bfloat16]
                                  [--repeats 3] [--device cpu|cuda] [--json out.json] [overrides ...]

Prompts are the first `--prompts` built-in arithmetic training prompts, rendered with the chat
template and collated as the trainer does, each repeated `rollout.n` times (default 8 x 4 = 32
sequences, one training step). Sampling settings come from the composed config
(`sampling_settings(rollout, validate=False)`: temperature 0.8, top-p 1, no top-k); dotted
overrides change them, e.g. `actor_rollout_ref.rollout.n=8`. The two engines sample different
sequences, so their lengths differ: only generated tokens up to and including the first EOS
count, and tokens/s is the figure to compare. Each engine runs in its own process: one warm-up
call, then the median of `--repeats` timed calls, each after `torch.manual_seed`. On GPU our calls
include the engine's wake-up and sleep around each rollout, as in training. On CPU the resident
memory the engine adds (its weights, with the KV cache it reserves) and the peak of its start are
reported too, e.g. to compare `actor_rollout_ref.rollout.quantization=torchao` with unquantized runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common

SEED = 0


def count_tokens(sequences: list[list[int]], eos_ids: list[int], limit: int) -> int:
    """Generated tokens up to and including the first EOS (HF pads finished rows after it)."""
    eos = set(eos_ids)
    total = 0
    for seq in sequences:
        seq = seq[:limit]
        total += next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))
    return total


def time_calls(generate, repeats: int, eos_ids: list[int], limit: int) -> dict:
    import torch

    def one_call() -> tuple[float, int]:
        torch.manual_seed(SEED)
        start = time.perf_counter()
        sequences = generate()
        return time.perf_counter() - start, count_tokens(sequences, eos_ids, limit)

    warmup_s, warmup_tokens = one_call()
    calls = [one_call() for _ in range(repeats)]
    seconds = [s for s, _ in calls]
    tokens = [t for _, t in calls]
    median_s = statistics.median(seconds)
    return {
        "warmup_seconds": warmup_s, "warmup_tokens": warmup_tokens,
        "seconds": seconds, "tokens": tokens, "median_seconds": median_s,
        "tokens_per_second": statistics.median([t / s for s, t in calls]),
        # The least disturbed call: on a shared machine the median can still carry others' load.
        "best_tokens_per_second": max(t / s for s, t in calls),
        "torch_threads": torch.get_num_threads(),
    }


def measure_ours(cfg_dict: dict, model_path: str, batch, eos_ids: list[int], device_type: str,
                 repeats: int) -> dict:
    import torch
    from omegaconf import OmegaConf

    from hybrid_rl.engines import ModelSpec, build_engine
    from hybrid_rl.workers.rollout import VLLMRollout, sampling_settings
    from hybrid_rl.workers.weight_sync import sync_weights

    common.init_single_rank(device_type)
    cfg = OmegaConf.create(cfg_dict)
    rollout_cfg = cfg.actor_rollout_ref.rollout
    device = torch.device(device_type)
    start = time.perf_counter()
    before_gb = common.reset_peak_resident_gb()
    rollout = VLLMRollout(model_path, rollout_cfg, device, eos_ids)
    # What the engine holds (its weights and KV cache, on CPU) and the peak of its start.
    engine_gb = common.resident_gb() - before_gb
    engine_peak_gb = common.peak_resident_gb() - before_gb
    # As ActorRolloutRefWorker: the engine starts with random weights and gets the model's pushed.
    reference = build_engine(ModelSpec("ref", model_path, cfg.actor_rollout_ref.model), cfg.actor_rollout_ref.ref,
                             device)
    sync_weights(reference, rollout)
    build_s = time.perf_counter() - start
    settings = sampling_settings(rollout_cfg, validate=False)
    result = time_calls(lambda: rollout.generate(batch, settings, rollout_cfg.response_length)[0],
                        repeats, eos_ids, rollout_cfg.response_length)
    return {**result, "build_seconds": build_s, "engine_dtype": str(rollout.dtype),
            "engine_rss_gb": engine_gb, "engine_start_peak_rss_gb": engine_peak_gb}


def measure_hf(model_path: str, dtype: str, batch, settings: dict, max_new_tokens: int,
               pad_token_id: int, eos_ids: list[int], device_type: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device(device_type)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    build_s = time.perf_counter() - start
    # The collated batch is left-padded to max_prompt_length; a plain HF batch is padded only to
    # its longest prompt, so drop the all-padding columns.
    width = int(batch["attention_mask"].sum(dim=1).max())
    input_ids = batch["input_ids"][:, -width:].to(device)
    attention_mask = batch["attention_mask"][:, -width:].to(device)
    sample = settings["temperature"] > 0
    kwargs = dict(do_sample=sample, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                  eos_token_id=eos_ids)
    if sample:
        # Left out, top_k would be transformers' default of 50; 0 disables it like vLLM's -1.
        kwargs.update(temperature=settings["temperature"], top_p=settings["top_p"],
                      top_k=max(settings["top_k"], 0))

    @torch.no_grad()
    def generate() -> list[list[int]]:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return out[:, width:].tolist()  # .tolist() waits for the device

    return {**time_calls(generate, repeats, eos_ids, max_new_tokens), "build_seconds": build_s}


def training_batch(cfg, prompts: int):
    """The first `prompts` built-in training prompts, rendered and collated as the trainer does,
    each repeated `rollout.n` times; with the model's folder and its EOS ids."""
    from hybrid_rl.data import RLDataset, collate_prompts
    from hybrid_rl.main import default_data_files
    from hybrid_rl.models import load_tokenizer, resolve_model_path
    from hybrid_rl.workers.actor_rollout_ref import eos_ids as model_eos_ids

    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path)
    tokenizer = load_tokenizer(cfg, model_path)
    train_file = cfg.data.train_files or default_data_files()[0]
    dataset = RLDataset(train_file, tokenizer, prompt_key=cfg.data.prompt_key,
                        max_prompt_length=cfg.data.max_prompt_length, truncation=cfg.data.truncation,
                        apply_chat_template_kwargs=cfg.data.apply_chat_template_kwargs)
    if prompts > len(dataset):
        raise SystemExit(f"--prompts {prompts}: the data set has only {len(dataset)} prompts")
    rows = [dataset[i] for i in range(prompts)]
    batch = collate_prompts(rows, tokenizer.pad_token_id, cfg.data.max_prompt_length)
    return model_path, batch.repeat(int(cfg.actor_rollout_ref.rollout.n), interleave=True), \
        model_eos_ids(model_path, tokenizer)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts (each sampled rollout.n times)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="sets data.max_response_length")
    ap.add_argument("--dtype", default="float32", help="comma-separated: float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]

    import torch
    from omegaconf import OmegaConf

    from hybrid_rl.main import compose_config
    from hybrid_rl.models import load_tokenizer
    from hybrid_rl.workers.rollout import sampling_settings

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = compose_config([f"data.max_response_length={args.max_new_tokens}", *args.overrides])
    model_path, batch, eos_ids = training_batch(cfg, args.prompts)
    pad_token_id = load_tokenizer(cfg, model_path).pad_token_id
    rollout_cfg = cfg.actor_rollout_ref.rollout
    settings = sampling_settings(rollout_cfg, validate=False)
    n = int(rollout_cfg.n)
    prompt_lengths = batch["attention_mask"][::n].sum(dim=1).tolist()

    results = {}
    for dtype in dtypes:
        cfg.actor_rollout_ref.rollout.dtype = dtype
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        ours = common.run_isolated(measure_ours, cfg_dict, model_path, batch, eos_ids, device_type, args.repeats)
        hf = common.run_isolated(measure_hf, model_path, dtype, batch, settings, int(rollout_cfg.response_length),
                                 pad_token_id, eos_ids, device_type, args.repeats)
        results[dtype] = {"ours": ours, "hf": hf, "ratio": ours["tokens_per_second"] / hf["tokens_per_second"]}

    result = common.header({
        "model_path": model_path, "device": device_type, "prompts": args.prompts, "n": n,
        "sequences": len(batch), "max_new_tokens": int(rollout_cfg.response_length),
        "prompt_tokens": {"min": min(prompt_lengths), "max": max(prompt_lengths)},
        "sampling": settings, "eos_ids": eos_ids, "dtypes": dtypes, "repeats": args.repeats, "seed": SEED,
        "overrides": args.overrides,
    })
    result["results"] = results

    print(f"\n{len(batch)} sequences ({args.prompts} prompts x n={n}), <= {rollout_cfg.response_length} "
          f"new tokens, T={settings['temperature']}, {device_type}; median of {args.repeats} calls")
    print(f"{'dtype':<10}{'engine':<8}{'tok/s':>9}{'best':>9}{'s/call':>9}  tokens/call")
    for dtype, r in results.items():
        for name in ("ours", "hf"):
            m = r[name]
            tokens = "/".join(str(t) for t in m["tokens"])
            print(f"{dtype:<10}{name:<8}{m['tokens_per_second']:>9.0f}{m['best_tokens_per_second']:>9.0f}"
                  f"{m['median_seconds']:>9.3f}  {tokens}")
        print(f"{dtype:<10}{'ours/hf':<8}{r['ratio']:>8.2f}x   (our engine holds {r['ours']['engine_rss_gb']:.2f} GB "
              f"resident; its start peaked {r['ours']['engine_start_peak_rss_gb']:.2f} GB above the process before it)")
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
