#!/usr/bin/env python
"""Seconds per GRPO step: hybrid-rl against TRL's GRPOTrainer, same work, same machine.

    python tools/bench/vs_trl.py [--models smollm2-135m,random-25m] [--steps 6] [--warmup 2]
                                 [--rounds 2] [--precision fp32|bf16] [--json out.json]
                                 [--ours-overrides "key=value key=value"]

Both systems train the same model on the built-in arithmetic prompts (the same parquet file, the
same chat template, checked token for token) with the same GRPO step: 8 prompts x 4 completions of
at most 24 tokens at temperature 0.8, AdamW at lr 2e-5 (constant, weight decay 0.01), gradient
clipping at 1.0, a k3 KL loss of weight 0.001 against the frozen initial policy, PPO clipping 0.2,
group-normalised advantages and the token-mean loss, with fp32 weights and fp32 or bf16
(autocast) compute. hybrid-rl runs as `python -m hybrid_rl.main` (FSDP2 + in-process vLLM, its own
micro-batching and packing); TRL as tools/bench/trl_grpo_runner.py (HF generate, one forward pass
over the 32 sequences). Each run is a separate process alone on the machine; within a round the
runs alternate between the systems and every other round goes in reverse order, so slow drift of
the machine's speed hits both systems alike.

Reported per model: the median seconds per step over the steps after --warmup, pooled over the
rounds, for each system, and TRL/ours (above 1: hybrid-rl is faster), and the work each did per
step. Needs TRL: `bash tools/install.sh --bench`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# The GRPO step both systems run: hybrid-rl's defaults, restated so that a change of default
# cannot silently make the two sides differ.
SETTINGS = {
    "prompts_per_step": 8,
    "group_size": 4,
    "max_prompt_length": 64,
    "max_response_length": 24,
    "temperature": 0.8,
    "top_p": 1.0,
    "lr": 2e-5,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
    "kl_coef": 0.001,
    "clip_ratio": 0.2,
    "seed": 1,
}

# hybrid-rl's compute dtype (autocast on CPU) and rollout-engine dtype for each --precision.
OURS_DTYPES = {"fp32": ("fp32", "float32"), "bf16": ("bfloat16", "bfloat16")}

# The shape of a random Llama that otherwise has SmolLM2's config (tokenizer, vocabulary, RoPE),
# small enough that each system's per-step overheads show: the 49152 x 384 tied embedding is
# 18.9M of its 25.2M parameters.
RANDOM_MODEL_CONFIG = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
RANDOM_MODEL_SEED = 0

MODELS = ("smollm2-135m", "random-25m")


def smollm2_path() -> str:
    from hybrid_rl.models import resolve_model_path

    return resolve_model_path(None)


def random_model_path() -> str:
    """Build the random model once (seeded, so every machine gets the same weights) next to
    hybrid-rl's other cached models; the folder name changes with the config."""
    from hybrid_rl.models import cache_dir, publish_folder

    base = smollm2_path()
    digest = hashlib.sha1(json.dumps([RANDOM_MODEL_CONFIG, RANDOM_MODEL_SEED], sort_keys=True).encode())
    folder = cache_dir() / "bench" / f"random-25m-{digest.hexdigest()[:8]}"
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(base)
    for key, value in RANDOM_MODEL_CONFIG.items():
        setattr(config, key, value)
    config._model_name_or_path = folder.name  # not SmolLM2's name, which the GGUF conversion left
    torch.manual_seed(RANDOM_MODEL_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)  # also writes generation_config.json (bos/eos/pad from the config)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    return str(publish_folder(tmp, folder))


def count_parameters(model_path: str) -> int:
    """Parameters as trained (a tied embedding counted once), from the safetensors headers."""
    from safetensors import safe_open

    with open(os.path.join(model_path, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    total = 0
    for name in sorted(os.listdir(model_path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, name), "pt") as f:
                total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys()
                             if not (tied and key == "lm_head.weight"))
    return total


def ours_overrides(model_path: str, train_file: str, run_dir: str, steps: int, precision: str) -> list[str]:
    s = SETTINGS
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    compute_dtype, engine_dtype = OURS_DTYPES[precision]
    return [
        f"trainer.total_training_steps={steps}",
        # No validation: none before training, and test_freq=-1 means none after any step (verl's
        # rule); no validation file is given either, so none is loaded.
        "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"data.train_files={train_file}", "data.val_files=null",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={run_dir}", "trainer.progress_bar=false",
        "trainer.device=cpu", f"trainer.seed={s['seed']}", f"data.seed={s['seed']}",
        f"actor_rollout_ref.model.path={model_path}",
        f"{actor}.fsdp_config.dtype={compute_dtype}", f"{rollout}.dtype={engine_dtype}",
        f"data.train_batch_size={s['prompts_per_step']}", f"{rollout}.n={s['group_size']}",
        f"{actor}.ppo_mini_batch_size={s['prompts_per_step']}", f"{actor}.ppo_epochs=1",
        f"data.max_prompt_length={s['max_prompt_length']}", f"data.max_response_length={s['max_response_length']}",
        f"{rollout}.temperature={s['temperature']}", f"{rollout}.top_p={s['top_p']}", f"{rollout}.top_k=-1",
        f"{actor}.optim.lr={s['lr']}", f"{actor}.optim.weight_decay={s['weight_decay']}",
        f"{actor}.optim.lr_scheduler_type=constant", f"{actor}.optim.lr_warmup_steps=0",
        f"{actor}.grad_clip={s['grad_clip']}", f"{actor}.clip_ratio={s['clip_ratio']}",
        f"{actor}.use_kl_loss=true", f"{actor}.kl_loss_type=low_var_kl", f"{actor}.kl_loss_coef={s['kl_coef']}",
        f"{actor}.loss_agg_mode=token-mean", f"{actor}.entropy_coeff=0.0",
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true",
    ]


def run_logged(cmd: list[str], log_path: str, env: dict | None = None) -> float:
    """Run cmd with its output in log_path; returns its wall time, raises with the log's tail."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.call(cmd, cwd=common.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    if code:
        with open(log_path, errors="replace") as log:
            tail = "".join(log.readlines()[-30:])
        raise RuntimeError(f"{shlex.join(cmd)} exited with {code}; last lines of {log_path}:\n{tail}")
    return time.perf_counter() - start


def run_ours(model_path: str, train_file: str, args, work: str, tag: str) -> dict:
    run_dir = os.path.join(work, tag)
    cmd = [sys.executable, "-m", "hybrid_rl.main",
           *ours_overrides(model_path, train_file, run_dir, args.steps, args.precision),
           *shlex.split(args.ours_overrides)]
    wall = run_logged(cmd, os.path.join(work, f"{tag}.log"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = sorted((row for row in map(json.loads, f) if "timing_s/step" in row), key=lambda row: row["step"])
    steps = []
    for row in rows:
        # Prompt + response tokens without padding: completions x (mean prompt + mean response length).
        tokens = row["perf/total_num_tokens"]
        steps.append({"seconds": row["timing_s/step"],
                      "completions": round(tokens / (row["prompt_length/mean"] + row["response_length/mean"])),
                      "tokens": tokens, "completion_length_mean": row["response_length/mean"],
                      "reward_mean": row["critic/score/mean"]})
    return {"wall_s": wall, "steps": steps}


def run_trl(model_path: str, train_file: str, args, work: str, tag: str) -> dict:
    config_path, out_path = os.path.join(work, f"{tag}.json"), os.path.join(work, f"{tag}.result.json")
    with open(config_path, "w") as f:
        json.dump({"model_path": model_path, "train_file": train_file, "steps": args.steps,
                   "settings": {**SETTINGS, "precision": args.precision}}, f)
    # The threads hybrid-rl gives its one worker (all cores), and no tokenizer thread pool.
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, os.path.join(common.REPO_ROOT, "tools", "bench", "trl_grpo_runner.py"),
           "--config", config_path, "--out", out_path]
    wall = run_logged(cmd, os.path.join(work, f"{tag}.log"), env=env)
    with open(out_path) as f:
        result = json.load(f)
    if not result["prompt_ids_identical"]:
        raise RuntimeError(f"TRL tokenised the prompts differently from hybrid-rl (see {out_path})")
    return {"wall_s": wall, **result}


def summarise(runs: list[dict], warmup: int) -> dict:
    """The median step time after the warm-up steps, pooled and per round (a round that ran while
    the machine was busy stands out); the work per step over all steps."""
    timed = [step["seconds"] for run in runs for step in run["steps"][warmup:]]
    steps = [step for run in runs for step in run["steps"]]
    return {"median_s": statistics.median(timed), "steps_timed": len(timed),
            "round_medians_s": [statistics.median(step["seconds"] for step in run["steps"][warmup:]) for run in runs],
            "completions_per_step": sorted({step["completions"] for step in steps}),
            "tokens_per_step_mean": statistics.fmean(step["tokens"] for step in steps),
            "completion_length_mean": statistics.fmean(step["completion_length_mean"] for step in steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=6, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps of each run left out of the median")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", choices=sorted(OURS_DTYPES), default="fp32",
                    help="compute dtype of both systems (weights stay fp32); bf16 is CPU autocast, and "
                         "hybrid-rl's rollout engine then runs in bf16")
    ap.add_argument("--json", help="write settings, versions and every step's time and work here")
    ap.add_argument("--ours-overrides", default="",
                    help='extra hybrid-rl overrides, e.g. "actor_rollout_ref.actor.use_dynamic_bsz=false"; '
                         "they come last, so they win")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    if not 0 <= args.warmup < args.steps or args.rounds < 1:
        ap.error("need 0 <= --warmup < --steps and --rounds >= 1")

    from hybrid_rl.main import default_data_files

    train_file, _ = default_data_files()
    paths = {name: (smollm2_path if name == "smollm2-135m" else random_model_path)() for name in models}
    params = {name: count_parameters(path) for name, path in paths.items()}
    for name in models:
        print(f"{name}: {params[name]:,} parameters, {paths[name]}")
    work = tempfile.mkdtemp(prefix="bench_vs_trl_")
    print(f"logs and run folders: {work}")

    jobs = [(name, system) for name in models for system in ("ours", "trl")]
    runs: dict = {name: {"ours": [], "trl": []} for name in models}
    for rnd in range(1, args.rounds + 1):
        for name, system in jobs if rnd % 2 else jobs[::-1]:
            tag = f"{name}-{system}-r{rnd}"
            # Other work on the machine slows every figure: keep the 1-minute load before and after
            # (the run itself adds about the number of cores).
            load = os.getloadavg()[0]
            print(f"round {rnd}: {name} {system} (load {load:.2f}) ...", end=" ", flush=True)
            run = (run_ours if system == "ours" else run_trl)(paths[name], train_file, args, work, tag)
            run.update(round=rnd, load_before=load, load_after=os.getloadavg()[0])
            runs[name][system].append(run)
            print(f"{run['wall_s']:.0f} s (load after {run['load_after']:.2f}); steps "
                  + " ".join(f"{step['seconds']:.2f}" for step in run["steps"]))

    results = {}
    print(f"\nmedian seconds per step ({args.precision}), steps {args.warmup + 1}-{args.steps} of "
          f"{args.rounds} round(s)")
    print(f"{'model':<14}{'params':>8}{'ours':>9}{'TRL':>9}{'TRL/ours':>10}")
    for name in models:
        ours, trl = summarise(runs[name]["ours"], args.warmup), summarise(runs[name]["trl"], args.warmup)
        ratio = trl["median_s"] / ours["median_s"]
        results[name] = {"path": paths[name], "parameters": params[name], "ours": ours, "trl": trl,
                         "ratio_trl_over_ours": ratio, "runs": runs[name]}
        print(f"{name:<14}{params[name] / 1e6:>7.1f}M{ours['median_s']:>9.2f}{trl['median_s']:>9.2f}{ratio:>10.2f}"
              f"   per round: ours {' '.join(f'{m:.2f}' for m in ours['round_medians_s'])}, "
              f"TRL {' '.join(f'{m:.2f}' for m in trl['round_medians_s'])}")
    print("\nwork per step, all steps: completions | mean tokens (prompt + completion) | mean completion length")
    for name in models:
        for system in ("ours", "trl"):
            r = results[name][system]
            print(f"{name:<14}{system:<6}{r['completions_per_step']} | {r['tokens_per_step_mean']:.0f} | "
                  f"{r['completion_length_mean']:.1f}")

    settings = {**SETTINGS, "precision": args.precision, "steps": args.steps, "warmup": args.warmup,
                "rounds": args.rounds, "ours_overrides": shlex.split(args.ours_overrides), "train_file": train_file}
    common.write_json(args.json, {**common.header(settings, packages=("torch", "transformers", "trl", "vllm")),
                                  "models": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
