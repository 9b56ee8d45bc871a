"""The reward model: a sequence classifier (`AutoModelForSequenceClassification`, one label) that
scores each response, or with `reward_model.process.enable` a process reward model (a token
classifier) that scores each reasoning step, on a training engine (`reward_model.strategy`)
colocated in the actor's worker processes. What it reads is built by
`hybrid_rl.rewards.model_inputs`.
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from hybrid_rl.controller import Dispatch, register
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from hybrid_rl.models import load_tokenizer
from hybrid_rl.protocol import Batch
from hybrid_rl.rewards.model_inputs import RewardInputs
from hybrid_rl.workers.base import ModelWorker


class RewardModelWorker(ModelWorker):
    def __init__(self, config: dict, model_path: str, total_steps: int, policy_path: str):
        super().__init__(config, model_path, total_steps)
        self.policy_path = policy_path

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        from transformers import AutoTokenizer

        self.device = self.setup_device()
        rm_cfg = self.cfg.reward_model
        head = Head.STEP_SCORE if rm_cfg.process.enable else Head.SCORE
        spec = ModelSpec("reward_model", self.model_path, rm_cfg.model, head=head)
        role_cfg = OmegaConf.create({"strategy": rm_cfg.strategy, "fsdp_config": rm_cfg.model.fsdp_config})
        self.reward_model = build_engine(spec, role_cfg, self.device)
        reward_tokenizer = AutoTokenizer.from_pretrained(self.model_path,
                                                         trust_remote_code=rm_cfg.model.trust_remote_code)
        self.inputs = RewardInputs(load_tokenizer(self.cfg, self.policy_path), reward_tokenizer, rm_cfg.max_length)
        return {"rank": self.rank, "params": self.reward_model.num_params(), "retemplate": self.inputs.retemplate}

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="reward_model")
    def compute_rm_score(self, batch: Batch) -> Batch:
        """`rm_scores` (B,): the reward model's score of each row, read at its last token, and
        `rm_truncated` (B,): whether the row was cut to `reward_model.max_length`. A process reward
        model adds `rm_step_scores` (B, T), each step's score on the policy's token that ends the
        step, and `rm_step_mask` (B, T) marking those tokens; `rm_scores` is then their sum."""
        cfg = self.cfg.reward_model
        max_tokens = cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        if not cfg.process.enable:
            rows, cut = self.inputs(batch)
            scores = self.reward_model.infer(rows, Output.SCORES, 1.0, cfg.micro_batch_size_per_gpu,
                                             max_tokens)["scores"]
            return Batch(tensors={"rm_scores": scores, "rm_truncated": cut})
        rows, cut, steps = self.inputs.with_steps(batch, cfg.process.step_separator)
        token_scores = self.reward_model.infer(rows, Output.TOKEN_SCORES, 1.0, cfg.micro_batch_size_per_gpu,
                                               max_tokens)["token_scores"]
        step_scores, step_mask = place_step_scores(token_scores, steps, batch["responses"].shape)
        return Batch(tensors={"rm_scores": step_scores.sum(-1), "rm_step_scores": step_scores,
                              "rm_step_mask": step_mask, "rm_truncated": cut})


def place_step_scores(token_scores: torch.Tensor, steps: list, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step's score, read from the reward model's `token_scores` at its step-end token, on
    the policy's step-end token (`steps` as `RewardInputs.with_steps` gives them), and the mask
    of those tokens; both `shape` (B, T)."""
    step_scores = torch.zeros(shape, dtype=torch.float32)
    step_mask = torch.zeros(shape, dtype=torch.bool)
    for i, row_steps in enumerate(steps):
        for policy_token, reward_token in row_steps:
            step_scores[i, policy_token] += token_scores[i, reward_token]
            step_mask[i, policy_token] = True
    return step_scores, step_mask
