"""The critic (value model) for PPO: the policy's architecture with a scalar head, sharded with
FSDP2 and colocated in the actor's worker process."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_rl.algorithms import compute_value_loss
from hybrid_rl.controller import Dispatch, register
from hybrid_rl.protocol import Batch
from hybrid_rl.workers import train_engine

FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def load_value_model(path: str, model_cfg: Any, device: torch.device):
    """`AutoModelForTokenClassification` with one label: the backbone's weights plus a freshly
    initialised linear value head on every position."""
    from transformers import AutoModelForTokenClassification

    config = train_engine.model_config(path, model_cfg, value_head=True)
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation="sdpa",
        trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.to(device).train()


def response_values(model, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(s_t) for each response token t: the value read at the position that precedes it."""
    resp_len = micro["responses"].shape[1]
    out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                position_ids=micro["position_ids"], use_cache=False)
    return out.logits[:, -resp_len - 1:-1, 0].float()


class CriticWorker(train_engine.ModelWorker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.cfg
        self.device, mesh = train_engine.setup_device_and_mesh(self, cfg)
        critic_cfg = cfg.critic
        param_dtype = train_engine.param_dtype(critic_cfg.fsdp_config, self.device)
        model = load_value_model(self.model_path, critic_cfg.model, self.device)
        self.critic = train_engine.shard_model(model, mesh, param_dtype, critic_cfg.fsdp_config.reshard_after_forward)
        self.optimizer, self.scheduler = train_engine.build_optimizer(self.critic, critic_cfg.optim, self.total_steps)
        self.skipped_steps = 0
        return {"rank": self.rank, "params": sum(p.numel() for p in self.critic.parameters())}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        train_engine.save_sharded(self.critic, self.optimizer, self.scheduler, folder, self.rank,
                                  {"skipped_steps": self.skipped_steps})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        extra = train_engine.load_sharded(self.critic, self.optimizer, self.scheduler, folder, self.rank)
        self.skipped_steps = int(extra.get("skipped_steps", 0))

    @register(dispatch=Dispatch.DP_COMPUTE)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        cfg = self.cfg.critic
        values = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        max_tokens = cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        for rows in train_engine.micro_batches(batch, cfg.forward_micro_batch_size_per_gpu, max_tokens,
                                               False, self.device):
            part = batch[rows]
            tensors = {k: part[k].to(self.device) for k in FORWARD_KEYS}
            values[rows] = (response_values(self.critic, tensors) * part["response_mask"].to(self.device)).cpu()
        return Batch(tensors={"values": values})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch) -> dict:
        cfg = self.cfg.critic
        n = self.cfg.actor_rollout_ref.rollout.n
        batch = batch.select(list(FORWARD_KEYS) + ["response_mask", "values", "returns"], non_tensor_keys=[])

        def loss_fn(t: dict, agg_kwargs: dict):
            vpreds = response_values(self.critic, t)
            loss, metrics = compute_value_loss(vpreds, t["returns"], t["values"], t["response_mask"],
                                               cfg.cliprange_value, cfg.loss_agg_mode, agg_kwargs)
            share = train_engine.token_share(t["response_mask"], agg_kwargs)
            return loss, {"critic/vf_loss": float(loss.detach()),
                          **{f"critic/{k}": float(v) * share for k, v in metrics.items()}}

        metrics, skipped = train_engine.mini_batch_updates(
            self.critic, self.optimizer, batch, mini_rows=cfg.ppo_mini_batch_size * n // self.world_size,
            micro_rows=cfg.ppo_micro_batch_size_per_gpu,
            max_tokens=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
            share_prompts=False, epochs=cfg.ppo_epochs, shuffle=cfg.shuffle,
            seed=self.cfg.trainer.seed + int(batch.meta.get("step", 0)), grad_clip=cfg.grad_clip,
            device=self.device, loss_fn=loss_fn)
        self.scheduler.step()
        self.skipped_steps += skipped
        out = train_engine.summarise_updates(metrics, "critic")
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        out["critic/skipped_steps"] = float(self.skipped_steps)
        return out
