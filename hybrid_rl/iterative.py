"""Iterative RL (DeepSeekMath §4.2, `trainer.iterative.*`): the samples the reward model is
trained on between iterations.

Every training step's responses are kept with a label: the rule scorer of the row's data source,
clipped to [0, 1] (1: right); for a process reward model also a label per step, from the
configured step scorer (`trainer.iterative.reward_model.step_scorer`). At the end of an iteration (every `freq` steps) the reward model
trains on that iteration's samples plus the replay buffer, then a random `replay_ratio` share of
the iteration's samples joins the buffer. Both lists are saved with each checkpoint, so a resumed
run trains on exactly what an uninterrupted one would.
"""

from __future__ import annotations

import math
import os
import random
from typing import Any

import torch

from hybrid_rl.protocol import Batch
from hybrid_rl.rewards import default_compute_score
from hybrid_rl.rewards.model_inputs import collate_rows
from hybrid_rl.rewards.steps import step_ends

STATE_FILE = "iterative.pt"


def load_step_scorer(cfg: Any):
    """The function that labels each step for a process reward model's training
    (`trainer.iterative.reward_model.step_scorer`); None for an outcome reward model."""
    from hybrid_rl.rewards.custom import load_function_ref

    if not (cfg.trainer.iterative.enable and cfg.reward_model.enable and cfg.reward_model.process.enable):
        return None
    return load_function_ref(cfg.trainer.iterative.reward_model.step_scorer,
                             "trainer.iterative.reward_model.step_scorer")


class IterationSamples:
    """`step_scorer` and `separator`: the step labels of a process reward model (None: outcome
    labels only)."""

    def __init__(self, cfg: Any, tokenizer, pad_token_id: int, seed: int, step_scorer=None,
                 separator: str | None = None):
        self.cfg, self.tokenizer, self.pad_token_id, self.seed = cfg, tokenizer, pad_token_id, seed
        self.step_scorer, self.separator = step_scorer, separator
        self.pending: list[dict] = []  # this iteration's samples
        self.replay: list[dict] = []  # the buffer: shares of earlier iterations' samples
        self.unlabelled = 0  # responses the step scorer split otherwise than the reward model does

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0

    def collect(self, batch: Batch) -> None:
        """Keep each response of a training step's rollouts (its tokens, chat and label)."""
        responses = batch["responses"]
        prompt_width = batch["input_ids"].shape[1] - responses.shape[1]
        for i in range(len(batch)):
            mask = batch["attention_mask"][i].bool()
            response_ids = responses[i][mask[prompt_width:]].tolist()
            text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
            args = (batch["data_source"][i], text, batch["reward_model"][i]["ground_truth"],
                    batch["extra_info"][i] if "extra_info" in batch else None)
            score = default_compute_score(*args)
            score = score["score"] if isinstance(score, dict) else score
            sample = {"prompt_ids": batch["input_ids"][i, :prompt_width][mask[:prompt_width]].tolist(),
                      "response_ids": response_ids, "raw_prompt": list(batch["raw_prompt"][i]),
                      "label": _unit(score)}
            if self.step_scorer is not None:
                result = self.step_scorer(data_source=args[0], solution_str=text, ground_truth=args[2],
                                          extra_info=args[3])
                if not (isinstance(result, dict) and "step_rewards" in result):
                    raise ValueError("trainer.iterative.reward_model.step_scorer must return a dict with step_rewards "
                                     f"(one number per step), as a grpo_process reward function does; it returned "
                                     f"{result!r}.")
                steps = result["step_rewards"]
                if len(steps) != len(step_ends(text, self.separator)):
                    self.unlabelled += 1
                    continue
                sample["step_labels"] = [_unit(reward) for reward in steps]
            self.pending.append(sample)

    def training_batch(self, step: int, dp_size: int) -> Batch:
        """This iteration's samples and the replay buffer as rollout rows with `labels` and
        `replayed` (a whole multiple of `dp_size` rows, so no rank trains on padding); then the
        iteration's replay share joins the buffer and the iteration ends."""
        rng = random.Random(self.seed + step)
        examples = [(e, False) for e in self.pending] + [(e, True) for e in self.replay]
        rng.shuffle(examples)
        examples = examples[:len(examples) - len(examples) % dp_size]
        batch = collate_rows([(e["prompt_ids"], e["response_ids"]) for e, _ in examples], self.pad_token_id)
        batch["labels"] = torch.tensor([e["label"] for e, _ in examples], dtype=torch.float32)
        batch["replayed"] = torch.tensor([replayed for _, replayed in examples])
        batch["raw_prompt"] = [e["raw_prompt"] for e, _ in examples]
        if self.step_scorer is not None:
            batch["step_labels"] = [e["step_labels"] for e, _ in examples]
        self.replay += rng.sample(self.pending, math.ceil(self.cfg.replay_ratio * len(self.pending)))
        self.pending = []
        return batch

    def save(self, folder: str) -> None:
        torch.save({"pending": self.pending, "replay": self.replay, "unlabelled": self.unlabelled},
                   os.path.join(folder, STATE_FILE))

    def load(self, folder: str) -> None:
        state = torch.load(os.path.join(folder, STATE_FILE), weights_only=True)
        self.pending, self.replay = state["pending"], state["replay"]
        self.unlabelled = state.get("unlabelled", 0)


def _unit(value) -> float:
    return min(max(float(value), 0.0), 1.0)
