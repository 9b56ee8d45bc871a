"""The colocated worker: actor (trained), reference policy and distillation teachers (frozen),
each a training engine (`hybrid_rl.engines`, chosen by its `strategy`), and a rollout engine
(in-process vLLM, or transformers generate) in one process per rank.

The driver calls the `@register`-ed methods; `DP_COMPUTE` methods receive this rank's share of
the batch, `ONE_TO_ALL` methods run on every rank with the same arguments.
"""

from __future__ import annotations

import contextlib
import time

import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms import (
    aggregate_loss, compute_rollout_correction, correction_settings, entropy_from_logits, full_kl_from_logits,
    get_policy_loss, kl_penalty, mismatch_metrics, token_log_probs,
)
from hybrid_rl.algorithms.distillation import TOP_K_MODE, forward_kl_top_k, sampled_token_losses
from hybrid_rl.config import needs_reference
from hybrid_rl.controller import Dispatch, register
from hybrid_rl.controller.worker import get_free_port, get_node_ip
from hybrid_rl.engines import ModelSpec, Output, build_engine, lora
from hybrid_rl.engines.base import CHECKPOINT_PARTS, FORWARD_KEYS, ROUTES_KEY, token_share
from hybrid_rl.engines.routing import replay_mode
from hybrid_rl.hardware import peak_memory_gb
from hybrid_rl.models import load_tokenizer, model_config
from hybrid_rl.profiler import FirstUpdateProfiler, update_window
from hybrid_rl.protocol import Batch
from hybrid_rl.rollout_trace import rollout_tracer
from hybrid_rl.workers.base import ModelWorker
from hybrid_rl.workers.rollout import HFRollout, VLLMRollout, generate_batch, tool_loop, verl_agent_loops
from hybrid_rl.workers.weight_sync import WeightChannel, sync_weights


class ActorRolloutRefWorker(ModelWorker):
    role = "actor_rollout_ref"

    def __init__(self, config: dict, model_path: str, total_steps: int, ref_path: str | None = None,
                 teacher_paths: list[str] | None = None):
        super().__init__(config, model_path, total_steps)
        self.ref_path = ref_path  # a reference model of its own (ref.model.path); None: the actor's start
        self.teacher_paths = teacher_paths or []  # distillation: the teachers' model folders, in routing order

    # ------------------------------------------------------------------ set-up
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.cfg
        self.device = self.setup_device()
        torch.manual_seed(cfg.trainer.seed + self.rank)

        tok = load_tokenizer(cfg, self.model_path)
        self.pad_token_id = tok.pad_token_id
        self.eos_token_ids = eos_ids(self.model_path, tok)

        model_cfg = cfg.actor_rollout_ref.model
        actor_cfg = cfg.actor_rollout_ref.actor
        self.actor = build_engine(ModelSpec("actor", self.model_path, model_cfg, optim_cfg=actor_cfg.optim,
                                            total_steps=self.total_steps), actor_cfg, self.device)
        self.update_profiler = FirstUpdateProfiler(update_window(cfg, self.rank), self.rank)
        self.ref = None
        if needs_reference(cfg):
            # Under LoRA the base model, the actor's adapter switched off: no second copy.
            self.ref = lora.AdapterDisabled(self.actor) if self.actor.has_adapter and self.ref_path is None else (
                build_engine(ModelSpec("ref", self.ref_path or self.model_path, model_cfg), cfg.actor_rollout_ref.ref,
                             self.device))
        # Distillation teachers run on the FSDP engine with the reference's settings, whatever its strategy.
        distillation = cfg.distillation.distillation_loss
        top_k = distillation.topk if distillation.loss_mode == TOP_K_MODE else 0
        teacher_cfg = OmegaConf.merge(cfg.actor_rollout_ref.ref, {"strategy": "fsdp2"})
        self.teachers = [build_engine(ModelSpec("teacher", path, model_cfg, top_k=top_k), teacher_cfg, self.device)
                         for path in self.teacher_paths]

        rollout_cfg = cfg.actor_rollout_ref.rollout
        self.channel = None  # to a rollout pool of its own (hybrid_engine=false), from rank 0
        if not cfg.actor_rollout_ref.hybrid_engine:
            self.rollout = self.multi_turn = self.agent_loops = self.tracer = None  # the rollout pool generates
            return {"rank": self.rank, "params": self.actor.num_params(), "rollout": {}}
        if rollout_cfg.name == "vllm":
            self.rollout = VLLMRollout(self.model_path, rollout_cfg, self.device, self.eos_token_ids,
                                       cfg.actor_rollout_ref.model)
            sync_weights(self.actor, self.rollout)  # the engine starts with random weights
        else:
            self.rollout = HFRollout(self.actor.hf_module(), self.pad_token_id, self.eos_token_ids,
                                     raw_log_probs=rollout_cfg.logprobs_mode == "raw_logprobs")
        self.multi_turn = tool_loop(cfg, tok, self.eos_token_ids)
        self.agent_loops = verl_agent_loops(cfg, tok)
        self.tracer = rollout_tracer(cfg, tok, self.rollout)
        return {"rank": self.rank, "params": self.actor.num_params(),
                "rollout": self.rollout.settings() if rollout_cfg.name == "vllm" else {}}

    # ------------------------------------------------------------------ rollout
    @register(dispatch=Dispatch.DP_COMPUTE, mesh="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Sample one response per row (the driver repeats prompts n times), as
        `prompts.meta.sampling` says: the rollout's settings, `rollout.val_kwargs`, or greedy. The
        ranks of one rollout tensor-parallel group get the same rows."""
        # The hf rollout generates with the actor's own weights (offloaded or not).
        weights_here = self.actor.resident() if isinstance(self.rollout, HFRollout) else contextlib.nullcontext()
        with weights_here:
            return generate_batch(self.rollout, self.multi_turn, self.cfg, prompts, self.pad_token_id,
                                  self.eos_token_ids, self.tracer, self.agent_loops)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> dict:
        """Reshard the actor's current weights into the rollout engine (no-op for hf rollout,
        which generates with the actor's own module)."""
        if not isinstance(self.rollout, VLLMRollout):  # hf: the actor's module itself; or a pool of its own
            return {"bytes": 0, "seconds": 0.0}
        start = time.perf_counter()
        # The engine holds the weights of the first sync: from then on only trained ones change.
        sent = sync_weights(self.actor, self.rollout, only_trained=True)
        return {"bytes": sent, "seconds": time.perf_counter() - start}

    @register(dispatch=Dispatch.RANK_ZERO)
    def weight_channel_address(self) -> tuple[str, int]:
        """Where the rollout pool meets rank 0 to receive weights: this node and a free port."""
        return get_node_ip(), get_free_port()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def join_weight_channel(self, host: str, port: int, world_size: int) -> None:
        if self.rank == 0:
            self.channel = WeightChannel(host, port, 0, world_size, self.device,
                                         timeout_s=self.cfg.actor_rollout_ref.nccl_timeout)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def send_rollout_weights(self, only_trained: bool = True) -> dict:
        """Push the actor's weights to the rollout pool (every rank gathers, rank 0 sends; the
        pool's `receive_weights` runs at the same time)."""
        start = time.perf_counter()
        weights = self.actor.per_tensor_weights(None, only_trained)
        if self.channel is not None:
            sent = self.channel.send(weights)
        else:
            sent = sum(tensor.numel() * tensor.element_size() for _, tensor in weights)
        return {"bytes": sent, "seconds": time.perf_counter() - start}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, folder: str, ref_folder: str | None = None) -> None:
        """The actor into `folder` (its shards written in the background with
        `actor.checkpoint.async_save`); with `ref_folder` (iterative RL, whose reference moves)
        the reference too."""
        self.actor.save_checkpoint(folder, background=self.cfg.actor_rollout_ref.actor.checkpoint.async_save)
        if ref_folder is not None and self.ref is not None:
            self.ref.save_checkpoint(ref_folder)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self) -> None:
        """Wait until the actor's background checkpoint writes are on disk."""
        self.actor.finish_checkpoint()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, folder: str) -> None:
        """The actor's weights and config as a Hugging Face folder (rank 0 writes)."""
        self.actor.save_hf_model(folder, model_config(self.model_path, self.cfg.actor_rollout_ref.model))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, folder: str, ref_folder: str | None = None, parts=CHECKPOINT_PARTS) -> None:
        self.actor.load_checkpoint(folder, parts)
        if ref_folder is not None and self.ref is not None:
            self.ref.load_checkpoint(ref_folder)
        self.sync_rollout_weights()  # the engine must sample from the restored weights

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def reset_reference(self) -> bool:
        """Make the reference policy the current actor (iterative RL); False when there is none."""
        if self.ref is None:
            return False
        self.ref.load_weights_from(self.actor)
        return True

    # ------------------------------------------------------------------ log-probs
    def _log_probs(self, engine, batch: Batch, role_cfg, output: Output = Output.LOG_PROBS,
                   replay_routes: bool = False) -> dict[str, torch.Tensor]:
        """Response log-probs of `batch` under `engine`'s model (with what else `output` names),
        in micro-batches of `log_prob_micro_batch_size_per_gpu` rows or
        `log_prob_max_token_len_per_gpu` tokens; with `replay_routes`, through the experts of the
        batch's route table (the rollout's)."""
        max_tokens = role_cfg.log_prob_max_token_len_per_gpu if role_cfg.log_prob_use_dynamic_bsz else None
        keys = [*FORWARD_KEYS, *([ROUTES_KEY] if replay_routes else [])]
        return engine.infer(batch.select(keys, non_tensor_keys=[]), output, batch.meta.temperature,
                            role_cfg.log_prob_micro_batch_size_per_gpu, max_tokens)

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="actor")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """`old_log_probs`, and with `actor.calculate_sum_pi_squared` (the optimal token
        baseline's input) `sum_pi_squared`: Σ_v π_v² of each next-token distribution. Under
        router replay R2 also the route table of this pass, which the update replays; under R3
        the pass replays the rollout's."""
        actor = self.cfg.actor_rollout_ref.actor
        mode = replay_mode(actor)
        output = Output.LOG_PROBS_SUM_PI_SQUARED if actor.calculate_sum_pi_squared else Output.LOG_PROBS
        with self.actor.recording_routes() if mode == "R2" else contextlib.nullcontext():
            out = self._log_probs(self.actor, batch, self.cfg.actor_rollout_ref.rollout, output,
                                  replay_routes=mode == "R3")
        return Batch(tensors={"old_log_probs": out.pop("log_probs"), **out})

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="ref")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.ref is None:
            raise RuntimeError("No reference policy: set actor_rollout_ref.actor.use_kl_loss=true "
                               "or algorithm.use_kl_in_reward=true to create one.")
        ref_cfg = self.cfg.actor_rollout_ref.ref
        ref = self._log_probs(self.ref, batch, ref_cfg, replay_routes=replay_mode(ref_cfg) == "R3")
        return Batch(tensors={"ref_log_prob": ref["log_probs"]})

    @property
    def teacher(self):
        """The first distillation teacher, whose data-parallel layout all of them share (the
        reference's settings); the `teacher` mesh of `compute_teacher_log_prob`."""
        return self.teachers[0] if self.teachers else None

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="teacher")
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """The distillation teachers' view of the responses, at temperature 1 (verl's teacher
        log-probs are its engine's raw prompt log-probs): `teacher_log_prob` (B, T) of the sampled
        tokens, or with forward_kl_topk `teacher_top_log_probs` / `teacher_top_ids` (B, T, k).
        With several teachers each row keeps its own one's (`teacher_index`); every teacher
        scores all of this rank's rows, so each runs the same passes on every rank."""
        loss = self.cfg.distillation.distillation_loss
        output = Output.TOP_LOG_PROBS if loss.loss_mode == TOP_K_MODE else Output.LOG_PROBS
        ref_cfg = self.cfg.actor_rollout_ref.ref
        max_tokens = ref_cfg.log_prob_max_token_len_per_gpu if ref_cfg.log_prob_use_dynamic_bsz else None
        rows = batch.select(list(FORWARD_KEYS), non_tensor_keys=[])
        index = batch["teacher_index"]
        out: dict[str, torch.Tensor] = {}
        for i, teacher in enumerate(self.teachers):
            scored = teacher.infer(rows, output, 1.0, ref_cfg.log_prob_micro_batch_size_per_gpu, max_tokens)
            mine = index == i
            for key, value in scored.items():
                out.setdefault(key, torch.zeros_like(value))[mine] = value[mine]
        names = {"log_probs": "teacher_log_prob", "top_log_probs": "teacher_top_log_probs",
                 "top_ids": "teacher_top_ids"}
        return Batch(tensors={names[key]: value for key, value in out.items()})

    # ------------------------------------------------------------------ training
    @register(dispatch=Dispatch.DP_COMPUTE, mesh="actor")
    def update_actor(self, batch: Batch) -> dict:
        """PPO-style update over epochs and mini-batches; every loss term is normalised by the
        whole mini-batch's token/sequence counts across micro-batches and ranks."""
        cfg = self.cfg.actor_rollout_ref.actor
        n = self.cfg.actor_rollout_ref.rollout.n
        temperature = batch.meta.temperature
        correction = self.cfg.algorithm.rollout_correction
        bypass = bool(correction.bypass_mode)
        # Bypass mode's reinforce loss takes the place of the policy loss (config.py refuses another loss_mode).
        policy_loss = get_policy_loss("reinforce" if bypass and correction.loss_type == "reinforce"
                                      else cfg.policy_loss.loss_mode)
        # One mini-batch and one epoch: the data were sampled by these exact weights, so the
        # ratio is 1 and the old log-probs are the current ones, detached.
        on_policy = "old_log_probs" not in batch
        keys = list(FORWARD_KEYS) + ["response_mask", "advantages"]
        keys += [k for k in ("old_log_probs", "ref_log_prob", "rollout_log_probs", "rollout_is_weights",
                             *TEACHER_KEYS) if k in batch]
        if replay_mode(cfg) != "disabled" and ROUTES_KEY in batch:  # R2's recorded routes, or R3's
            keys.append(ROUTES_KEY)
        batch = batch.select(keys, non_tensor_keys=[])
        full_kl = cfg.use_kl_loss and cfg.kl_loss_type == "full"
        distillation = self.cfg.distillation.distillation_loss if self.teachers else None
        # The full KL and the top-k distillation loss need the whole next-token distributions.
        whole = full_kl or (distillation is not None and distillation.loss_mode == TOP_K_MODE)

        # The update's forward is where the trainer's log-probs of the sampled tokens first exist:
        # on policy, and in bypass mode (the engine's are the old ones), it measures the mismatch.
        measure = on_policy or bypass
        # In bypass mode rollout_is / rollout_rs compare the policy being trained with the engine's,
        # micro-batch by micro-batch, as verl's bypass loss does.
        in_loss_correction = correction_settings(correction) if bypass else None

        def loss_fn(out: dict, t: dict, agg_kwargs: dict):
            return self._actor_loss(out, t, {**agg_kwargs, "loss_scale_factor": cfg.loss_scale_factor},
                                    cfg, policy_loss, temperature, on_policy, measure, in_loss_correction,
                                    correction.loss_type == "reinforce", distillation)

        # The full KL is the only loss that needs whole next-token distributions, the reference's
        # among them (its weights on the GPU throughout).
        with (self.ref.resident() if full_kl else contextlib.nullcontext(),
              self.update_profiler.recording() as after_step):
            metrics = self.actor.update(batch, cfg, rollout_n=n, seed=self.cfg.trainer.seed + batch.meta.step,
                                        output=Output.LOGITS if whole else Output.LOG_PROBS_ENTROPY,
                                        temperature=temperature, loss_fn=loss_fn, after_step=after_step)
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)
        return metrics

    def _actor_loss(self, out: dict, t: dict, agg_kwargs: dict, cfg, policy_loss, temperature: float,
                    on_policy: bool, measure_mismatch: bool, in_loss_correction: dict | None = None,
                    weighted_by_correction: bool = False, distillation=None):
        mask = t["response_mask"]
        mode = cfg.loss_agg_mode
        logits = out.get("logits")
        full_kl = cfg.use_kl_loss and cfg.kl_loss_type == "full"
        if logits is not None:
            log_prob, entropy = token_log_probs(logits, t["responses"]), entropy_from_logits(logits)
        else:
            log_prob, entropy = out["log_probs"], out["entropy"]
        if cfg.entropy_coeff == 0:
            entropy = entropy.detach()  # a metric only: no backward through it
        old = log_prob.detach() if on_policy else t["old_log_probs"]
        pg_mask, is_weights, correction_metrics = mask, t.get("rollout_is_weights"), {}
        if in_loss_correction is not None:  # bypass mode: pi_theta against the engine's pi_rollout
            weights, pg_mask, correction_metrics = compute_rollout_correction(
                log_prob.detach(), t["rollout_log_probs"], mask, **in_loss_correction)
            # ppo_clip: its ratio is already pi_theta / pi_rollout, so the weights are metrics only.
            is_weights = weights if weighted_by_correction else None
        pg_loss, pg_metrics = policy_loss(old, log_prob, t["advantages"], pg_mask, loss_agg_mode=mode, config=cfg,
                                          agg_kwargs=agg_kwargs, rollout_is_weights=is_weights)
        entropy_agg = aggregate_loss(entropy, mask, mode, **agg_kwargs)
        loss = pg_loss - cfg.entropy_coeff * entropy_agg
        share = token_share(mask, agg_kwargs)
        terms = {"actor/pg_loss": float(pg_loss.detach()), "actor/entropy": float(entropy_agg.detach()),
                 **{f"actor/{k}": float(v) * share for k, v in pg_metrics.items()}}
        if cfg.use_kl_loss:
            if full_kl:
                ref_logits = self.ref.forward_backward([t], Output.LOGITS, temperature)[0]["logits"]
                kld = full_kl_from_logits(logits, ref_logits, chunk_size=cfg.full_kl_chunk_size)
            else:
                kld = kl_penalty(log_prob, t["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = aggregate_loss(kld, mask, mode, **agg_kwargs)
            loss = loss + cfg.kl_loss_coef * kl_loss
            terms["actor/kl_loss"] = float(kl_loss.detach())
        if measure_mismatch and "rollout_log_probs" in t and not correction_metrics:
            correction_metrics = mismatch_metrics(log_prob.detach(), t["rollout_log_probs"], mask)
        for key, value in correction_metrics.items():  # extremes as they are, means weighted by the tokens
            terms[key] = value if key.endswith(("_max", "_min")) else value * share
        if distillation is not None:
            distill_loss, distill_terms = self._distillation_loss(distillation, logits, log_prob, old, t, agg_kwargs,
                                                                  mode, is_weights)
            terms.update(distill_terms)
            if distillation.use_task_rewards:  # verl: the task's loss + coef x distillation's
                loss = loss + distillation.distillation_loss_coef * distill_loss
            else:  # distillation alone: no policy, entropy or KL term
                loss = distill_loss
        return loss, terms

    @staticmethod
    def _distillation_loss(settings, logits, log_prob, old, t: dict, agg_kwargs: dict, mode: str, is_weights):
        """verl 0.9's distillation term: per-token losses between the student and the teacher
        (algorithms/distillation.py), clamped to ±loss_max_clamp, then back-propagated as a loss
        aggregated like the policy's, or with use_policy_gradient used as each token's advantage
        −loss in a vanilla PPO loss with the distillation's own clip range."""
        mask = t["response_mask"]
        real = mask.bool()
        share = token_share(mask, agg_kwargs)
        # Per-token figures: this micro-batch's means, weighted into the mini-batch's.
        if settings.loss_mode == TOP_K_MODE:
            top_k = forward_kl_top_k(logits, t["teacher_top_log_probs"], t["teacher_top_ids"],
                                     settings.log_prob_min_clamp)
            losses = top_k.losses
            means = {"student_mass": top_k.student_mass, "teacher_mass": top_k.teacher_mass,
                     "overlap_ratio": top_k.overlap_count.float() / settings.topk}
        else:
            losses = sampled_token_losses(log_prob, t["teacher_log_prob"], settings.loss_mode)
            means = {"abs_loss": losses.detach().abs()}
        terms = {}
        if real.any():
            terms = {f"distillation/{name}": float(values[real].mean()) * share for name, values in means.items()}
            terms["distillation/loss_max"] = float(losses.detach()[real].max())
            terms["distillation/loss_min"] = float(losses.detach()[real].min())
        if settings.loss_max_clamp is not None:
            losses = losses.clamp(-settings.loss_max_clamp, settings.loss_max_clamp)
        if settings.use_policy_gradient:
            loss, pg_metrics = get_policy_loss("vanilla")(old, log_prob, -losses.detach(), mask, loss_agg_mode=mode,
                                                          config=settings, agg_kwargs=agg_kwargs,
                                                          rollout_is_weights=is_weights)
            terms.update({f"distillation/{key}": float(value) * share for key, value in pg_metrics.items()})
        else:
            loss = aggregate_loss(losses, mask, mode, **agg_kwargs)
        terms["distillation/loss"] = float(loss.detach())
        return loss, terms


# What the distillation teachers add to the batch (compute_teacher_log_prob).
TEACHER_KEYS = ("teacher_log_prob", "teacher_top_log_probs", "teacher_top_ids")


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
