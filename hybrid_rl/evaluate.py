"""Score a model on RL data files with this project's rewards (`hybrid-rl-evaluate`, `tools/evaluate.py`).

    hybrid-rl-evaluate --model runs/hybrid_rl/arithmetic_grpo/final_model --data test.parquet shifted.parquet
    hybrid-rl-evaluate --model runs/hybrid_rl/arithmetic_grpo --data test.parquet --n 8 --k 1 4 8

`--model` is a Hugging Face folder, a `.gguf` file, a run folder or one of its `global_step_<N>`
checkpoints (exported to a temporary folder first), or nothing for the default model. Prompts get
the model's chat template, as in training. Each file is answered greedily (one response per
prompt) and, with `--n` > 1, also sampled `n` times per prompt at `--temperature`; every response
is scored by the built-in scorer of its row's data source, or by `--reward file.py:function`.
Reported per data source (and over each file): `greedy` (mean score of the greedy answers),
`mean@n` (mean score of the samples) and `pass@k` for each `--k` (the unbiased estimator of
Chen et al. 2021 from the n samples: 1 - C(n-c, k) / C(n, k) with c correct). A response is
correct when the scorer's `acc` says so, or, for a scorer that returns no `acc`, when it scores
at least 1. Generation runs in vLLM (the engine the trainer uses), in the dtype the hardware suits.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections import defaultdict

logger = logging.getLogger(__name__)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Probability that at least one of k responses drawn without replacement from n, of which
    `correct` are correct, is correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= correct <= n (n={n}, correct={correct}, k={k})")
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def score_of(result) -> tuple[float, bool]:
    """(score, correct) of a scorer's result: a number, or a dict with `score` (and `acc`)."""
    if isinstance(result, dict):
        score = float(result["score"])
        return score, bool(result["acc"]) if "acc" in result else score >= 1.0
    return float(result), float(result) >= 1.0


def model_folder(model: str | None, scratch: str) -> str:
    """A Hugging Face folder for `model`: checkpoints are exported into `scratch` first."""
    from hybrid_rl.checkpoint import POINTER, STATE
    from hybrid_rl.export import export_checkpoint
    from hybrid_rl.models import resolve_model_path

    path = os.path.expanduser(model) if model else None
    if path and os.path.isdir(path) and (os.path.isfile(os.path.join(path, STATE))
                                         or os.path.isfile(os.path.join(path, POINTER))):
        return export_checkpoint(path, os.path.join(scratch, "model"))
    return resolve_model_path(model, key="--model")


class Generator:
    """vLLM on this machine's device, loading the model's own weights."""

    def __init__(self, model_path: str, max_model_len: int, seed: int, dtype: str = "auto"):
        import torch

        from hybrid_rl.hardware import resolve_dtype
        from hybrid_rl.workers.actor_rollout_ref import eos_ids
        from hybrid_rl.workers.vllm_cpu import norm_priority, register_norm_kernels

        device = "cuda" if torch.cuda.is_available() else "cpu"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.stop_token_ids = eos_ids(model_path, self.tokenizer)
        # No longer than the model's own context (vLLM refuses that).
        positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
        gc.freeze()  # as the rollout engine does: vLLM's start-up collections then skip what is loaded
        cpu_kwargs = {}
        if device == "cpu":  # eager, with vLLM-CPU's fused norms, as the rollout engine's CPU default
            register_norm_kernels()
            cpu_kwargs = {"ir_op_priority": norm_priority()}
        self.llm = LLM(model=model_path, dtype=resolve_dtype(dtype, device, "engine").dtype,
                       max_model_len=min(max_model_len, positions or max_model_len), seed=seed,
                       enforce_eager=device == "cpu", **cpu_kwargs)

    def responses(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                  max_tokens: int) -> list[list[str]]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                stop_token_ids=self.stop_token_ids)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return [[self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out.outputs]
                for out in outputs]


def summarise(groups: dict[str, list[dict]], n: int, ks: list[int]) -> dict[str, dict[str, float]]:
    """Per group name, the metrics of its prompts' `greedy` results and `samples`."""
    table = {}
    for name, rows in groups.items():
        metrics = {"prompts": float(len(rows)), "greedy": sum(r["greedy"]["score"] for r in rows) / len(rows)}
        if n > 1:
            metrics[f"mean@{n}"] = sum(s["score"] for r in rows for s in r["samples"]) / (n * len(rows))
            for k in ks:
                metrics[f"pass@{k}"] = sum(pass_at_k(n, sum(s["correct"] for s in r["samples"]), k)
                                           for r in rows) / len(rows)
        table[name] = metrics
    return table


def evaluate(model: str | None, data: list[str], n: int = 1, ks: list[int] | None = None, temperature: float = 1.0,
             top_p: float = 1.0, max_prompt_length: int = 512, max_response_length: int = 256, seed: int = 0,
             max_samples: int = -1, reward: str | None = None, samples_file: str | None = None) -> dict:
    """Greedy (and, with n > 1, sampled) responses to every prompt of each file in `data`, scored;
    returns the settings and per file and data source the metrics (see the module's doc)."""
    from hybrid_rl.data import RLDataset
    from hybrid_rl.hardware import cpu_flags, cpu_model, simd_summary
    from hybrid_rl.rewards import default_compute_score, load_custom_reward_fn

    ks = sorted(set(ks or ([1, n] if n > 1 else [])))
    if n < 1 or any(not 0 < k <= n for k in ks):
        raise ValueError(f"--n must be >= 1 and every --k in 1..n (n={n}, k={ks})")
    missing = [file for file in data if not os.path.isfile(os.path.expanduser(file))]
    if missing:
        raise FileNotFoundError(f"no data file at {', '.join(missing)}; write one in verl's schema, e.g. "
                                "python tools/data/arithmetic.py --out-dir ~/data/arithmetic")
    scorer = default_compute_score
    if reward:
        path, _, name = reward.partition(":")
        scorer = load_custom_reward_fn(path, name or "compute_score", key="--reward")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hybrid_rl_eval_") as scratch:
        model_path = model_folder(model, scratch)
        generator = Generator(model_path, max_prompt_length + max_response_length, seed)
        results: dict = {"model": model or "default (SmolLM2-135M-Instruct)", "n": n, "k": ks,
                         "temperature": temperature, "top_p": top_p, "max_response_length": max_response_length,
                         "seed": seed, "machine": f"{cpu_model()} ({simd_summary(cpu_flags())})", "files": {}}
        dumped = []
        for file in data:
            dataset = RLDataset(file, generator.tokenizer, max_prompt_length=max_prompt_length, max_samples=max_samples)
            rows = [dataset[i] for i in range(len(dataset))]
            prompt_ids = [list(row["prompt_ids"]) for row in rows]
            greedy = generator.responses(prompt_ids, 1, 0.0, 1.0, max_response_length)
            sampled = (generator.responses(prompt_ids, n, temperature, top_p, max_response_length) if n > 1
                       else [[] for _ in rows])
            groups: dict[str, list[dict]] = defaultdict(list)
            for row, (first,), samples in zip(rows, greedy, sampled):
                def scored(text: str) -> dict:
                    score, correct = score_of(scorer(data_source=row["data_source"], solution_str=text,
                                                     ground_truth=row["reward_model"]["ground_truth"],
                                                     extra_info=row["extra_info"]))
                    return {"response": text, "score": score, "correct": correct}

                result = {"greedy": scored(first), "samples": [scored(text) for text in samples]}
                groups[str(row["data_source"])].append(result)
                groups["all"].append(result)
                dumped.append({"file": file, "data_source": str(row["data_source"]),
                               "prompt": row["raw_prompt"][-1]["content"],
                               "ground_truth": row["reward_model"]["ground_truth"], **result})
            results["files"][file] = summarise(groups, n, ks)
    results["seconds"] = round(time.perf_counter() - start, 1)
    if samples_file:
        with open(os.path.expanduser(samples_file), "w") as f:
            for row in dumped:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return results


def format_table(results: dict) -> str:
    lines = [f"model {results['model']}; {results['machine']}"]
    for file, table in results["files"].items():
        lines.append(file)
        for name, metrics in table.items():
            cells = ", ".join(f"{key} {value:.1%}" if key != "prompts" else f"{int(value)} prompts"
                              for key, value in metrics.items())
            lines.append(f"  {name:24s} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybrid-rl-evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, .gguf, run folder or global_step_<N> (default: the default model)")
    ap.add_argument("--data", nargs="+", required=True, help="parquet or JSON Lines files in verl's schema")
    ap.add_argument("--n", type=int, default=1, help="sampled responses per prompt (1: greedy only)")
    ap.add_argument("--k", type=int, nargs="*", default=None, help="pass@k for these k (default: 1 and n)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-prompt-length", type=int, default=512)
    ap.add_argument("--max-response-length", type=int, default=256)
    ap.add_argument("--max-samples", type=int, default=-1, help="the first N prompts of each file (-1: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reward", default=None, help="file.py:function to score with instead of the built-in scorers")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--samples", default=None, help="write every response and its score as JSON Lines here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        results = evaluate(args.model, args.data, args.n, args.k, args.temperature, args.top_p, args.max_prompt_length,
                           args.max_response_length, args.seed, args.max_samples, args.reward, args.samples)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.out:
        with open(os.path.expanduser(args.out), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
