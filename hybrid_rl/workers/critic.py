"""The critic (value model) for PPO: the policy's architecture with a scalar head, a training
engine (`critic.strategy`) colocated in the actor's worker process."""

from __future__ import annotations

from hybrid_rl.algorithms import compute_value_loss
from hybrid_rl.controller import Dispatch, register
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from hybrid_rl.engines.base import CHECKPOINT_PARTS, FORWARD_KEYS, token_share
from hybrid_rl.models import model_config
from hybrid_rl.protocol import Batch
from hybrid_rl.workers.base import ModelWorker


class CriticWorker(ModelWorker):
    role = "critic"

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        self.device = self.setup_device()
        critic_cfg = self.cfg.critic
        spec = ModelSpec("critic", self.model_path, critic_cfg.model, head=Head.VALUE, optim_cfg=critic_cfg.optim,
                         total_steps=self.total_steps)
        self.critic = build_engine(spec, critic_cfg, self.device)
        return {"rank": self.rank, "params": self.critic.num_params()}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        self.critic.save_checkpoint(folder, background=self.cfg.critic.checkpoint.async_save)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self) -> None:
        self.critic.finish_checkpoint()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, folder: str) -> None:
        """The critic as a Hugging Face value model: its weights and config (rank 0 writes)."""
        self.critic.save_hf_model(folder, model_config(self.model_path, self.cfg.critic.model, scalar_head=True))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str, parts=CHECKPOINT_PARTS) -> None:
        self.critic.load_checkpoint(folder, parts)

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="critic")
    def compute_values(self, batch: Batch) -> Batch:
        cfg = self.cfg.critic
        max_tokens = cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        values = self.critic.infer(batch, Output.VALUES, 1.0, cfg.forward_micro_batch_size_per_gpu,
                                   max_tokens)["values"]
        return Batch(tensors={"values": values * batch["response_mask"]})

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="critic")
    def update_critic(self, batch: Batch) -> dict:
        cfg = self.cfg.critic
        batch = batch.select(list(FORWARD_KEYS) + ["response_mask", "values", "returns"], non_tensor_keys=[])
        return self.critic.update(batch, cfg, rollout_n=self.cfg.actor_rollout_ref.rollout.n,
                                  seed=self.cfg.trainer.seed + batch.meta.step, output=Output.VALUES,
                                  temperature=1.0, loss_fn=critic_loss(cfg))


def critic_loss(cfg):
    """The critic update's loss callback: the clipped value loss (`cliprange_value`), aggregated by
    `loss_agg_mode` (seq-mean-token-sum-norm over `loss_scale_factor` when set), with its metrics."""
    def loss_fn(out: dict, t: dict, agg_kwargs: dict):
        loss, metrics = compute_value_loss(out["values"], t["returns"], t["values"], t["response_mask"],
                                           cfg.cliprange_value, cfg.loss_agg_mode,
                                           {**agg_kwargs, "loss_scale_factor": cfg.get("loss_scale_factor")})
        share = token_share(t["response_mask"], agg_kwargs)
        return loss, {"critic/vf_loss": float(loss.detach()),
                      **{f"critic/{k}": float(v) * share for k, v in metrics.items()}}

    return loss_fn
