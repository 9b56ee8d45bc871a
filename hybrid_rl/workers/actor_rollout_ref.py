"""The colocated worker: actor (FSDP2, trained), reference policy (FSDP2, frozen) and a rollout
engine (in-process vLLM, or transformers generate) in one process per rank.

The driver calls the `@register`-ed methods; `DP_COMPUTE` methods receive this rank's share of
the batch, `ONE_TO_ALL` methods run on every rank with the same arguments.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh

from hybrid_rl.algorithms import aggregate_loss, get_policy_loss, kl_penalty
from hybrid_rl.controller import Dispatch, Worker, register
from hybrid_rl.protocol import Batch
from hybrid_rl.workers import train_engine
from hybrid_rl.workers.rollout import HFRollout, VLLMRollout, assemble_rollout, sampling_settings
from hybrid_rl.workers.weight_sync import sync_weights

FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def needs_reference(cfg: Any) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


class ActorRolloutRefWorker(Worker):
    def __init__(self, config: dict, model_path: str, total_steps: int):
        super().__init__()
        self.cfg = OmegaConf.create(config)
        self.model_path = model_path
        self.total_steps = total_steps

    # ------------------------------------------------------------------ set-up
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.cfg
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        use_cuda = cfg.trainer.device == "cuda"
        if use_cuda:
            # Ray gives each actor one visible GPU; vLLM picks its device from LOCAL_RANK.
            torch.cuda.set_device(0)
            os.environ["LOCAL_RANK"] = "0"
        self.device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        self.init_process_group(timeout_s=cfg.actor_rollout_ref.nccl_timeout)
        torch.manual_seed(cfg.trainer.seed + self.rank)
        mesh = init_device_mesh(self.device.type, (self.world_size,))

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.tokenizer_path or self.model_path)
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.eos_token_ids = eos_ids(self.model_path, tok)

        param_dtype = train_engine.DTYPES[cfg.actor_rollout_ref.actor.fsdp_config.dtype] if use_cuda else None
        model_cfg = cfg.actor_rollout_ref.model
        actor = train_engine.load_causal_lm(self.model_path, model_cfg, self.device, trainable=True)
        self.actor = train_engine.shard_model(
            actor, mesh, param_dtype, cfg.actor_rollout_ref.actor.fsdp_config.reshard_after_forward)
        self.optimizer, self.scheduler = train_engine.build_optimizer(
            self.actor, cfg.actor_rollout_ref.actor.optim, self.total_steps)
        self.ref = None
        if needs_reference(cfg):
            ref = train_engine.load_causal_lm(self.model_path, model_cfg, self.device, trainable=False)
            self.ref = train_engine.shard_model(ref, mesh, param_dtype)

        rollout_cfg = cfg.actor_rollout_ref.rollout
        if rollout_cfg.name == "vllm":
            max_len = rollout_cfg.prompt_length + rollout_cfg.response_length
            self.rollout = VLLMRollout(self.model_path, rollout_cfg, self.device, max_len, self.eos_token_ids)
        else:
            self.rollout = HFRollout(self.actor, self.pad_token_id, self.eos_token_ids)
        self.skipped_steps = 0
        return {"rank": self.rank, "params": sum(p.numel() for p in self.actor.parameters())}

    # ------------------------------------------------------------------ rollout
    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: Batch) -> Batch:
        rollout_cfg = self.cfg.actor_rollout_ref.rollout
        settings = sampling_settings(rollout_cfg, validate=prompts.meta.get("validate", False))
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

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def _log_probs(self, model, batch: Batch) -> torch.Tensor:
        micro = self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        temperature = batch.meta.get("temperature", 1.0)
        log_probs = []
        for part in batch.split(micro):
            tensors = {k: part[k].to(self.device) for k in FORWARD_KEYS}
            log_probs.append(train_engine.response_log_probs(model, tensors, temperature, False)[0].cpu())
        return torch.cat(log_probs)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return Batch(tensors={"old_log_probs": self._log_probs(self.actor, batch)})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.ref is None:
            raise RuntimeError("No reference policy: set actor_rollout_ref.actor.use_kl_loss=true "
                               "or algorithm.use_kl_in_reward=true to create one.")
        return Batch(tensors={"ref_log_prob": self._log_probs(self.ref, batch)})

    # ------------------------------------------------------------------ training
    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict:
        """PPO-style update over mini-batches and epochs. Losses are normalised by the token and
        sequence counts of the whole mini-batch across micro-batches and ranks, so gradient
        accumulation and data parallelism give exactly the single-batch loss."""
        cfg = self.cfg.actor_rollout_ref.actor
        n = self.cfg.actor_rollout_ref.rollout.n
        mini_rows = cfg.ppo_mini_batch_size * n // self.world_size
        temperature = batch.meta.get("temperature", 1.0)
        policy_loss = get_policy_loss(cfg.policy_loss.loss_mode)
        # One mini-batch and one epoch: the data were sampled by these exact weights, so the
        # ratio is 1 and the old log-probs are the current ones, detached.
        on_policy = "old_log_probs" not in batch
        keys = list(FORWARD_KEYS) + ["response_mask", "advantages"]
        keys += [k for k in ("old_log_probs", "ref_log_prob") if k in batch]
        batch = batch.select(keys, non_tensor_keys=[])
        metrics: dict[str, list[float]] = defaultdict(list)
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed + int(batch.meta.get("step", 0)))
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator) if cfg.shuffle else None
            epoch_batch = batch[order] if order is not None else batch
            for mini in epoch_batch.split(mini_rows):
                self._update_mini_batch(mini, cfg, policy_loss, temperature, on_policy, metrics)
        self.scheduler.step()
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        out["actor/skipped_steps"] = float(self.skipped_steps)
        return out

    def _update_mini_batch(self, mini: Batch, cfg, policy_loss, temperature, on_policy, metrics):
        mask = mini["response_mask"]
        agg_kwargs = {
            "global_num_tokens": train_engine.all_reduce_sum(float(mask.sum()), self.device),
            "global_num_seqs": train_engine.all_reduce_sum(float((mask.sum(-1) > 0).sum()), self.device),
            "dp_size": self.world_size,
            "loss_scale_factor": cfg.loss_scale_factor,
        }
        mode = cfg.loss_agg_mode
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = defaultdict(float)
        micro_metrics: dict[str, list[float]] = defaultdict(list)
        for micro in mini.split(cfg.ppo_micro_batch_size_per_gpu):
            t = {k: micro[k].to(self.device) for k in micro.keys()}
            log_prob, entropy = train_engine.response_log_probs(
                self.actor, t, temperature, with_entropy=True, entropy_grad=cfg.entropy_coeff != 0)
            old = log_prob.detach() if on_policy else t["old_log_probs"]
            pg_loss, pg_metrics = policy_loss(old, log_prob, t["advantages"], t["response_mask"],
                                              loss_agg_mode=mode, config=cfg, agg_kwargs=agg_kwargs)
            entropy_agg = aggregate_loss(entropy, t["response_mask"], mode, **agg_kwargs)
            loss = pg_loss - cfg.entropy_coeff * entropy_agg
            if cfg.use_kl_loss:
                kld = kl_penalty(log_prob, t["ref_log_prob"], cfg.kl_loss_type)
                kl_loss = aggregate_loss(kld, t["response_mask"], mode, **agg_kwargs)
                loss = loss + cfg.kl_loss_coef * kl_loss
                totals["actor/kl_loss"] += float(kl_loss.detach())
            loss.backward()
            totals["actor/pg_loss"] += float(pg_loss.detach())
            totals["actor/entropy"] += float(entropy_agg.detach())
            for k, v in pg_metrics.items():
                micro_metrics[f"actor/{k}"].append(float(v))
        grad_norm = train_engine.clip_grad_norm(self.actor, cfg.grad_clip)
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        # Each rank's sum is its share of the global loss times dp_size: the driver's mean over
        # ranks is the exact mini-batch loss.
        for k, v in totals.items():
            metrics[k].append(v)
        for k, v in micro_metrics.items():
            metrics[k].append(sum(v) / len(v))
        metrics["actor/grad_norm"].append(grad_norm)


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
