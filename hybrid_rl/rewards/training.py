"""Training a reward model (`hybrid-rl-reward-model`, `tools/train_reward_model.py`).

    hybrid-rl-reward-model sample --prompts train.parquet --out samples.parquet [--model PATH] [--n 4]
    hybrid-rl-reward-model train --data samples.parquet --out my_rm [--base PATH] [--loss pointwise]

`sample` draws responses from a policy (transformers generate, as `rollout.name=hf` does) for the
prompts of an RL data file and labels each with the rule scorer of its `data_source`. `train`
turns a folder (a policy, or a reward model to train further) into a sequence classifier with one
label and trains it on the FSDP engine. Examples (parquet or JSON Lines), one per row:

- labelled: `prompt`, `response`, `label` (in [0, 1]; 1: a good response);
- preferences: `prompt`, `chosen`, `rejected`;
- labelled steps (a process reward model): `prompt`, `steps` (the response's reasoning steps, in
  order), `labels` (one number in [0, 1] per step).

`prompt` is a chat (a list of {role, content}) or a string (one user turn). Rows written by
`sample` also hold `prompt_ids` and `response_ids`, the policy's own tokens: what the reward model
reads during RL when it shares the policy's tokenizer, so it is trained on exactly those; other
rows go through the model's chat template (`model_inputs.template_ids`), as re-templated rollouts do.

`--loss pointwise` fits sigma(r) to the labels; `--loss pairwise` (Bradley-Terry) trains on the
preference pairs, or on pairs formed within each prompt's labelled responses. A held-out share of
the prompts (`--val-fraction`) measures the model before and after: pointwise accuracy (r > 0
exactly for labels > 0.5) and pairwise accuracy (the better response of a pair scores higher).

Labelled steps train a process reward model, read exactly as `reward_model.process.*` reads it
during RL: the response is the steps joined by `--step-separator`, written as the policy would
write it (its tokens, then EOS), and each step's score sits on the token that ends the step. A
policy folder becomes a token classifier with a fresh head (two labels, P(good)), a token
classifier trains further, and with `--step-tag` a causal LM trains as a step-tag scorer (P of
the first of `--step-tag-tokens` after each tag). The loss is the binary cross-entropy of each
step's P(good) (or, for a one-label head, sigma(score)) against its label. `sample
--step-scorer file.py[:function]` labels the steps of sampled responses with a function that
returns `step_rewards` and `step_ends` (a `grpo_process` reward function, such as
recipes/deepseekmath_grpo/step_reward.py), `sample --completions K` by Math-Shepherd's
completions (`completion_labels`).
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

from hybrid_rl.algorithms.reward_model_loss import pairwise_loss, pointwise_loss, probability_loss
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from hybrid_rl.protocol import Batch
from hybrid_rl.rewards.model_inputs import RewardInputs, collate_rows, pad_id, template_ids
from hybrid_rl.rewards.steps import decoded_prefix_lengths, step_ends, token_at

logger = logging.getLogger(__name__)

LOSSES = ("pointwise", "pairwise")


class RewardDataError(ValueError):
    """A reward-model data file that cannot be trained on; the message says what to change."""


# ---------------------------------------------------------------------------------------- sample
def sample_responses(prompts_file: str, model_path: str, n: int, max_response_length: int,
                     temperature: float, seed: int, max_prompts: int = -1, batch_prompts: int = 16,
                     step_scorer=None, completions: int = 0, separator: str = "\n") -> list[dict]:
    """`n` responses per prompt, each labelled by the rule scorer of its row's data source, or
    split into steps (at `separator`) and each step labelled: by `step_scorer` (a process reward
    function), or with `completions` > 0 by Math-Shepherd's completions (`completion_labels`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybrid_rl.data import RLDataset, collate_prompts
    from hybrid_rl.evaluate import score_of
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

    def continuations(prompt_ids: list[list[int]], each: int) -> list[list[int]]:
        """`each` sampled continuations of every token list, in order, cut at the stop token."""
        rows = [{"prompt_ids": ids} for ids in prompt_ids]
        prompts = collate_prompts(rows, pad_id(tokenizer), max(map(len, prompt_ids))).repeat(each)
        tokens, _ = rollout.generate(prompts, settings, max_response_length)
        batch = assemble_rollout(prompts, tokens, [[0.0] * len(t) for t in tokens], max_response_length,
                                 pad_id(tokenizer), stops)
        return [batch["responses"][i][batch["response_mask"][i].bool()].tolist() for i in range(len(batch))]

    examples = []
    for start in range(0, len(dataset), batch_prompts):
        rows = [dataset[i] for i in range(start, min(start + batch_prompts, len(dataset)))]
        for i, response_ids in enumerate(continuations([list(r["prompt_ids"]) for r in rows], n)):
            row = rows[i // n]
            text = tokenizer.decode(response_ids, skip_special_tokens=True)

            def rule(answer: str) -> tuple[float, bool]:
                return score_of(default_compute_score(row["data_source"], answer, row["reward_model"]["ground_truth"],
                                                      row["extra_info"]))

            def complete(prefixes: list[list[int]]) -> list[list[int]]:
                return continuations([list(row["prompt_ids"]) + p for p in prefixes], completions)

            if step_scorer is not None or completions:
                labelled = (labelled_steps(step_scorer, row, text) if step_scorer is not None else
                            completion_labels(tokenizer, response_ids, text, separator, completions, complete,
                                              lambda answer: rule(answer)[1]))
                if labelled is not None:
                    examples.append({"prompt": row["raw_prompt"], "steps": labelled[0], "labels": labelled[1],
                                     "data_source": row["data_source"]})
                continue
            examples.append({"prompt": row["raw_prompt"], "response": text, "label": rule(text)[0],
                             "data_source": row["data_source"], "prompt_ids": list(row["prompt_ids"]),
                             "response_ids": response_ids})
        logger.info("sampled %d of %d prompts", min(start + batch_prompts, len(dataset)), len(dataset))
    return examples


def completion_labels(tokenizer, response_ids: list[int], text: str, separator: str, k: int, complete,
                      correct) -> tuple[list[str], list[float]] | None:
    """Math-Shepherd's hard estimation of step labels: the response is split into steps at
    `separator`; a step is good (1.0) when at least one of `k` continuations of the response up
    to that step's end (`complete(prefixes)`: k token lists per prefix, in order) reaches a
    `correct` answer, the last step when the response itself does. The steps' texts and labels;
    None for a response without steps."""
    ends = step_ends(text, separator)
    steps = step_texts(text, ends)
    if steps is None:
        return None
    token_ends = decoded_prefix_lengths(tokenizer, response_ids)
    prefixes = [response_ids[:token_at(token_ends, end) + 1] for end in ends[:-1]]
    outs = complete(prefixes) if prefixes else []
    labels = [float(any(correct(tokenizer.decode(prefix + outs[j * k + c], skip_special_tokens=True))
                        for c in range(k))) for j, prefix in enumerate(prefixes)]
    return steps, labels + [float(correct(text))]


def step_texts(text: str, ends: list[int]) -> list[str] | None:
    """The steps of `text` that end at `ends`, stripped; None when there are none or one is blank."""
    steps = [text[start:end].strip() for start, end in zip([0] + ends[:-1], ends)]
    return steps if steps and all(steps) else None


def labelled_steps(step_scorer, row: dict, text: str) -> tuple[list[str], list[float]] | None:
    """A response's steps and labels as `step_scorer` splits and scores them (`step_ends`,
    `step_rewards` clipped to [0, 1]); None for a response without steps."""
    result = step_scorer(data_source=row["data_source"], solution_str=text,
                         ground_truth=row["reward_model"]["ground_truth"], extra_info=row["extra_info"])
    if not (isinstance(result, dict) and "step_rewards" in result and "step_ends" in result):
        raise RewardDataError("--step-scorer must return a dict with step_rewards and step_ends (a process reward "
                              f"function, as algorithm.adv_estimator=grpo_process reads it); it returned {result!r}.")
    steps = step_texts(text, list(result["step_ends"]))
    if steps is None or len(steps) != len(result["step_rewards"]):
        return None
    return steps, [min(1.0, max(0.0, float(r))) for r in result["step_rewards"]]


# ----------------------------------------------------------------------------------------- data
def read_examples(path: str | list[str]) -> tuple[list[dict], str]:
    """The rows of one or more data files and their kind: `labelled`, `preferences` or `steps`."""
    from hybrid_rl.data.dataset import read_rows, to_messages

    rows = read_rows(path)
    path = path if isinstance(path, str) else " + ".join(path)
    if not rows:
        raise RewardDataError(f"{path} holds no rows.")
    columns = set(rows[0])
    if {"prompt", "response", "label"} <= columns:
        kind = "labelled"
    elif {"prompt", "chosen", "rejected"} <= columns:
        kind = "preferences"
    elif {"prompt", "steps", "labels"} <= columns:
        kind = "steps"
    else:
        raise RewardDataError(f"{path} has columns {sorted(columns)}; a reward-model data file needs prompt, "
                              "response and label (labelled), prompt, chosen and rejected (preferences), or prompt, "
                              "steps and labels (labelled steps, for a process reward model).")
    for i, row in enumerate(rows):
        row["prompt"] = to_messages(row["prompt"], i)
        if kind == "labelled" and not _unit_number(row["label"]):
            raise RewardDataError(f"{path} row {i}: label {row['label']!r} is not a number in [0, 1].")
        if kind == "steps":
            steps, labels = list(row["steps"]), list(row["labels"])
            if not steps or not all(isinstance(step, str) and step.strip() for step in steps):
                raise RewardDataError(f"{path} row {i}: steps must be a non-empty list of non-blank texts.")
            if len(labels) != len(steps) or not all(_unit_number(label) for label in labels):
                raise RewardDataError(f"{path} row {i}: labels must hold one number in [0, 1] per step "
                                      f"({len(steps)} steps, labels {labels!r}).")
            row["steps"], row["labels"] = steps, [float(label) for label in labels]
    return rows, kind


def _unit_number(value) -> bool:
    return isinstance(value, (int, float)) and 0.0 <= value <= 1.0


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


def step_probabilities(engine) -> bool:
    """Whether a process reward model's step scores are P(good) (a step-tag scorer, a two-label
    token classifier) rather than a one-label head's logit."""
    head = engine.spec.head
    return head is Head.STEP_TAG or (head is Head.STEP_SCORE and engine.hf_module().config.num_labels == 2)


def step_loss_fn(probabilities: bool):
    """`TrainEngine.update`'s loss callback for a process reward model: the mean over the
    mini-batch's labelled steps (the `response_mask` marks each step's scored token, so the
    engine's global token count is the step count) of the binary cross-entropy of P(good)
    (`probabilities`) or of sigma(score) against `step_labels`; also the step accuracy."""

    def loss_fn(out, micro, agg):
        mask = micro["response_mask"].bool()
        scores, labels = out["token_scores"][mask], micro["step_labels"][mask]
        per_step = probability_loss(scores, labels) if probabilities else pointwise_loss(scores, labels)
        correct = (scores > (0.5 if probabilities else 0.0)) == (labels > 0.5)
        scale = agg["dp_size"] / agg["global_num_tokens"]
        loss = per_step.sum() * scale
        return loss, {"loss": float(loss.detach()), "accuracy": float(correct.sum()) * scale}

    return loss_fn


def place_step_labels(steps: list, step_labels: list, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step's label on the reward model's token that ends the step (`steps` as
    `RewardInputs.with_steps` gives them; a step cut away by `max_length` keeps no label), and
    the mask of those tokens; both `shape` (B, T) of the reward model's response columns."""
    labels = torch.zeros(shape, dtype=torch.float32)
    mask = torch.zeros(shape, dtype=torch.long)
    for i, (row_steps, row_labels) in enumerate(zip(steps, step_labels)):
        for (_, token), label in zip(row_steps, row_labels):
            labels[i, token], mask[i, token] = label, 1
    return labels, mask


class StepRows:
    """Labelled steps as a process reward model reads them during RL: the prompt through the
    chat template, the steps joined by `separator` as the policy's response (its tokens, then
    EOS), split again by `RewardInputs.with_steps`, with each step's label on the token where its
    score is read (`step_labels`, and `response_mask` marking those tokens)."""

    def __init__(self, tokenizer, separator: str, step_tag: str | None):
        self.tokenizer, self.separator = tokenizer, separator
        self.inputs = RewardInputs(tokenizer, tokenizer, None, step_tag)

    def __call__(self, examples: list[dict]) -> Batch:
        rows = []
        for example in examples:
            prompt = self.tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=False)
            response = self.tokenizer(self.separator.join(example["steps"]), add_special_tokens=False)["input_ids"]
            rows.append((self.tokenizer(prompt, add_special_tokens=False)["input_ids"],
                         response + [self.tokenizer.eos_token_id]))
        policy = collate_rows(rows, pad_id(self.tokenizer))
        policy = Batch(tensors=policy.tensors, non_tensors={"raw_prompt": [e["prompt"] for e in examples]})
        batch, _, steps = self.inputs.with_steps(policy, self.separator)
        for example, row_steps in zip(examples, steps):
            if len(row_steps) != len(example["steps"]):
                raise RewardDataError(
                    f"the steps of {example['steps']!r} joined by {self.separator!r} split into {len(row_steps)} "
                    f"steps, not {len(example['steps'])}: a step holds the separator or is blank. Choose a "
                    "--step-separator no step contains (the reward_model.process.step_separator of the RL run).")
        batch["step_labels"], batch["response_mask"] = place_step_labels(steps, [e["labels"] for e in examples],
                                                                         batch["responses"].shape)
        return batch


class RewardModelTrainer:
    """A reward model on the FSDP engine (one process), trained with `engine.update`: every
    batch is one optimizer step, normalised over the batch's examples (steps, for a process
    reward model: `head` STEP_SCORE or STEP_TAG)."""

    def __init__(self, base: str, loss: str, lr: float, total_steps: int, micro_batch_size: int, dtype: str,
                 warmup_ratio: float = 0.1, head: Head = Head.SCORE, tag_token_ids: tuple[int, int] | None = None):
        from transformers import AutoTokenizer

        self.loss, self.micro_batch_size, self.head = loss, micro_batch_size, head
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        model_cfg = OmegaConf.create({"trust_remote_code": False, "override_config": {}, "use_remove_padding": True,
                                      "share_prompt_prefix": True, "enable_gradient_checkpointing": False})
        optim = OmegaConf.create({"lr": lr, "betas": [0.9, 0.999], "weight_decay": 0.0, "lr_warmup_steps": -1,
                                  "lr_warmup_steps_ratio": warmup_ratio, "lr_scheduler_type": "cosine",
                                  "min_lr_ratio": 0.0, "num_cycles": 0.5})
        self.role_cfg = OmegaConf.create({"strategy": "fsdp", "fsdp_config": {"dtype": dtype,
                                                                              "reshard_after_forward": True},
                                          "ppo_epochs": 1, "shuffle": False, "ppo_micro_batch_size_per_gpu":
                                          micro_batch_size, "use_dynamic_bsz": False, "grad_clip": 1.0})
        spec = ModelSpec("reward_model", base, model_cfg, head=head, optim_cfg=optim, total_steps=total_steps,
                         tag_token_ids=tag_token_ids)
        self.engine = build_engine(spec, self.role_cfg, torch.device("cpu"))
        self.probabilities = step_probabilities(self.engine)

    def batch(self, rows: list[tuple[list[int], list[int]]], labels: list[float] | None = None) -> Batch:
        batch = collate_rows(rows, pad_id(self.tokenizer))
        batch["response_mask"] = batch["attention_mask"][:, -batch["responses"].shape[1]:]
        if labels is not None:
            batch["labels"] = torch.tensor(labels, dtype=torch.float32)
        return batch

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch`: labelled rows, (pairwise) chosen and rejected rows
        interleaved, or `StepRows`."""
        cfg = OmegaConf.merge(self.role_cfg, {"ppo_mini_batch_size": len(batch)})
        if self.head is not Head.SCORE:
            return self.engine.update(batch, cfg, rollout_n=1, seed=0, output=Output.TOKEN_SCORES, temperature=1.0,
                                      loss_fn=step_loss_fn(self.probabilities))
        return self.engine.update(batch, cfg, rollout_n=1, seed=0, output=Output.SCORES, temperature=1.0,
                                  loss_fn=reward_model_loss_fn(self.loss == "pairwise"))

    def step_scores(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores of `StepRows` at their labelled steps, and the labels."""
        scores = self.engine.infer(batch, Output.TOKEN_SCORES, 1.0, self.micro_batch_size, None)["token_scores"]
        mask = batch["response_mask"].bool()
        return scores[mask], batch["step_labels"][mask]

    def evaluate_steps(self, batch: Batch) -> dict[str, float]:
        """Step accuracy (P(good) > 0.5, or score > 0, exactly for labels > 0.5) and loss."""
        scores, labels = self.step_scores(batch)
        loss = probability_loss(scores, labels) if self.probabilities else pointwise_loss(scores, labels)
        correct = (scores > (0.5 if self.probabilities else 0.0)) == (labels > 0.5)
        return {"step_accuracy": float(correct.float().mean()), "step_loss": float(loss.mean()),
                "steps": len(labels), "good_steps": int((labels > 0.5).sum())}

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


def train_reward_model(data: str | list[str], out: str, base: str, loss: str = "pointwise", epochs: int = 1, lr: float = 1e-5,
                       batch_size: int = 32, micro_batch_size: int = 8, val_fraction: float = 0.1, seed: int = 0,
                       dtype: str = "auto", step_separator: str = "\n", step_tag: str | None = None,
                       step_tag_tokens: tuple[str, str] = ("+", "-")) -> dict:
    """Train and save a reward model (a process reward model from labelled steps); returns the
    held-out metrics before and after, and the training curve."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not valid. Valid choices: {', '.join(LOSSES)}.")
    rng = random.Random(seed)
    rows, kind = read_examples(data)
    data = data if isinstance(data, str) else " + ".join(data)  # as error messages name it
    if kind == "preferences" and loss == "pointwise":
        raise RewardDataError(f"{data} holds preference pairs (chosen, rejected), which train with --loss pairwise.")
    if kind == "steps":
        if loss != "pointwise":
            raise RewardDataError(f"{data} holds labelled steps, which train a process reward model with --loss "
                                  "pointwise (each step against its label).")
        return train_process_reward_model(rows, data, out, base, epochs, lr, batch_size, micro_batch_size,
                                          val_fraction, seed, dtype, step_separator, step_tag, step_tag_tokens)
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

    def batch_of(items: list[list[tuple[dict, str]]]) -> Batch:
        flat = [x for item in items for x in item]
        labels = [float(row["label"]) for row, _ in flat] if loss == "pointwise" else None
        return trainer.batch(token_rows(flat, trainer.tokenizer), labels)

    result["curve"] = run_epochs(trainer, train_items, per_step, epochs, rng, batch_of)
    result["after"] = trainer.evaluate(val_rows, kind, random.Random(seed))
    return finish(trainer, result, out)


def run_epochs(trainer: RewardModelTrainer, items: list, per_step: int, epochs: int, rng: random.Random,
               batch_of) -> list[dict]:
    """`epochs` shuffled passes over `items`, an optimizer step on the batch `batch_of` makes of
    each `per_step` of them; the training curve (loss and accuracy of every step)."""
    curve, total = [], epochs * math.ceil(len(items) / per_step)
    for epoch in range(epochs):
        rng.shuffle(items)
        for start in range(0, len(items), per_step):
            metrics = trainer.step(batch_of(items[start:start + per_step]))
            curve.append({"epoch": epoch, "loss": metrics["reward_model/loss"],
                          "accuracy": metrics["reward_model/accuracy"]})
            if len(curve) % 10 == 0 or len(curve) == total:
                logger.info("step %d/%d (epoch %d): loss %.4f, accuracy %.3f", len(curve), total, epoch + 1,
                            metrics["reward_model/loss"], metrics["reward_model/accuracy"])
    return curve


def finish(trainer: RewardModelTrainer, result: dict, out: str) -> dict:
    """Save the trained model and `reward_model_training.json` in `out`."""
    logger.info("held out after training: %s", result["after"])
    trainer.save(out)
    with open(Path(out) / "reward_model_training.json", "w") as f:
        json.dump(result, f, indent=1)
    return result


def train_process_reward_model(rows: list[dict], data: str, out: str, base: str, epochs: int, lr: float,
                               batch_size: int, micro_batch_size: int, val_fraction: float, seed: int, dtype: str,
                               separator: str, step_tag: str | None, step_tag_tokens: tuple[str, str]) -> dict:
    """`train_reward_model` for labelled steps: a token classifier, or with `step_tag` a step-tag
    scorer, trained on each step's label where `reward_model.process.*` reads its score."""
    from transformers import AutoConfig, AutoTokenizer

    from hybrid_rl.workers.reward_model import tag_token_ids_of

    if not separator:
        raise ValueError("--step-separator must be a non-empty string (the steps are joined and split at it).")
    rng = random.Random(seed)
    train_rows, val_rows = split_by_prompt(rows, val_fraction, rng)
    tag_ids = None
    if step_tag is not None:
        architectures = AutoConfig.from_pretrained(base).architectures or []
        if not any(name.endswith("ForCausalLM") for name in architectures):
            raise RewardDataError(f"--step-tag trains a step-tag scorer, a causal LM; {base} holds "
                                  f"{', '.join(architectures) or 'no architecture'}. Start from a policy folder, or "
                                  "leave --step-tag out to train a token classifier.")
        tag_ids = tag_token_ids_of(AutoTokenizer.from_pretrained(base), step_tag_tokens)
    steps_per_epoch = math.ceil(len(train_rows) / batch_size)
    torch.manual_seed(seed)  # a policy folder gets a fresh head: the same one on every run
    trainer = RewardModelTrainer(base, "pointwise", lr, epochs * steps_per_epoch, micro_batch_size, dtype,
                                 head=Head.STEP_SCORE if step_tag is None else Head.STEP_TAG, tag_token_ids=tag_ids)
    step_rows = StepRows(trainer.tokenizer, separator, step_tag)
    val_batch = step_rows(val_rows) if val_rows else None
    result = {"data": data, "base": base, "loss": "pointwise", "kind": "steps", "step_separator": separator,
              "step_tag": step_tag, "train_examples": len(train_rows), "val_rows": len(val_rows),
              "before": trainer.evaluate_steps(val_batch) if val_batch else {}, "curve": []}
    logger.info("held out before training: %s", result["before"])
    result["curve"] = run_epochs(trainer, train_rows, batch_size, epochs, rng, step_rows)
    result["after"] = trainer.evaluate_steps(val_batch) if val_batch else {}
    return finish(trainer, result, out)


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
    s.add_argument("--step-scorer", default=None, help="file.py[:function] (default function compute_score): label "
                                                       "each step with this process reward function instead")
    s.add_argument("--completions", type=int, default=0, help="label each step by Math-Shepherd's completions "
                                                              "instead: good when one of this many continuations "
                                                              "from the step's end is right by the rule")
    s.add_argument("--step-separator", default="\n", help="--completions: where responses split into steps")
    t = sub.add_parser("train", help="train a reward model on labelled responses, preference pairs or labelled steps")
    t.add_argument("--data", required=True, nargs="+", help="parquet / JSON Lines with prompt,response,label, "
                                                            "prompt,chosen,rejected or prompt,steps,labels (several "
                                                            "files: their rows together)")
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
    t.add_argument("--step-separator", default="\n", help="labelled steps: what joins them (as "
                                                          "reward_model.process.step_separator splits them)")
    t.add_argument("--step-tag", default=None, help="labelled steps: train a causal LM as a step-tag scorer with this "
                                                    "tag (as reward_model.process.step_tag)")
    t.add_argument("--step-tag-tokens", nargs=2, default=["+", "-"], metavar=("GOOD", "BAD"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "sample":
            model = resolve_model_path(args.model, key="--model")
            step_scorer = None
            if args.step_scorer:
                from hybrid_rl.rewards.custom import load_function_ref

                step_scorer = load_function_ref(args.step_scorer, "--step-scorer")
            if step_scorer is not None and args.completions:
                raise ValueError("--step-scorer and --completions both label steps; give one of them.")
            examples = sample_responses(args.prompts, model, args.n, args.max_response_length, args.temperature,
                                        args.seed, args.max_prompts, step_scorer=step_scorer,
                                        completions=args.completions, separator=args.step_separator)
            write_examples(examples, args.out)
            if step_scorer is None and not args.completions:
                good = sum(e["label"] > 0.5 for e in examples)
                print(f"wrote {len(examples)} labelled responses ({good} with label > 0.5) to {args.out}")
            else:
                labels = [label for e in examples for label in e["labels"]]
                print(f"wrote {len(examples)} responses with {len(labels)} labelled steps "
                      f"({sum(label > 0.5 for label in labels)} with label > 0.5) to {args.out}")
        else:
            base = resolve_model_path(args.base, key="--base")
            result = train_reward_model(args.data, args.out, base, args.loss, args.epochs, args.lr, args.batch_size,
                                        args.micro_batch_size, args.val_fraction, args.seed, args.dtype,
                                        args.step_separator, args.step_tag, tuple(args.step_tag_tokens))
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
