"""Training a reward model (`hybrid-rl-reward-model`, `tools/train_reward_model.py`).

    hybrid-rl-reward-model sample --prompts train.parquet --out samples.parquet [--model PATH] [--n 4]
    hybrid-rl-reward-model train --data samples.parquet --out my_rm [--base PATH] [--loss pointwise]

`sample` draws responses from a policy (transformers generate, as `rollout.name=hf` does) for the
prompts of an RL data file and labels each with the rule scorer of its `data_source`. `train`
turns a folder (a policy, or a reward model to train further) into a sequence classifier with one
label and trains it on the FSDP engine. Examples (parquet or JSON Lines), one per row:

- labelled: `prompt`, `response`, `label` (in [0, 1]; 1: a good response);
- preferences: `prompt`, `chosen`, `rejected`.

`prompt` is a chat (a list of {role, content}) or a string (one user turn). Rows written by
`sample` also hold `prompt_ids` and `response_ids`, the policy's own tokens: what the reward model
reads during RL when it shares the policy's tokenizer, so it is trained on exactly those; other
rows go through the model's chat template (`model_inputs.template_ids`), as re-templated rollouts do.

`--loss pointwise` fits sigma(r) to the labels; `--loss pairwise` (Bradley-Terry) trains on the
preference pairs, or on pairs formed within each prompt's labelled responses. A held-out share of
the prompts (`--val-fraction`) measures the model before and after: pointwise accuracy (r > 0
exactly for labels > 0.5) and pairwise accuracy (the better response of a pair scores higher).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms.reward_model_loss import pairwise_loss, pointwise_loss
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from hybrid_rl.protocol import Batch
from hybrid_rl.rewards.model_inputs import collate_rows, pad_id, template_ids

logger = logging.getLogger(__name__)

LOSSES = ("pointwise", "pairwise")


class RewardDataError(ValueError):
    """A reward-model data file that cannot be trained on; the message says what to change."""


# ---------------------------------------------------------------------------------------- sample
def sample_responses(prompts_file: str, model_path: str, n: int, max_response_length: int,
                     temperature: float, seed: int, max_prompts: int = -1, batch_prompts: int = 16) -> list[dict]:
    """`n` responses per prompt, each labelled by the rule scorer of its row's data source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybrid_rl.data import RLDataset, collate_prompts
    from hybrid_rl.rewards import default_compute_score
    from hybrid_rl.workers.actor_rollout_ref import eos_ids
    from hybrid_rl.workers.rollout import HFRollout, assemble_rollout

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = RLDataset(prompts_file, tokenizer, max_prompt_length=4096, max_samples=max_prompts)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    stops = eos_ids(model_path, tokenizer)
    rollout = HFRollout(model, pad_id(tokenizer), stops)
    settings = {"temperature": temperature, "top_p": 1.0, "top_k": -1}
    torch.manual_seed(seed)
    examples = []
    for start in range(0, len(dataset), batch_prompts):
        rows = [dataset[i] for i in range(start, min(start + batch_prompts, len(dataset)))]
        prompts = collate_prompts(rows, pad_id(tokenizer), max(len(r["prompt_ids"]) for r in rows)).repeat(n)
        tokens, _ = rollout.generate(prompts, settings, max_response_length)
        batch = assemble_rollout(prompts, tokens, [[0.0] * len(t) for t in tokens], max_response_length,
                                 pad_id(tokenizer), stops)
        for i in range(len(batch)):
            row = rows[i // n]
            response_ids = batch["responses"][i][batch["response_mask"][i].bool()].tolist()
            text = tokenizer.decode(response_ids, skip_special_tokens=True)
            score = default_compute_score(row["data_source"], text, row["reward_model"]["ground_truth"],
                                          row["extra_info"])
            examples.append({"prompt": row["raw_prompt"], "response": text, "label": float(
                score["score"] if isinstance(score, dict) else score), "data_source": row["data_source"],
                "prompt_ids": list(row["prompt_ids"]), "response_ids": response_ids})
        logger.info("sampled %d of %d prompts", min(start + batch_prompts, len(dataset)), len(dataset))
    return examples


# ----------------------------------------------------------------------------------------- data
def read_examples(path: str) -> tuple[list[dict], str]:
    """The rows of a data file and their kind: `labelled` or `preferences`."""
    from hybrid_rl.data.dataset import read_rows, to_messages

    rows = read_rows(path)
    if not rows:
        raise RewardDataError(f"{path} holds no rows.")
    columns = set(rows[0])
    if {"prompt", "response", "label"} <= columns:
        kind = "labelled"
    elif {"prompt", "chosen", "rejected"} <= columns:
        kind = "preferences"
    else:
        raise RewardDataError(f"{path} has columns {sorted(columns)}; a reward-model data file needs prompt, "
                              "response and label (labelled) or prompt, chosen and rejected (preferences).")
    for i, row in enumerate(rows):
        row["prompt"] = to_messages(row["prompt"], i)
        if kind == "labelled" and not (isinstance(row["label"], (int, float)) and 0.0 <= row["label"] <= 1.0):
            raise RewardDataError(f"{path} row {i}: label {row['label']!r} is not a number in [0, 1].")
    return rows, kind


def prompt_key(row: dict) -> str:
    return json.dumps(row["prompt"], sort_keys=True)


def pairs_from_labels(rows: list[dict], rng: random.Random) -> list[tuple[dict, dict]]:
    """(better, worse) pairs within each prompt's labelled responses: the responses sorted by
    label, the best paired with the worst, the second with the second worst, and so on, while
    the first label is higher."""
    by_prompt = defaultdict(list)
    for row in rows:
        by_prompt[prompt_key(row)].append(row)
    pairs = []
    for group in by_prompt.values():
        rng.shuffle(group)  # ties broken at random
        group.sort(key=lambda r: -r["label"])
        for better, worse in zip(group, reversed(group)):
            if better["label"] <= worse["label"]:
                break
            pairs.append((better, worse))
    return pairs


def token_rows(responses: list[tuple[dict, str]], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of each (row, response field): the row's own tokens when it
    has them for that field, else the chat template's."""
    out = []
    for row, field in responses:
        if field == "response" and row.get("prompt_ids") is not None and row.get("response_ids") is not None:
            out.append((list(row["prompt_ids"]), list(row["response_ids"])))
        else:
            out.append(template_ids(tokenizer, row["prompt"], row[field]))
    return out


def split_by_prompt(rows: list[dict], val_fraction: float, rng: random.Random) -> tuple[list[dict], list[dict]]:
    keys = sorted({prompt_key(r) for r in rows})
    rng.shuffle(keys)
    held_out = set(keys[:int(round(len(keys) * val_fraction))])
    return [r for r in rows if prompt_key(r) not in held_out], [r for r in rows if prompt_key(r) in held_out]


# ---------------------------------------------------------------------------------------- train
def reward_model_loss_fn(pairwise: bool):
    """`TrainEngine.update`'s loss callback for a reward model: the mean pointwise loss over the
    mini-batch's labelled rows, or (`pairwise`) the mean Bradley-Terry loss over its pairs (chosen
    and rejected rows interleaved in one micro-batch); also the accuracy."""

    def loss_fn(out, micro, agg):
        scores = out["scores"]
        if pairwise:
            per_example = pairwise_loss(scores[0::2], scores[1::2])
            correct = scores[0::2] > scores[1::2]
            count = agg["global_num_seqs"] / 2
        else:
            per_example = pointwise_loss(scores, micro["labels"])
            correct = (scores > 0) == (micro["labels"] > 0.5)
            count = agg["global_num_seqs"]
        loss = per_example.sum() / count * agg["dp_size"]
        return loss, {"loss": float(loss.detach()), "accuracy": float(correct.sum()) / count * agg["dp_size"]}

    return loss_fn


class RewardModelTrainer:
    """A sequence classifier on the FSDP engine (one process), trained with `engine.update`: every
    batch is one optimizer step, normalised over the batch's examples."""

    def __init__(self, base: str, loss: str, lr: float, total_steps: int, micro_batch_size: int, dtype: str,
                 warmup_ratio: float = 0.1):
        from transformers import AutoTokenizer

        self.loss, self.micro_batch_size = loss, micro_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        model_cfg = OmegaConf.create({"trust_remote_code": False, "override_config": {}, "use_remove_padding": True,
                                      "share_prompt_prefix": True})
        optim = OmegaConf.create({"lr": lr, "betas": [0.9, 0.999], "weight_decay": 0.0, "lr_warmup_steps": -1,
                                  "lr_warmup_steps_ratio": warmup_ratio, "lr_scheduler_type": "cosine",
                                  "min_lr_ratio": 0.0, "num_cycles": 0.5})
        self.role_cfg = OmegaConf.create({"strategy": "fsdp", "fsdp_config": {"dtype": dtype,
                                                                              "reshard_after_forward": True},
                                          "ppo_epochs": 1, "shuffle": False, "ppo_micro_batch_size_per_gpu":
                                          micro_batch_size, "use_dynamic_bsz": False, "grad_clip": 1.0})
        spec = ModelSpec("reward_model", base, model_cfg, head=Head.SCORE, optim_cfg=optim, total_steps=total_steps)
        self.engine = build_engine(spec, self.role_cfg, torch.device("cpu"))

    def batch(self, rows: list[tuple[list[int], list[int]]], labels: list[float] | None = None) -> Batch:
        batch = collate_rows(rows, pad_id(self.tokenizer))
        batch["response_mask"] = batch["attention_mask"][:, -batch["responses"].shape[1]:]
        if labels is not None:
            batch["labels"] = torch.tensor(labels, dtype=torch.float32)
        return batch

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch`: labelled rows, or (pairwise) chosen and rejected rows
        interleaved."""
        cfg = OmegaConf.merge(self.role_cfg, {"ppo_mini_batch_size": len(batch)})
        return self.engine.update(batch, cfg, rollout_n=1, seed=0, output=Output.SCORES, temperature=1.0,
                                  loss_fn=reward_model_loss_fn(self.loss == "pairwise"))

    def scores(self, rows: list[tuple[list[int], list[int]]]) -> list[float]:
        return self.engine.infer(self.batch(rows), Output.SCORES, 1.0, self.micro_batch_size, None)["scores"].tolist()

    def evaluate(self, examples: list[dict], kind: str, rng: random.Random) -> dict[str, float]:
        """Pointwise accuracy and loss (labelled data) and pairwise accuracy and loss."""
        metrics = {}
        if kind == "labelled":
            scores = torch.tensor(self.scores(token_rows([(r, "response") for r in examples], self.tokenizer)))
            labels = torch.tensor([float(r["label"]) for r in examples])
            metrics["pointwise_accuracy"] = float(((scores > 0) == (labels > 0.5)).float().mean())
            metrics["pointwise_loss"] = float(pointwise_loss(scores, labels).mean())
            pairs = pairs_from_labels(examples, rng)
            pair_rows = [((better, "response"), (worse, "response")) for better, worse in pairs]
        else:
            pair_rows = [((r, "chosen"), (r, "rejected")) for r in examples]
        if pair_rows:
            scores = torch.tensor(self.scores(token_rows([x for pair in pair_rows for x in pair], self.tokenizer)))
            metrics["pairwise_accuracy"] = float((scores[0::2] > scores[1::2]).float().mean())
            metrics["pairwise_loss"] = float(pairwise_loss(scores[0::2], scores[1::2]).mean())
            metrics["pairs"] = len(pair_rows)
        return metrics

    def save(self, out: str) -> None:
        from hybrid_rl.export import write_folder

        def write(tmp: Path) -> None:
            self.engine.save_hf_model(str(tmp), self.engine.module.config)
            self.tokenizer.save_pretrained(str(tmp))

        write_folder(Path(out).expanduser().absolute(), write, overwrite=True)


def train_reward_model(data: str, out: str, base: str, loss: str = "pointwise", epochs: int = 1, lr: float = 1e-5,
                       batch_size: int = 32, micro_batch_size: int = 8, val_fraction: float = 0.1, seed: int = 0,
                       dtype: str = "auto") -> dict:
    """Train and save a reward model; returns the held-out metrics before and after, and the
    training curve."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not valid. Valid choices: {', '.join(LOSSES)}.")
    rng = random.Random(seed)
    rows, kind = read_examples(data)
    if kind == "preferences" and loss == "pointwise":
        raise RewardDataError(f"{data} holds preference pairs (chosen, rejected), which train with --loss pairwise.")
    train_rows, val_rows = split_by_prompt(rows, val_fraction, rng)
    if loss == "pointwise":
        train_items = [[(r, "response")] for r in train_rows]
    elif kind == "labelled":
        train_items = [[(b, "response"), (w, "response")] for b, w in pairs_from_labels(train_rows, rng)]
    else:
        train_items = [[(r, "chosen"), (r, "rejected")] for r in train_rows]
    if not train_items:
        raise RewardDataError(f"{data} gives no training examples for --loss {loss} (pairs need two responses of "
                              "one prompt with different labels).")
    per_step = batch_size // len(train_items[0])
    if per_step < 1 or (loss == "pairwise" and micro_batch_size % 2):
        raise ValueError("--batch-size must hold at least one example and, for pairwise training, "
                         "--micro-batch-size must be even (a pair's two rows share a micro-batch).")
    steps_per_epoch = math.ceil(len(train_items) / per_step)
    torch.manual_seed(seed)  # a policy folder gets a fresh score head: the same one on every run
    trainer = RewardModelTrainer(base, loss, lr, epochs * steps_per_epoch, micro_batch_size, dtype)
    result = {"data": data, "base": base, "loss": loss, "kind": kind, "train_examples": len(train_items),
              "val_rows": len(val_rows), "before": trainer.evaluate(val_rows, kind, random.Random(seed)),
              "curve": []}
    logger.info("held out before training: %s", result["before"])
    for epoch in range(epochs):
        rng.shuffle(train_items)
        for start in range(0, len(train_items), per_step):
            items = train_items[start:start + per_step]
            flat = [x for item in items for x in item]
            labels = [float(row["label"]) for row, _ in flat] if loss == "pointwise" else None
            metrics = trainer.step(trainer.batch(token_rows(flat, trainer.tokenizer), labels))
            result["curve"].append({"epoch": epoch, "loss": metrics["reward_model/loss"],
                                    "accuracy": metrics["reward_model/accuracy"]})
            if len(result["curve"]) % 10 == 0 or len(result["curve"]) == epochs * steps_per_epoch:
                logger.info("step %d/%d (epoch %d): loss %.4f, accuracy %.3f", len(result["curve"]),
                            epochs * steps_per_epoch, epoch + 1, metrics["reward_model/loss"],
                            metrics["reward_model/accuracy"])
    result["after"] = trainer.evaluate(val_rows, kind, random.Random(seed))
    logger.info("held out after training: %s", result["after"])
    trainer.save(out)
    with open(Path(out) / "reward_model_training.json", "w") as f:
        json.dump(result, f, indent=1)
    return result


# ------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    from hybrid_rl.models import ModelPathError, resolve_model_path

    ap = argparse.ArgumentParser(prog="hybrid-rl-reward-model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="sample responses from a policy and label them with the rule scorer")
    s.add_argument("--prompts", required=True, help="RL data file (parquet / JSON Lines, verl's schema)")
    s.add_argument("--out", required=True, help="parquet or .jsonl file to write")
    s.add_argument("--model", default=None, help="policy folder or .gguf (default: the default model)")
    s.add_argument("--n", type=int, default=4, help="responses per prompt")
    s.add_argument("--max-prompts", type=int, default=-1, help="use the first N prompts (-1: all)")
    s.add_argument("--max-response-length", type=int, default=64)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train", help="train a reward model on labelled responses or preference pairs")
    t.add_argument("--data", required=True, help="parquet / JSON Lines with prompt,response,label or "
                                                 "prompt,chosen,rejected")
    t.add_argument("--out", required=True, help="folder to write the reward model to (replaced if it exists)")
    t.add_argument("--base", default=None, help="folder to start from: a policy (a fresh score head) or a "
                                                "reward model (default: the default model)")
    t.add_argument("--loss", choices=LOSSES, default="pointwise")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--lr", type=float, default=1e-5)
    t.add_argument("--batch-size", type=int, default=32, help="rows per optimizer step")
    t.add_argument("--micro-batch-size", type=int, default=8, help="rows per forward")
    t.add_argument("--val-fraction", type=float, default=0.1, help="share of the prompts held out")
    t.add_argument("--dtype", default="auto", help="compute dtype (auto: chosen from this CPU)")
    t.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "sample":
            model = resolve_model_path(args.model, key="--model")
            examples = sample_responses(args.prompts, model, args.n, args.max_response_length, args.temperature,
                                        args.seed, args.max_prompts)
            write_examples(examples, args.out)
            good = sum(e["label"] > 0.5 for e in examples)
            print(f"wrote {len(examples)} labelled responses ({good} with label > 0.5) to {args.out}")
        else:
            base = resolve_model_path(args.base, key="--base")
            result = train_reward_model(args.data, args.out, base, args.loss, args.epochs, args.lr, args.batch_size,
                                        args.micro_batch_size, args.val_fraction, args.seed, args.dtype)
            print(json.dumps({"out": args.out, "before": result["before"], "after": result["after"]}))
    except (RewardDataError, ModelPathError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def write_examples(examples: list[dict], out: str) -> None:
    """Parquet (.parquet) or JSON Lines (.jsonl), written to a temporary name and renamed."""
    tmp = f"{out}.tmp{os.getpid()}"
    if out.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(examples), tmp)
    elif out.endswith(".jsonl"):
        with open(tmp, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in examples)
    else:
        raise ValueError(f"--out {out}: write a .parquet or a .jsonl file.")
    os.replace(tmp, out)
