#!/usr/bin/env python
"""Train with TRL's GRPOTrainer for a few steps and record the wall time of every optimizer step.

    python tools/bench/trl_grpo_runner.py --config run.json --out result.json

Started by tools/bench/vs_trl.py, which writes run.json (model, train file, GRPO settings) so that
TRL does the same work as hybrid-rl; see that file for what is matched and why. Needs
`pip install -e .[bench]` (TRL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def load_prompts(train_file: str):
    """The arithmetic rows as TRL wants them: chat messages, plus the columns the reward needs."""
    from datasets import Dataset

    from hybrid_rl.data.dataset import read_rows

    return Dataset.from_list([{"prompt": row["prompt"], "data_source": row["data_source"],
                               "ground_truth": row["reward_model"]["ground_truth"]}
                              for row in read_rows(train_file)])


def check_prompt_ids(trainer, dataset, train_file: str, model_path: str, max_prompt_length: int) -> dict:
    """Whether TRL feeds the model exactly the prompt tokens hybrid-rl does. TRL 1.16 has no
    max_prompt_length, so also check that no prompt is longer than hybrid-rl's limit."""
    from transformers import AutoTokenizer

    from hybrid_rl.data import RLDataset

    # hybrid-rl's own tokenisation: its data set class, the tokenizer as hybrid_rl.main loads it.
    ours = RLDataset(train_file, AutoTokenizer.from_pretrained(model_path), max_prompt_length=max_prompt_length)
    ours_ids = [ours[i]["prompt_ids"] for i in range(len(ours))]
    trl_ids = [list(ids) for ids in trainer._tokenize_prompts(list(dataset["prompt"]))[0]]
    return {"prompts_checked": len(trl_ids), "prompt_ids_identical": trl_ids == ours_ids,
            "prompt_tokens_max": max(map(len, trl_ids))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="JSON written by vs_trl.py")
    ap.add_argument("--out", required=True, help="write the per-step results here")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        run = json.load(f)
    s = run["settings"]

    start = time.perf_counter()
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybrid_rl.rewards import default_compute_score

    completions_seen = []  # completions scored so far, one entry per reward call

    def arithmetic_reward(completions, data_source, ground_truth, **_):
        """hybrid-rl's built-in scorer on the decoded completion (TRL decodes with
        skip_special_tokens=True, as hybrid-rl's reward manager does)."""
        completions_seen.append(len(completions))
        return [float(default_compute_score(source, completion[-1]["content"], truth))
                for completion, source, truth in zip(completions, data_source, ground_truth)]

    class StepRecorder(TrainerCallback):
        """Wall time from the start of an optimizer step (before generation) to its end (after the
        optimizer step), i.e. the span hybrid-rl's timing_s/step covers, plus the step's work."""

        def __init__(self):
            self.steps: list[dict] = []
            self.tokens_before = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            self.scored_before = sum(completions_seen)

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"seconds": time.perf_counter() - self.start,
                               "completions": sum(completions_seen) - self.scored_before})

        def on_log(self, args, state, control, logs=None, **kwargs):
            # logging_steps=1: one call per step, right after on_step_end. TRL's num_tokens is the
            # running count of prompt + completion tokens (without padding).
            if logs and "num_tokens" in logs:
                step = self.steps[-1]
                step["tokens"] = logs["num_tokens"] - self.tokens_before
                step["completion_length_mean"] = logs["completions/mean_length"]
                step["reward_mean"] = logs["reward"]
                self.tokens_before = logs["num_tokens"]

    sequences = s["prompts_per_step"] * s["group_size"]
    output_dir = tempfile.TemporaryDirectory(prefix="bench_trl_")  # TRL wants one; nothing is saved
    config = GRPOConfig(
        output_dir=output_dir.name,
        max_steps=run["steps"],
        # One optimizer step = one generation batch of prompts_per_step x group_size completions in
        # one forward/backward pass (hybrid-rl packs them into micro-batches by token count, which
        # on this small batch is one or two). steps_per_generation is then 1, and with
        # num_iterations=1 TRL skips the old log-prob pass, as hybrid-rl does with one mini-batch
        # and one epoch.
        per_device_train_batch_size=sequences,
        gradient_accumulation_steps=1,
        generation_batch_size=sequences,
        num_generations=s["group_size"],
        num_iterations=1,
        max_completion_length=s["max_response_length"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=0,  # disabled, as hybrid-rl's top_k=-1
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        # Fused torch.optim.AdamW, as hybrid-rl (and transformers' default with torch >= 2.8). TRL
        # exempts biases and norms from weight decay, hybrid-rl does not: no effect on speed.
        optim="adamw_torch_fused",
        weight_decay=s["weight_decay"],
        max_grad_norm=s["grad_clip"],
        # TRL's KL term is k3 = exp(ref - logp) - (ref - logp) - 1: hybrid-rl's low_var_kl without
        # its clamps (the exponent to [-20, 20], the result to [0, 10]).
        beta=s["kl_coef"],
        epsilon=s["clip_ratio"],
        # "dapo" divides the summed token losses of every micro-batch by the token count of the
        # whole generation batch (num_items_in_batch, gathered over processes): the token mean over
        # all of the step's completions, hybrid-rl's loss_agg_mode=token-mean. "bnpo" divides each
        # micro-batch by its own token count, the same here (one micro-batch, one process) but a
        # mean of micro-batch means otherwise; "grpo" averages per sequence first.
        loss_type="dapo",
        scale_rewards="group",  # (r - group mean) / group std: GRPO with norm_adv_by_std_in_grpo
        # fp32 weights either way; bf16 is CPU autocast (accelerate's mixed precision), as hybrid-rl's
        # fsdp_config.dtype=bfloat16 is. TRL's default bf16=True refuses to start on a CPU unless
        # use_cpu is set.
        model_init_kwargs={"dtype": "float32"},
        bf16=s["precision"] == "bf16",
        use_cpu=True,
        gradient_checkpointing=False,  # TRL defaults to True; hybrid-rl's run has it off
        seed=s["seed"],
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
    )
    dataset = load_prompts(run["train_file"])
    recorder = StepRecorder()
    trainer = GRPOTrainer(model=run["model_path"], reward_funcs=arithmetic_reward, args=config,
                          train_dataset=dataset, callbacks=[recorder])
    check = check_prompt_ids(trainer, dataset, run["train_file"], run["model_path"], s["max_prompt_length"])
    build_s = time.perf_counter() - start
    trainer.train()
    output_dir.cleanup()
    with open(args.out, "w") as f:
        json.dump({"build_s": build_s, **check, "steps": recorder.steps}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
