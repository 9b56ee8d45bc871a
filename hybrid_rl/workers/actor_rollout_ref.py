"""The colocated worker: actor (FSDP2, trained), reference policy (FSDP2, frozen) and a rollout
engine (in-process vLLM, or transformers generate) in one process per rank.

The driver calls the `@register`-ed methods; `DP_COMPUTE` methods receive this rank's share of
the batch, `ONE_TO_ALL` methods run on every rank with the same arguments.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybrid_rl.algorithms import (
    aggregate_loss, entropy_from_logits, full_kl_from_logits, get_policy_loss, kl_penalty, mismatch_metrics,
)
from hybrid_rl.controller import Dispatch, register
from hybrid_rl.models import load_tokenizer
from hybrid_rl.protocol import Batch
from hybrid_rl.workers import train_engine
from hybrid_rl.workers.rollout import HFRollout, VLLMRollout, assemble_rollout, greedy_settings, sampling_settings
from hybrid_rl.workers.weight_sync import sync_weights

FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def needs_reference(cfg: Any) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


class ActorRolloutRefWorker(train_engine.ModelWorker):
    # ------------------------------------------------------------------ set-up
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.cfg
        self.device, mesh = train_engine.setup_device_and_mesh(self, cfg)
        torch.manual_seed(cfg.trainer.seed + self.rank)

        tok = load_tokenizer(cfg, self.model_path)
        self.pad_token_id = tok.pad_token_id
        self.eos_token_ids = eos_ids(self.model_path, tok)

        param_dtype = train_engine.param_dtype(cfg.actor_rollout_ref.actor.fsdp_config, self.device)
        model_cfg = cfg.actor_rollout_ref.model
        actor = train_engine.load_causal_lm(self.model_path, model_cfg, self.device, trainable=True)
        self.actor = train_engine.shard_model(
            actor, mesh, param_dtype, cfg.actor_rollout_ref.actor.fsdp_config.reshard_after_forward)
        self.optimizer, self.scheduler = train_engine.build_optimizer(
            self.actor, cfg.actor_rollout_ref.actor.optim, self.total_steps)
        self.forward = train_engine.forward_options(model_cfg, cfg.actor_rollout_ref.actor.fsdp_config, self.device)
        self.ref = None
        if needs_reference(cfg):
            ref = train_engine.load_causal_lm(self.model_path, model_cfg, self.device, trainable=False)
            self.ref = train_engine.shard_model(ref, mesh, param_dtype)

        rollout_cfg = cfg.actor_rollout_ref.rollout
        if rollout_cfg.name == "vllm":
            self.rollout = VLLMRollout(self.model_path, rollout_cfg, self.device, self.eos_token_ids)
            sync_weights(self.actor, self.rollout)  # the engine starts with random weights
        else:
            self.rollout = HFRollout(self.actor, self.pad_token_id, self.eos_token_ids)
        self.skipped_steps = 0
        return {"rank": self.rank, "params": sum(p.numel() for p in self.actor.parameters()),
                "rollout": self.rollout.settings() if rollout_cfg.name == "vllm" else {}}

    # ------------------------------------------------------------------ rollout
    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Sample one response per row (the driver repeats prompts n times). `meta["validate"]`
        selects `rollout.val_kwargs`; `meta["greedy"]` forces greedy decoding (ReMax baseline)."""
        rollout_cfg = self.cfg.actor_rollout_ref.rollout
        if prompts.meta.get("greedy", False):
            settings = greedy_settings()
        else:
            settings = sampling_settings(rollout_cfg, validate=prompts.meta.get("validate", False))
        # Sampling depends only on (seed, step, rank, kind of call), so a resumed run samples
        # exactly what an uninterrupted one would.
        kind = 1 if prompts.meta.get("validate", False) else 2 if prompts.meta.get("greedy", False) else 0
        torch.manual_seed(hash((self.cfg.trainer.seed, int(prompts.meta.get("step", 0)), self.rank, kind)) % 2**62)
        tokens, log_probs = self.rollout.generate(prompts, settings, rollout_cfg.response_length)
        return assemble_rollout(prompts, tokens, log_probs, rollout_cfg.response_length,
                                self.pad_token_id, self.eos_token_ids)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> dict:
        """Reshard the actor's current weights into the rollout engine (no-op for hf rollout,
        which generates with the actor's own module)."""
        if not isinstance(self.rollout, VLLMRollout):
            return {"bytes": 0, "seconds": 0.0}
        start = time.perf_counter()
        sent = sync_weights(self.actor, self.rollout)
        return {"bytes": sent, "seconds": time.perf_counter() - start}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str) -> None:
        train_engine.save_sharded(self.actor, self.optimizer, self.scheduler, folder, self.rank,
                                  {"skipped_steps": self.skipped_steps})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, folder: str) -> None:
        """The actor's weights and config as a Hugging Face folder (rank 0 writes)."""
        config = train_engine.model_config(self.model_path, self.cfg.actor_rollout_ref.model)
        train_engine.save_hf_model(self.actor, config, folder, self.rank)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str) -> None:
        extra = train_engine.load_sharded(self.actor, self.optimizer, self.scheduler, folder, self.rank)
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.sync_rollout_weights()  # the engine must sample from the restored weights

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def _log_probs(self, model, batch: Batch, role_cfg) -> torch.Tensor:
        """Response log-probs of `batch` under `model`, in micro-batches of
        `log_prob_micro_batch_size_per_gpu` rows or `log_prob_max_token_len_per_gpu` tokens."""
        temperature = batch.meta.get("temperature", 1.0)
        max_tokens = role_cfg.log_prob_max_token_len_per_gpu if role_cfg.log_prob_use_dynamic_bsz else None
        log_probs = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        for rows in train_engine.micro_batches(batch, role_cfg.log_prob_micro_batch_size_per_gpu, max_tokens,
                                               self.forward.share_prompts, self.device):
            part = batch[rows]
            tensors = {k: part[k].to(self.device) for k in FORWARD_KEYS}
            log_probs[rows] = train_engine.response_log_probs(
                model, tensors, temperature, self.forward, with_entropy=False)[0].cpu()
        return log_probs

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        role_cfg = self.cfg.actor_rollout_ref.rollout
        return Batch(tensors={"old_log_probs": self._log_probs(self.actor, batch, role_cfg)})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.ref is None:
            raise RuntimeError("No reference policy: set actor_rollout_ref.actor.use_kl_loss=true "
                               "or algorithm.use_kl_in_reward=true to create one.")
        return Batch(tensors={"ref_log_prob": self._log_probs(self.ref, batch, self.cfg.actor_rollout_ref.ref)})

    # ------------------------------------------------------------------ training
    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict:
        """PPO-style update over epochs and mini-batches; every loss term is normalised by the
        whole mini-batch's token/sequence counts across micro-batches and ranks."""
        cfg = self.cfg.actor_rollout_ref.actor
        n = self.cfg.actor_rollout_ref.rollout.n
        temperature = batch.meta.get("temperature", 1.0)
        policy_loss = get_policy_loss(cfg.policy_loss.loss_mode)
        # One mini-batch and one epoch: the data were sampled by these exact weights, so the
        # ratio is 1 and the old log-probs are the current ones, detached.
        on_policy = "old_log_probs" not in batch
        keys = list(FORWARD_KEYS) + ["response_mask", "advantages"]
        keys += [k for k in ("old_log_probs", "ref_log_prob", "rollout_log_probs", "rollout_is_weights")
                 if k in batch]
        batch = batch.select(keys, non_tensor_keys=[])

        def loss_fn(t: dict, agg_kwargs: dict):
            return self._actor_loss(t, {**agg_kwargs, "loss_scale_factor": cfg.loss_scale_factor},
                                    cfg, policy_loss, temperature, on_policy)

        metrics, skipped = train_engine.mini_batch_updates(
            self.actor, self.optimizer, batch, mini_rows=cfg.ppo_mini_batch_size * n // self.world_size,
            micro_rows=cfg.ppo_micro_batch_size_per_gpu,
            max_tokens=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
            share_prompts=self.forward.share_prompts, epochs=cfg.ppo_epochs, shuffle=cfg.shuffle,
            seed=self.cfg.trainer.seed + int(batch.meta.get("step", 0)), grad_clip=cfg.grad_clip,
            device=self.device, loss_fn=loss_fn)
        self.scheduler.step()
        self.skipped_steps += skipped
        out = train_engine.summarise_updates(metrics, "actor")
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        out["perf/max_memory_gb"] = train_engine.peak_memory_gb(self.device)
        out["actor/skipped_steps"] = float(self.skipped_steps)
        return out

    def _actor_loss(self, t: dict, agg_kwargs: dict, cfg, policy_loss, temperature: float, on_policy: bool):
        mask = t["response_mask"]
        mode = cfg.loss_agg_mode
        full_kl = cfg.use_kl_loss and cfg.kl_loss_type == "full"
        if full_kl:  # the only loss that needs whole next-token distributions
            logits = train_engine.response_logits(self.actor, t, temperature, self.forward)
            log_prob, entropy = train_engine.token_log_probs(logits, t["responses"]), entropy_from_logits(logits)
        else:
            log_prob, entropy = train_engine.response_log_probs(self.actor, t, temperature, self.forward)
        if cfg.entropy_coeff == 0:
            entropy = entropy.detach()  # a metric only: no backward through it
        old = log_prob.detach() if on_policy else t["old_log_probs"]
        pg_loss, pg_metrics = policy_loss(old, log_prob, t["advantages"], mask, loss_agg_mode=mode, config=cfg,
                                          agg_kwargs=agg_kwargs, rollout_is_weights=t.get("rollout_is_weights"))
        entropy_agg = aggregate_loss(entropy, mask, mode, **agg_kwargs)
        loss = pg_loss - cfg.entropy_coeff * entropy_agg
        share = train_engine.token_share(mask, agg_kwargs)
        terms = {"actor/pg_loss": float(pg_loss.detach()), "actor/entropy": float(entropy_agg.detach()),
                 **{f"actor/{k}": float(v) * share for k, v in pg_metrics.items()}}
        if cfg.use_kl_loss:
            if full_kl:
                with torch.no_grad():
                    ref_logits = train_engine.response_logits(self.ref, t, temperature, self.forward)
                kld = full_kl_from_logits(logits, ref_logits, chunk_size=cfg.full_kl_chunk_size)
            else:
                kld = kl_penalty(log_prob, t["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = aggregate_loss(kld, mask, mode, **agg_kwargs)
            loss = loss + cfg.kl_loss_coef * kl_loss
            terms["actor/kl_loss"] = float(kl_loss.detach())
        if on_policy and "rollout_log_probs" in t:
            # This forward is the first time the trainer's log-probs of the sampled tokens exist.
            for key, value in mismatch_metrics(log_prob.detach(), t["rollout_log_probs"], mask).items():
                terms[key] = value if key.endswith("_max") else value * share
        return loss, terms


def eos_ids(model_path: str, tokenizer) -> list[int]:
    """EOS ids from the generation config (chat models often stop on several) and the tokenizer."""
    from transformers import GenerationConfig

    ids = set()
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
