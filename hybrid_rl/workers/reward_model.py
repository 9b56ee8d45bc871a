"""The reward model: a sequence classifier (`AutoModelForSequenceClassification`, one label) that
scores each response, or with `reward_model.process.enable` a process reward model (a token
classifier) that scores each reasoning step, on a training engine (`reward_model.strategy`)
colocated in the actor's worker processes, or with `reward_model.enable_resource_pool` in
processes of its own; iterative RL trains it further. What it reads is built by
`hybrid_rl.rewards.model_inputs`.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from hybrid_rl.controller import Dispatch, register
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from hybrid_rl.models import load_tokenizer
from hybrid_rl.protocol import Batch
from hybrid_rl.rewards.model_inputs import RewardInputs
from hybrid_rl.rewards.training import place_step_labels, reward_model_loss_fn, step_loss_fn, step_probabilities
from hybrid_rl.workers.base import ModelWorker


class RewardModelWorker(ModelWorker):
    role = "reward_model"

    def __init__(self, config: dict, model_path: str, total_steps: int, policy_path: str):
        super().__init__(config, model_path, total_steps)
        self.policy_path = policy_path

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        from transformers import AutoTokenizer

        self.device = self.setup_device()
        rm_cfg = self.cfg.reward_model
        step_tag = rm_cfg.process.step_tag if rm_cfg.process.enable else None
        head = Head.STEP_TAG if step_tag is not None else Head.STEP_SCORE if rm_cfg.process.enable else Head.SCORE
        iterative = self.cfg.trainer.iterative
        optim = training_optim(iterative.reward_model) if iterative.enable else None
        reward_tokenizer = AutoTokenizer.from_pretrained(self.model_path,
                                                         trust_remote_code=rm_cfg.model.trust_remote_code)
        tag_token_ids = tag_token_ids_of(reward_tokenizer, rm_cfg.process.step_tag_tokens) if step_tag else None
        spec = ModelSpec("reward_model", self.model_path, rm_cfg.model, head=head, optim_cfg=optim,
                         tag_token_ids=tag_token_ids)
        role_cfg = OmegaConf.create({"strategy": rm_cfg.strategy, "fsdp_config": rm_cfg.model.fsdp_config,
                                     "ulysses_sequence_parallel_size": rm_cfg.ulysses_sequence_parallel_size,
                                     "load_weight": rm_cfg.get("load_weight", True),
                                     **({"megatron": rm_cfg.megatron} if "megatron" in rm_cfg else {}),
                                     **({"grad_clip": iterative.reward_model.grad_clip} if iterative.enable else {})})
        self.reward_model = build_engine(spec, role_cfg, self.device)
        self.inputs = RewardInputs(load_tokenizer(self.cfg, self.policy_path), reward_tokenizer, rm_cfg.max_length,
                                   step_tag)
        return {"rank": self.rank, "params": self.reward_model.num_params(), "retemplate": self.inputs.retemplate,
                "dp_size": self.reward_model.dp_size}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        self.reward_model.save_checkpoint(folder)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        self.reward_model.load_checkpoint(folder)

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="reward_model")
    def train_reward_model(self, batch: Batch) -> dict:
        """Iterative RL: `trainer.iterative.reward_model.epochs` passes of pointwise training over
        this rank's share of `batch` (rollout rows with `labels` in [0, 1], or for a process reward
        model `step_labels`, one per step), and the loss on its `replayed` rows (their steps) before
        and after, as sums and a count of rows and of examples (the driver averages over ranks)."""
        cfg = self.cfg.trainer.iterative.reward_model
        process = self.cfg.reward_model.process
        replayed = batch["replayed"].bool()
        if process.enable:
            rows, _, steps = self.inputs.with_steps(batch, process.step_separator)
            rows["step_labels"], rows["response_mask"] = place_step_labels(steps, batch["step_labels"],
                                                                           rows["responses"].shape)
            output, loss_fn = Output.TOKEN_SCORES, step_loss_fn(step_probabilities(self.reward_model))
        else:
            rows, _ = self.inputs(batch)
            rows["labels"] = batch["labels"].float()
            rows["response_mask"] = rows["attention_mask"][:, -rows["responses"].shape[1]:]
            output, loss_fn = Output.SCORES, reward_model_loss_fn(pairwise=False)
        examples = rows["response_mask"].sum(-1) if process.enable else torch.ones(len(rows))

        def replay_loss() -> float:
            if not replayed.any():
                return 0.0
            replay = rows[replayed]
            out = self.reward_model.infer(replay, output, 1.0, cfg.micro_batch_size_per_gpu, None)
            # the loss callback's mean over the replayed examples, times their count
            count = float(examples[replayed].sum())
            return float(loss_fn(out, replay, {"dp_size": 1, "global_num_tokens": count, "global_num_seqs": count})[0]
                         ) * count

        before = replay_loss()
        metrics = train_further(self.reward_model, rows, cfg, self.cfg.trainer.seed + batch.meta.step, output, loss_fn)
        return {**metrics, "replay_loss_sum_before": before, "replay_loss_sum_after": replay_loss(),
                "replayed_rows": float(replayed.sum()), "replayed_examples": float(examples[replayed].sum())}

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


def training_optim(cfg) -> DictConfig:
    """The optimizer of a reward model that iterative RL trains further
    (`trainer.iterative.reward_model`): AdamW at a constant learning rate."""
    return OmegaConf.create({"lr": cfg.lr, "betas": [0.9, 0.999], "weight_decay": cfg.weight_decay,
                             "lr_warmup_steps": 0, "lr_warmup_steps_ratio": 0.0, "lr_scheduler_type": "constant",
                             "min_lr_ratio": 0.0, "num_cycles": 0.5})


def train_further(engine, rows: Batch, cfg, seed: int, output: Output = Output.SCORES, loss_fn=None) -> dict:
    """`cfg.epochs` shuffled passes (`trainer.iterative.reward_model`) of `loss_fn` (default:
    the pointwise loss of `labels` in [0, 1]) over `rows` with a `response_mask`, on any training
    engine."""
    role_cfg = OmegaConf.create({"ppo_epochs": cfg.epochs, "shuffle": True, "ppo_mini_batch_size": cfg.mini_batch_size,
                                 "ppo_micro_batch_size_per_gpu": cfg.micro_batch_size_per_gpu,
                                 "use_dynamic_bsz": False, "grad_clip": cfg.grad_clip})
    return engine.update(rows, role_cfg, rollout_n=1, seed=seed, output=output, temperature=1.0,
                         loss_fn=loss_fn or reward_model_loss_fn(pairwise=False))


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


def tag_token_ids_of(tokenizer, tokens) -> tuple[int, int]:
    """The ids of a step-tag scorer's (good, bad) tokens, each of which must be one token."""
    ids = [tokenizer.encode(token, add_special_tokens=False) for token in tokens]
    if any(len(token_ids) != 1 for token_ids in ids):
        raise ValueError(f"reward_model.process.step_tag_tokens={list(tokens)!r} encode as {ids} with the reward "
                         "model's tokenizer; each must be a single token (the scorer's next-token logits are read "
                         "for them). Give the tokens it was trained to predict after the step tag.")
    return ids[0][0], ids[1][0]
