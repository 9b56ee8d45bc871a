#!/usr/bin/env python
"""Reward-model scoring cost: the worker's path (`RewardInputs` then `TrainEngine.infer` with
`Output.SCORES`, as `RewardModelWorker.compute_rm_score` runs it) against a plain transformers
forward of the same sequence classifier over the same micro-batches, in the same dtype. With
`--process`, a process reward model's path (steps split at `--step-separator`, `Output.TOKEN_SCORES`,
the scores placed on the policy's step-end tokens) against a plain forward of the token classifier.

    python tools/bench/reward_model.py [--model PATH] [--rows 32] [--response-length 24]
                                       [--micro-batch 8] [--dtype auto] [--repeats 5] [--json out.json]
                                       [--process] [--step-separator ' '] [--n 4] [--padded]

The rows are the first `rows / n` built-in arithmetic training prompts (chat-templated as the
trainer does), each with `--n` random responses of 1 to `--response-length` tokens, laid out as
rollouts are. Ours packs the rows and computes each group's prompt once, as the reward model's
defaults do (`--padded`: padded rows, as the plain forward always runs them). The model is
`--model` (default: the default model, which gets a fresh score head: the cost of a trained reward
model of that size). One warm-up call each, then the median of `--repeats` alternating calls.
"ratio" is ours over the plain forward: 1.0 means scoring costs one forward pass per sample.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--response-length", type=int, default=24)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--process", action="store_true", help="a process reward model (token classifier)")
    ap.add_argument("--step-separator", default=" ")
    ap.add_argument("--padded", action="store_true", help="score padded rows (reward_model.model.use_remove_padding=false)")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt (a group shares its prompt)")
    args = ap.parse_args()

    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    from hybrid_rl.data.arithmetic import make_arithmetic_rows
    from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
    from hybrid_rl.engines.hf_model import autocast_to, compute_dtype, cpu_autocast_dtype
    from hybrid_rl.models import resolve_model_path
    from hybrid_rl.rewards.model_inputs import RewardInputs, collate_rows, pad_id
    from hybrid_rl.workers.reward_model import place_step_scores

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for row in make_arithmetic_rows(args.rows // args.n, seed=0):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for _ in range(args.n):
            length = int(torch.randint(1, args.response_length + 1, (1,), generator=generator))
            response = torch.randint(0, len(tokenizer), (length,), generator=generator).tolist()
            rows.append((tokenizer(prompt, add_special_tokens=False)["input_ids"], response))
    batch = collate_rows(rows, pad_id(tokenizer))

    model_cfg = OmegaConf.create({"trust_remote_code": False, "override_config": {},
                                  "use_remove_padding": not args.padded, "share_prompt_prefix": not args.padded})
    role_cfg = OmegaConf.create({"strategy": "fsdp", "fsdp_config": {"dtype": args.dtype,
                                                                      "reshard_after_forward": True}})
    device = torch.device("cpu")
    head = Head.STEP_SCORE if args.process else Head.SCORE
    engine = build_engine(ModelSpec("reward_model", path, model_cfg, head=head), role_cfg, device)
    inputs = RewardInputs(tokenizer, tokenizer, None)
    auto_class = AutoModelForTokenClassification if args.process else AutoModelForSequenceClassification
    plain = auto_class.from_pretrained(path, num_labels=1, dtype=torch.float32).eval()
    plain.config.pad_token_id = pad_id(tokenizer)
    autocast_dtype = cpu_autocast_dtype(compute_dtype(args.dtype, device), device)
    steps_seen = []

    def ours():
        if not args.process:
            scored, _ = inputs(batch)
            return engine.infer(scored, Output.SCORES, 1.0, args.micro_batch, None)["scores"]
        scored, _, steps = inputs.with_steps(batch, args.step_separator)
        token_scores = engine.infer(scored, Output.TOKEN_SCORES, 1.0, args.micro_batch, None)["token_scores"]
        steps_seen.append(sum(map(len, steps)))
        return place_step_scores(token_scores, steps, batch["responses"].shape)

    @torch.no_grad()
    def plain_forward():
        with autocast_to("cpu", autocast_dtype):
            for part in batch.split(args.micro_batch):
                plain(input_ids=part["input_ids"], attention_mask=part["attention_mask"],
                      position_ids=part["position_ids"])

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    timed(ours), timed(plain_forward)  # warm-up
    times = {"ours": [], "plain_forward": []}
    for _ in range(args.repeats):
        times["ours"].append(timed(ours))
        times["plain_forward"].append(timed(plain_forward))
    median = {name: statistics.median(values) for name, values in times.items()}
    result = common.header(vars(args), packages=("torch", "transformers"))
    result.update({"model": path, "rows": len(rows), "tokens": int(batch["attention_mask"].sum()), "seconds": times,
                   "median_seconds": median, "ms_per_sample": {k: 1e3 * v / args.rows for k, v in median.items()},
                   "ratio": median["ours"] / median["plain_forward"],
                   "dtype": str(autocast_dtype or torch.float32).removeprefix("torch."),
                   "steps_per_response": steps_seen[0] / args.rows if steps_seen else None})
    print(f"{args.rows} rows, {result['tokens']} tokens, {result['dtype']}: ours {median['ours']:.3f} s, "
          f"plain forward {median['plain_forward']:.3f} s, ratio {result['ratio']:.3f}")
    common.write_json(args.json, result)


if __name__ == "__main__":
    main()
