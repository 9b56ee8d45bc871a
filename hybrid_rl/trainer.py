"""The driver-side training loop. One GRPO step, top to bottom, is `Trainer.train_step`:

    prompts -> generate -> [reward model] -> reward -> [dynamic sampling: more prompts until enough groups differ]
            -> [balance over ranks] -> [old log-probs] -> [reference log-probs]
            -> advantages -> actor update -> weight sync into the rollout engine -> [validation] -> log

With a rollout pool of its own (`actor_rollout_ref.hybrid_engine=false`) "generate" takes the
batch the pool generated while earlier steps trained, and starts the next ones (`next_generated`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import shutil
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig

from hybrid_rl.algorithms import (
    RunningMoments, apply_kl_penalty, compute_rollout_correction, correction_settings, get_advantage_estimator,
    get_kl_controller, groups_with_variance, mismatch_metrics, overlong_penalty, pf_ppo_resample, shape_advantages,
    shape_scores,
)
from hybrid_rl import seqlen_balancing
from hybrid_rl.checkpoint import (CRITIC, CheckpointManager, PendingCheckpoint, build_checkpoint_callback,
                                  capacity_block_ending, mirror_checkpoint, parts_to_load, read_trainer_state,
                                  run_checkpoint_callback)
from hybrid_rl.config import (FILTER_METRICS_OF_BATCH, REF_MODEL_KEY, distillation_teachers, needs_critic,
                              needs_reference, reference_model_path, rollout_cache_settings, to_container)
from hybrid_rl.console import RunSummary, quiet_env
from hybrid_rl.controller import ClassWithInitArgs, RayWorkerGroup, ResourcePool, WorkerError, create_colocated_worker_cls
from hybrid_rl.controller.worker_group import PendingCall
from hybrid_rl.models import resolve_model_path
from hybrid_rl.data import CustomSampler, EpochSampler, RLDataset, collate_prompts, load_custom_sampler
from hybrid_rl.engines import lora
from hybrid_rl.engines.base import ROUTES_KEY
from hybrid_rl.engines.megatron import lora as megatron_lora
from hybrid_rl.engines.routing import replay_mode
from hybrid_rl.iterative import IterationSamples, load_step_scorer
from hybrid_rl.metrics import (Timer, compute_data_metrics, multi_turn_metrics, per_source_means,
                               reduce_worker_metrics, reward_source_metrics, throughput_metrics)
from hybrid_rl.profiler import ROLE_PROFILER_KEYS, StepWindows, role_settings
from hybrid_rl.prometheus import publish_targets
from hybrid_rl.protocol import Batch, BatchMeta, Sampling
from hybrid_rl.rewards import RewardManager
from hybrid_rl.rollout_cache import Lookup, RolloutCache, dump_folder
from hybrid_rl.tracking import Tracker
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybrid_rl.workers.critic import CriticWorker
from hybrid_rl.workers.reward_model import RewardModelWorker
from hybrid_rl.workers.reward_server import RewardServer
from hybrid_rl.workers.rollout import engine_env, training_temperature
from hybrid_rl.workers.rollout_worker import RolloutWorker

logger = logging.getLogger(__name__)


def worker_env(cfg: DictConfig, cpus_per_worker: float) -> dict[str, str]:
    """Environment of each worker process. Ray would otherwise pin torch to one thread."""
    # Everything the workers would otherwise write into their environment at run time
    # (`controller.worker.set_env`). On CPU, VLLM_CPU_KVCACHE_SPACE sizes the engine's cache:
    # vLLM-CPU otherwise reserves a fraction of all RAM per engine and refuses to start when
    # several engines and trainers share the machine.
    return {
        "OMP_NUM_THREADS": str(max(1, int(cpus_per_worker))),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1"),
        **quiet_env(),
        **engine_env(cfg.actor_rollout_ref.rollout, cfg.trainer.device),
    }


def default_cpus_per_worker(trainer_cfg: DictConfig, processes_per_node: int | None = None) -> float:
    """Each worker's share of a node: the CPUs of the smallest Ray node that can host workers
    (one with GPUs when training on them; a head started with --num-cpus=0 hosts none) over
    `processes_per_node` (default `trainer.n_gpus_per_node`; a rollout pool's processes share the
    node too)."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    hosts = [r["CPU"] for r in nodes if r.get("CPU", 0) > 0 and (trainer_cfg.device != "cuda" or r.get("GPU", 0) > 0)]
    return max(0.5, min(hosts, default=os.cpu_count() or 1) / (processes_per_node or trainer_cfg.n_gpus_per_node))


def cpus_per_worker(cfg: DictConfig) -> float:
    """`trainer.cpus_per_worker`, else the trainer's, the rollout pool's and the reward model
    pool's processes share each node."""
    pools = 0 if cfg.actor_rollout_ref.hybrid_engine else cfg.rollout.n_gpus_per_node
    if reward_model_pool(cfg):
        pools += cfg.reward_model.n_gpus_per_node
    return cfg.trainer.cpus_per_worker or default_cpus_per_worker(cfg.trainer, cfg.trainer.n_gpus_per_node + pools)


def reward_model_pool(cfg: DictConfig) -> bool:
    """Whether the reward model runs in processes of its own (reward_model.enable_resource_pool)."""
    return bool(cfg.reward_model.enable and cfg.reward_model.enable_resource_pool)


def _plain(value):
    """numpy and torch scalars (reward functions return them) as JSON numbers."""
    return value.item() if hasattr(value, "item") else str(value)


class WorkerFailure(RuntimeError):
    """A worker process failed or died; the message names the rank, node and step."""


def out_of_memory_advice(cfg: DictConfig, engine_settings: dict | None = None) -> str:
    """What to change when Ray's memory monitor killed a worker: the settings, among those this
    run has not already set (or, for `cpu_in_place_sync: auto`, its engines already chose: their
    `engine_settings` once started), that make a rank's process hold less host memory."""
    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    if cfg.trainer.device == "cuda":
        return ("Host memory ran out. On GPU it holds what is offloaded: weights or optimizer state under "
                "actor_rollout_ref.actor.fsdp_config.param_offload / optimizer_offload (or the megatron.* "
                "offloads), and the vLLM engine's weights while it sleeps between rollouts "
                "(actor_rollout_ref.rollout.free_cache_engine=false keeps them on the GPU). Turn those off, "
                "or give the job nodes with more memory.")
    levers = []
    if not lora.enabled(model) and not megatron_lora.enabled(model):
        key = ("actor_rollout_ref.model.lora.rank" if cfg.actor_rollout_ref.actor.strategy == "megatron"
               else "actor_rollout_ref.model.lora_rank")
        levers.append(f"{key}=16 (no gradients or optimizer state for the base weights, and no separate "
                      "reference model)")
    if not model.enable_gradient_checkpointing:
        levers.append("actor_rollout_ref.model.enable_gradient_checkpointing=true")
    if rollout.name == "vllm" and cfg.actor_rollout_ref.hybrid_engine:
        if rollout.cpu_in_place_sync and (engine_settings or {}).get("cpu_in_place_sync", True):
            levers.append("actor_rollout_ref.rollout.cpu_in_place_sync=false (vLLM-CPU keeps no second copy "
                          "of its linear layers; syncs take longer)")
        levers.append(f"a smaller actor_rollout_ref.rollout.kv_cache_gib (now {rollout.kv_cache_gib})")
        levers.append("actor_rollout_ref.rollout.name=hf (no vLLM engine: the rollout generates with the "
                      "trainer's own weights, several times slower)")
    if cfg.trainer.n_gpus_per_node > 1:
        levers.append(f"fewer ranks per node (trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node}: each rank "
                      "has a process of its own)")
    if not levers:
        return "The node ran out of memory with every memory-saving setting on: this model needs a larger machine."
    return ("The node ran out of memory. To need less per rank: " + "; ".join(levers) +
            ". docs/benchmarks.md ('Whole-worker memory') lists what fits on a 24 GiB machine.")


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling reached algorithm.filter_groups.max_num_gen_batches without enough groups."""


class RewardComponentError(ValueError):
    """A reward component GDPO normalises (algorithm.gdpo_reward_keys) is missing or not a number."""


def reward_components(reward_extra: dict, keys: list[str], rows: int) -> torch.Tensor:
    """GDPO's (rows, K) reward components: the reward function's value under each key, per
    response; a sample whose reward function failed (reward_model.on_error=zero) scores 0 in each."""
    failed = reward_extra.get("reward_failed") or [False] * rows
    columns = []
    for key in keys:
        values = reward_extra.get(key)
        missing = [i for i in range(rows) if not failed[i] and (values is None or values[i] is None)]
        if missing:
            returned = sorted(k for k, v in reward_extra.items() if isinstance(v, list) and len(v) == rows)
            raise RewardComponentError(
                f"algorithm.gdpo_reward_keys names {key!r}, which the reward function did not return for sample "
                f"{missing[0]} ({len(missing)} of {rows} samples; it returned: {', '.join(returned)}). Return "
                f"{key!r} in the dict for every sample, or name the components it returns.")
        column = []
        for i in range(rows):
            value = 0.0 if failed[i] else values[i]
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
                raise RewardComponentError(f"reward component {key!r} of sample {i} is {value!r}; GDPO normalises "
                                           "finite numbers (algorithm.gdpo_reward_keys).")
            column.append(float(value))
        columns.append(column)
    return torch.tensor(columns, dtype=torch.float32).T.reshape(rows, len(keys))


def reward_component_metrics(components: torch.Tensor, keys: list[str]) -> dict[str, float]:
    """gdpo/<key>/{mean,std,max,min} over the step's responses, as verl logs them."""
    metrics = {}
    for key, column in zip(keys, components.double().T):
        metrics.update({f"gdpo/{key}/mean": float(column.mean()), f"gdpo/{key}/std": float(column.std(unbiased=False)),
                        f"gdpo/{key}/max": float(column.max()), f"gdpo/{key}/min": float(column.min())})
    return metrics


def _rows_of(extra: dict, rows: list[int]) -> dict:
    """The reward function's per-sample values at ``rows``."""
    return {key: [values[i] for i in rows] for key, values in extra.items()}


def _add_on_last_token(token_values: torch.Tensor, lengths: torch.Tensor, per_response: torch.Tensor) -> torch.Tensor:
    """A copy of (B, T) ``token_values`` with each response's value added on its last token
    (``lengths``: `Batch.response_lengths`)."""
    last = (lengths - 1).clamp_min(0)
    out = token_values.clone()
    out[torch.arange(len(out)), last] += per_response
    return out


IN_FLIGHT_FILE = "in_flight_batches.pkl"
# What an advantage estimator may read besides rewards and masks, when the step produced it.
ADVANTAGE_EXTRAS = ("values", "reward_baselines", "step_mask", "old_log_probs", "sum_pi_squared", "rollout_is_weights",
                    "reward_components")


@dataclass
class InFlight:
    """A batch the rollout pool generates for a later step (asynchronous training)."""

    step: int  # the step that trains on it
    version: int  # the actor update count of the weights that sample it
    call: PendingCall | None
    batch: Batch | None = None  # once collected (or restored from a checkpoint, or loaded from the rollout cache)
    prompts: Batch | None = None  # what it was generated for (dumped with it by the rollout cache)
    cache_lookup: Lookup | None = None  # the rollout cache's lookup of its step

    def result(self) -> Batch:
        if self.batch is None:
            self.batch = self.call.result()
        return self.batch


def teacher_rows(batch: Batch, teachers: list, field: str) -> torch.Tensor:
    """Which distillation teacher scores each row (its index in `teachers`): a single one every
    row; of several, the one whose key is the row's `field` (distillation.teacher_key: a field of
    the row such as data_source, else an entry of its extra_info)."""
    if len(teachers) == 1:
        return torch.zeros(len(batch), dtype=torch.long)
    values = [str(value) for value in (
        batch[field] if field in batch.non_tensors else
        [info.get(field) if isinstance(info, dict) else None for info in batch["extra_info"]])]
    index = {teacher.key: i for i, teacher in enumerate(teachers)}
    missing = sorted({value for value in values if value not in index})
    if missing:
        raise ValueError(f"distillation.teacher_key={field}: rows with {field} {', '.join(map(repr, missing[:5]))} "
                         f"have no teacher (the teachers' keys: {', '.join(map(repr, index))}). Add a teacher with "
                         "that key, or route by another field.")
    return torch.tensor([index[value] for value in values], dtype=torch.long)


class Trainer:
    def __init__(self, cfg: DictConfig, model_path: str, tokenizer, train_dataset: RLDataset,
                 val_dataset: RLDataset | None, reward_fn: RewardManager, val_reward_fn: RewardManager):
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.advantage_fn = get_advantage_estimator(cfg.algorithm.adv_estimator)
        self.use_reference = needs_reference(cfg)
        self.teachers = distillation_teachers(cfg) or []
        self.use_critic = needs_critic(cfg)

        self.dynamic_sampling = cfg.algorithm.filter_groups.enable
        gen_batch_size = cfg.data.gen_batch_size or cfg.data.train_batch_size
        # verl's data.sampler: a sampler of the user's (a curriculum) instead of the shuffled epochs.
        custom = (load_custom_sampler(cfg.data, train_dataset, gen_batch_size, total_epochs=1)
                  if OmegaConf.select(cfg, "data.sampler.class_path") else None)
        steps_per_epoch = custom.steps_per_epoch if custom else len(train_dataset) // gen_batch_size
        self.total_steps = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs
        # Dynamic sampling draws an unknown number of batches per step: the sampler never runs dry.
        epochs = math.ceil(self.total_steps / max(1, steps_per_epoch))
        total_epochs = 2**62 if self.dynamic_sampling else max(cfg.trainer.total_epochs, epochs)
        if custom:
            custom.total_epochs = total_epochs
        self.sampler = custom or EpochSampler(len(train_dataset), gen_batch_size, shuffle=cfg.data.shuffle,
                                              seed=cfg.data.seed, drop_last=True, total_epochs=total_epochs)
        actor = cfg.actor_rollout_ref.actor
        correction = cfg.algorithm.rollout_correction
        # With a single on-policy update the ratio is exactly 1 and the old log-probs are the
        # update's own forward; they need a pass of their own only when used before the update.
        # In bypass mode the engine's log-probs are the old ones.
        self.bypass = bool(correction.bypass_mode)
        self.recompute_old_log_probs = not self.bypass and bool(
            actor.ppo_epochs > 1 or actor.ppo_mini_batch_size < cfg.data.train_batch_size
            or cfg.algorithm.use_kl_in_reward or correction.rollout_is or correction.rollout_rs
            or actor.calculate_sum_pi_squared)
        if replay_mode(actor) == "R2" and not self.recompute_old_log_probs:
            logger.warning("router_replay.mode=R2 has nothing to replay here: each step is one on-policy update, "
                           "so no old-log-prob pass records routes (it does with ppo_mini_batch_size < "
                           "data.train_batch_size or ppo_epochs > 1).")
        # A rollout pool of its own generates up to rollout.max_staleness batches ahead.
        self.async_rollout = not cfg.actor_rollout_ref.hybrid_engine
        # verl's skip.rollout: steps served from rollouts an earlier run dumped.
        cache = rollout_cache_settings(cfg)
        self.rollout_cache = None if cache is None else RolloutCache(
            dump_folder(cache.pop("dump_dir"), cfg.trainer.experiment_name, cfg.trainer.project_name, gen_batch_size,
                        cfg.actor_rollout_ref.rollout.n, cfg.data.max_prompt_length, cfg.data.max_response_length),
            **cache)
        self.n_ranks = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        self.stop_requested: str | None = None  # the signal's name, once one asked to stop
        self.summary = RunSummary()
        self.reset_run_state()
        self.checkpoints = CheckpointManager(cfg.trainer.default_local_dir, cfg.trainer.max_actor_ckpt_to_keep,
                                             cfg.trainer.max_critic_ckpt_to_keep)
        # Resolved now, before any worker starts, so a bad resume path or callback fails fast.
        self.resume_from = self.checkpoints.resume_folder(cfg.trainer.resume_mode, cfg.trainer.resume_from_path)
        self.checkpoint_callback = build_checkpoint_callback(cfg)
        # verl's checkpoint.async_save: those roles write their shards while training goes on.
        self.saves_in_background = any(OmegaConf.select(cfg, f"{role}.checkpoint.async_save", default=False)
                                       for role in ("actor_rollout_ref.actor", "critic"))
        self.pending_checkpoint: PendingCheckpoint | None = None

    def reset_run_state(self) -> None:
        """Driver-side state that a checkpoint restores; fresh values for a run from scratch."""
        self.global_step = 0
        self.sampler.load_state_dict({"epoch": 0, "batch_in_epoch": 0})
        self.kl_ctrl = get_kl_controller(self.cfg.algorithm.kl_ctrl)
        self.reward_stats = RunningMoments()  # for algorithm.reward_norm.*=running
        iterative = self.cfg.trainer.iterative
        self.iteration = (IterationSamples(iterative, self.tokenizer, self.pad_token_id, self.cfg.trainer.seed,
                                           load_step_scorer(self.cfg), self.cfg.reward_model.process.step_separator)
                          if iterative.enable else None)
        self.weights_version = 0  # actor updates so far
        self.rollout_version: int | None = None  # the update count of the rollout pool's weights
        self.launched_step = 0  # the last step a generation was started for
        self.in_flight: deque[InFlight] = deque()

    # ------------------------------------------------------------------ workers
    def init_workers(self) -> None:
        cfg = self.cfg
        cpus = cpus_per_worker(cfg)
        self.resource_pool = pool = ResourcePool([cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes,
                            use_gpu=cfg.trainer.device == "cuda", cpus_per_process=cpus,
                            strategy=cfg.trainer.placement_strategy)
        config = to_container(cfg)
        ref_path = reference_model_path(cfg)
        teacher_paths = [resolve_model_path(teacher.path, key=teacher.path_key) for teacher in self.teachers]
        roles = {"actor_rollout_ref": ClassWithInitArgs(
            ActorRolloutRefWorker, config, self.model_path, self.total_steps,
            resolve_model_path(ref_path, key=REF_MODEL_KEY) if ref_path is not None else None, teacher_paths)}
        if self.use_critic:
            critic_path = resolve_model_path(cfg.critic.model.path) if cfg.critic.model.path else self.model_path
            roles["critic"] = ClassWithInitArgs(CriticWorker, config, critic_path, self.total_steps)
        self.reward_model = None
        if cfg.reward_model.enable:
            rm_path = resolve_model_path(cfg.reward_model.model.path, key="reward_model.model.path")
            reward_model = ClassWithInitArgs(RewardModelWorker, config, rm_path, self.total_steps, self.model_path)
            if reward_model_pool(cfg):
                self.reward_model = self.init_reward_model_pool(reward_model, cpus)
            else:
                roles["reward_model"] = reward_model
        # The other roles share one process per rank (and its CPUs/GPU).
        self.group = RayWorkerGroup(pool, create_colocated_worker_cls(roles), name_prefix="worker_",
                                    env_vars=worker_env(cfg, cpus))
        views = self.group.spawn(roles)
        self.workers, self.critic = views["actor_rollout_ref"], views.get("critic")
        self.reward_model = views.get("reward_model", self.reward_model)
        self.node_info = self.group.get_node_info()
        if len({info["node_id"] for info in self.node_info}) > 1:
            placed = (f"{info['rank']} on {info['node_id'][:12]} ({info['hostname']}, {info['ip']})"
                      for info in self.node_info)
            logger.info("Ranks on Ray nodes: %s", ", ".join(placed))
        if self.critic is not None:
            self.critic.init_model()
        if self.reward_model is not None:
            reward_model = self.reward_model.init_model()[0]
            self.reward_model_dp = reward_model["dp_size"]
            if reward_model["retemplate"]:
                logger.info("The reward model's tokenizer or chat template differs from the policy's: each response "
                            "is decoded and re-templated for it.")
        # Last: the rollout engine sizes its cache after the trainers.
        engines = [rank["rollout"] for rank in self.workers.init_model()]
        if cfg.reward.reward_model.enable:
            self.init_reward_server()
        self.generator = self.workers
        if self.async_rollout:
            engines = self.init_rollout_pool(config, cpus)
        self.engine_settings = engines[0]
        if self.engine_settings:
            logger.info("vLLM engine: %s", ", ".join(f"{k} {v}" for k, v in self.engine_settings.items()))
        if cfg.actor_rollout_ref.rollout.prometheus.enable:
            publish_targets(cfg.actor_rollout_ref.rollout.prometheus, [e["metrics"] for e in engines if "metrics" in e])

    def init_reward_model_pool(self, reward_model: ClassWithInitArgs, cpus: float) -> RayWorkerGroup:
        """reward_model.enable_resource_pool: the reward model's workers, in processes of their own."""
        cfg = self.cfg
        self.reward_model_pool = ResourcePool([cfg.reward_model.n_gpus_per_node] * cfg.reward_model.nnodes,
                                              use_gpu=cfg.trainer.device == "cuda", cpus_per_process=cpus,
                                              strategy=cfg.trainer.placement_strategy)
        self.reward_model_group = RayWorkerGroup(self.reward_model_pool, reward_model, name_prefix="reward_model_",
                                                 env_vars=worker_env(cfg, cpus))
        return self.reward_model_group

    def init_reward_server(self) -> None:
        """reward.reward_model.enable: the served reward model, whose address and tokenizer the
        reward functions get (`workers/reward_server.py`)."""
        rm = self.cfg.reward.reward_model
        path = resolve_model_path(rm.model_path, key="reward.reward_model.model_path")
        self.reward_server = RewardServer.start(self.cfg, path)
        logger.info("The reward model %s serves at %s (vLLM's OpenAI-compatible server).", path,
                    self.reward_server.address)
        for reward_fn in (self.reward_fn, self.val_reward_fn):
            reward_fn.call_kwargs = self.reward_server.call_kwargs()

    def init_rollout_pool(self, config: dict, cpus: float) -> list[dict]:
        """Asynchronous training: the rollout pool's workers (`cpus` each), the weight channel from
        the trainer's rank 0 to each of them, and the first push of the actor's weights; returns
        each rank's engine settings."""
        cfg = self.cfg
        self.rollout_pool = ResourcePool([cfg.rollout.n_gpus_per_node] * cfg.rollout.nnodes,
                                         use_gpu=cfg.trainer.device == "cuda", cpus_per_process=cpus,
                                         strategy=cfg.trainer.placement_strategy)
        self.rollout_group = RayWorkerGroup(
            self.rollout_pool, ClassWithInitArgs(RolloutWorker, config, self.model_path, self.total_steps),
            name_prefix="rollout_", env_vars=worker_env(cfg, cpus))
        settings = self.rollout_group.init_model()
        host, port = self.workers.weight_channel_address()
        world = 1 + self.rollout_group.world_size
        joining = self.rollout_group.join_weight_channel.submit(host, port, world)
        self.workers.join_weight_channel(host, port, world)
        joining.result()
        self.generator = self.rollout_group
        self.push_rollout_weights(everything=True)
        return settings

    def push_rollout_weights(self, everything: bool = False) -> dict[str, float]:
        """Asynchronous training: send the actor's weights to the rollout pool unless it has them
        (it takes them after the generation it may be running)."""
        if self.rollout_version == self.weights_version and not everything:
            return {}
        start = time.perf_counter()
        receiving = self.rollout_group.receive_weights.submit()
        sent = self.workers.send_rollout_weights(only_trained=not everything)[0]["bytes"]
        receiving.result()
        self.rollout_version = self.weights_version
        return {"perf/sync_gb_per_rank": sent / 1e9, "timing_s/update_weights": time.perf_counter() - start}

    def launch_generation(self, metrics: dict) -> None:
        """Asynchronous training: start generating the next step's batch with the actor's
        current weights."""
        metrics.update(self.push_rollout_weights())
        step = self.launched_step + 1
        indices = next(self.batches)  # drawn even where the cache serves the step, as in `generate`
        lookup = self.rollout_cache.load(step) if self.rollout_cache is not None else None
        if lookup is not None and lookup.loaded is not None:
            self.in_flight.append(InFlight(step, self.weights_version, None, lookup.loaded[1], cache_lookup=lookup))
        else:
            prompts = self.prompt_batch(indices)
            call = self.rollout_group.generate_sequences.submit(self.rollout_batch(prompts, step))
            self.in_flight.append(InFlight(step, self.weights_version, call, prompts=prompts, cache_lookup=lookup))
        self.launched_step = step

    def next_generated(self, metrics: dict) -> Batch:
        """Asynchronous training: this step's batch, then enough launches that rollout.max_staleness
        batches are generated while this one trains."""
        if not self.in_flight:
            self.launch_generation(metrics)
        head = self.in_flight.popleft()
        if head.cache_lookup is not None and head.cache_lookup.loaded is not None:
            batch = self.cached_batch(head.cache_lookup, metrics)[1]
        else:
            batch = head.result()
            if head.cache_lookup is not None:
                self.rollout_cache.save(head.cache_lookup, head.prompts, batch)
        while len(self.in_flight) < self.cfg.rollout.max_staleness and self.launched_step < self.total_steps:
            self.launch_generation(metrics)
        metrics["async/staleness"] = float(self.weights_version - head.version)
        return batch

    def restart_workers(self) -> None:
        """New worker processes, resuming from the latest checkpoint of this run (or from
        scratch when there is none)."""
        if self.pending_checkpoint is not None:  # its writes died with the workers
            shutil.rmtree(self.pending_checkpoint.folder, ignore_errors=True)
            self.pending_checkpoint = None
        self.shutdown()
        self.reset_run_state()
        self.resume_from = self.checkpoints.latest()
        self.init_workers()

    def describe_failure(self, exc: WorkerError) -> str:
        node = self.node_info[exc.rank] if exc.rank < len(self.node_info) else {}
        cause = str(exc).splitlines()[0]  # Ray's death reports run over many lines
        advice = f". {out_of_memory_advice(self.cfg, self.engine_settings)}" if exc.out_of_memory else ""
        return (f"worker rank {exc.rank} on node {node.get('hostname', '?')} ({node.get('ip', '?')}, pid "
                f"{node.get('pid', '?')}) failed during step {self.global_step}: {cause}{advice}")

    def shutdown(self) -> None:
        """Stop the workers and free their CPUs/GPUs (the Ray session itself stays up)."""
        if getattr(self, "reward_server", None) is not None:
            self.reward_server.stop()
            self.reward_server = None
        for group in ("group", "rollout_group", "reward_model_group"):
            if getattr(self, group, None) is not None:
                getattr(self, group).kill()
        for pool in ("resource_pool", "rollout_pool", "reward_model_pool"):
            if getattr(self, pool, None) is not None:
                getattr(self, pool).remove()
        for scorer in (self.reward_fn, self.val_reward_fn):  # its threads, or its scoring processes
            scorer.close()

    # ------------------------------------------------------------------ loop
    def request_stop(self, signal_name: str) -> None:
        """Stop after the step in progress (called from a signal handler): save a checkpoint when
        checkpointing is on, then return from `fit`."""
        self.stop_requested = signal_name

    def fit(self) -> RunSummary:
        """Train to `total_steps` (or to a `request_stop`); a failed or dead worker becomes a
        `WorkerFailure`. Returns what was done, for the closing summary."""
        cfg = self.cfg
        tracker = Tracker(cfg.trainer.logger, cfg.trainer.default_local_dir, self.total_steps,
                          cfg.trainer.progress_bar, project=cfg.trainer.project_name,
                          experiment=cfg.trainer.experiment_name, config=OmegaConf.to_container(cfg, resolve=True),
                          label=cfg.algorithm.adv_estimator)
        self.summary = RunSummary(total_steps=self.total_steps,
                                  metrics_file=tracker.jsonl.name if tracker.jsonl else None)
        start = time.perf_counter()
        try:
            self._fit(tracker)
        except WorkerError as exc:
            raise WorkerFailure(self.describe_failure(exc)) from exc
        finally:
            tracker.close()
            self.summary.wall_s = time.perf_counter() - start
            latest = self.checkpoints.completed()
            self.summary.checkpoint = str(latest[-1]) if latest else None
        return self.summary

    def _fit(self, tracker: Tracker) -> None:
        cfg = self.cfg
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
            tracker.advance_to(self.global_step)
        elif cfg.trainer.val_before_train and self.val_dataset is not None:
            metrics = self.validate()
            self.summary.add_validation(0, metrics)
            tracker.log(metrics, step=0)
            if cfg.trainer.val_only:
                return
        self.summary.first_step = self.global_step + 1
        self.batches = iter(self.sampler)
        any_profiled = any(role_settings(cfg, role) for role in ROLE_PROFILER_KEYS)
        profiled = StepWindows(cfg.global_profiler.steps if any_profiled else (),
                               cfg.global_profiler.profile_continuous_steps)
        profiling = False
        longest_step = 0.0
        for step in range(self.global_step + 1, self.total_steps + 1):
            step_start = time.perf_counter()
            self.global_step = step
            if step in profiled.steps and not profiling:
                self.toggle_profilers("start_profile", step)
                profiling = True
            metrics = self.train_step(None if self.async_rollout else next(self.batches))
            if self.iteration is not None and self.iteration.due(step):
                metrics.update(self.end_iteration())
            is_last = step == self.total_steps
            # As in verl: every test_freq steps and at the last one; test_freq <= 0 never validates
            # after val_before_train (a final validation nobody asked for costs a whole pass).
            test_freq = cfg.trainer.test_freq
            if (self.val_dataset is not None and not self.stop_requested and test_freq > 0
                    and (is_last or step % test_freq == 0)):
                val_metrics = self.validate()
                self.summary.add_validation(step, val_metrics)
                metrics.update(val_metrics)
            save_freq = cfg.trainer.save_freq
            longest_step = max(longest_step, time.perf_counter() - step_start)
            due = save_freq > 0 and (is_last or step % save_freq == 0 or bool(self.stop_requested))
            # As verl: a checkpoint while one still fits before the machines' capacity block ends.
            block_ending = save_freq > 0 and not due and capacity_block_ending(longest_step,
                                                                               cfg.trainer.esi_redundant_time)
            if block_ending:
                logger.warning("Step %d: the capacity block ends before another step and checkpoint would; saving "
                               "a checkpoint now.", step)
            saved = due or block_ending
            start = time.perf_counter()

            def log_step() -> None:
                if saved:
                    metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
                self.summary.add_step(metrics)
                tracker.log(metrics, step=step)

            if saved:
                # Logged before the checkpoint becomes the latest: a run killed in between repeats
                # the step when resumed instead of losing its line.
                self.save_checkpoint(before_commit=log_step)
                if block_ending:
                    self.commit_checkpoint()
            else:
                log_step()
            tracker.advance(metrics["critic/score/mean"])
            if profiling and (profiled.ends(step) or is_last or self.stop_requested):
                last_window = step >= max(profiled.steps) or is_last or self.stop_requested
                self.toggle_profilers("stop_profile", step, last_window)
                profiling = False
            if self.stop_requested:
                if save_freq > 0 and not saved:  # the signal came while this step was being logged
                    self.save_checkpoint()
                self.commit_checkpoint()
                self.summary.stopped_by = self.stop_requested
                return
        self.commit_checkpoint()
        if cfg.trainer.final_model_dir:
            self.summary.final_model = self.save_final_model(cfg.trainer.final_model_dir)

    def toggle_profilers(self, method: str, *args) -> None:
        """`start_profile(step)` or `stop_profile(step, last)` on every worker group; each process's
        own settings say whether it records (hybrid_rl/profiler.py)."""
        for group in (self.workers, self.critic, self.reward_model, getattr(self, "rollout_group", None)):
            if group is not None:
                getattr(group, method)(*args)

    # ------------------------------------------------------------------ checkpoints
    def write_hf_files(self, folder: str) -> None:
        """Tokenizer, chat template and generation config beside a model's weights."""
        self.tokenizer.save_pretrained(folder)
        if os.path.isfile(os.path.join(self.model_path, "generation_config.json")):
            shutil.copy(os.path.join(self.model_path, "generation_config.json"), folder)

    def save_final_model(self, out_dir: str) -> str:
        """The trained actor as a Hugging Face folder that transformers and vLLM load; it appears
        at `out_dir` only when complete (an earlier one there is replaced)."""
        from pathlib import Path

        from hybrid_rl.export import write_folder

        def write(tmp: Path) -> None:
            self.workers.save_hf_model(str(tmp))
            self.write_hf_files(str(tmp))

        out = Path(os.path.expanduser(out_dir)).absolute()
        write_folder(out, write, overwrite=True)
        logger.info("Saved the final model to %s", out)
        return str(out)

    def save_checkpoint(self, before_commit=None) -> None:
        def write_parts(folder: str) -> None:
            # Config, tokenizer and chat template, so a checkpoint exports without the original model.
            hf_dir = os.path.join(folder, "huggingface")
            self.write_hf_files(hf_dir)
            model_cfg = self.cfg.actor_rollout_ref.model
            AutoConfig.from_pretrained(model_cfg.get("hf_config_path") or self.model_path).save_pretrained(hf_dir)
            if "hf_model" in self.cfg.actor_rollout_ref.actor.checkpoint.save_contents:
                self.workers.save_hf_model(hf_dir)  # the weights too: a folder transformers and vLLM load
            self.workers.save_checkpoint(os.path.join(folder, "actor"), self.moving_reference_folder(folder))
            if self.critic is not None:
                self.critic.save_checkpoint(os.path.join(folder, CRITIC))
                if "hf_model" in self.cfg.critic.checkpoint.save_contents:
                    critic_hf_dir = os.path.join(folder, CRITIC, "huggingface")
                    self.critic.save_hf_model(critic_hf_dir)
                    self.write_hf_files(critic_hf_dir)
            if self.iteration is not None:  # iterative RL trains the reward model
                self.iteration.save(folder)
                if self.reward_model is not None:
                    self.reward_model.save_checkpoint(os.path.join(folder, "reward_model"))
            if self.in_flight:
                # Batches sampled by weights no checkpoint holds: kept as generated, so a resumed
                # run trains on exactly what an uninterrupted one would.
                with open(os.path.join(folder, IN_FLIGHT_FILE), "wb") as f:
                    pickle.dump([(g.step, g.version, g.result()) for g in self.in_flight], f)

        # The sampler has already handed out this step's batch (and those in flight): its state is
        # the next batch.
        state = {"global_step": self.global_step, "sampler": self.sampler.state_dict(),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "reward_stats": self.reward_stats.state_dict(),
                 "weights_version": self.weights_version, "launched_step": self.launched_step,
                 "config": to_container(self.cfg)}
        self.commit_checkpoint()  # the one before, if its writes are still under way
        pending = self.checkpoints.begin(self.global_step, write_parts, state)
        if self.saves_in_background:
            if before_commit is not None:
                before_commit()
            self.pending_checkpoint = pending
        else:
            self._commit(pending, before_commit)

    def commit_checkpoint(self) -> None:
        """Make the checkpoint whose shards are being written in the background the latest, once
        they are on disk (a no-op when there is none)."""
        pending, self.pending_checkpoint = self.pending_checkpoint, None
        if pending is not None:
            self._commit(pending)

    def _commit(self, pending: PendingCheckpoint, before_commit=None) -> None:
        def wait() -> None:
            self.workers.finish_checkpoint()
            if self.critic is not None:
                self.critic.finish_checkpoint()

        folder = self.checkpoints.commit(pending, wait if self.saves_in_background else None, before_commit)
        if self.cfg.trainer.get("default_hdfs_dir"):
            mirror_checkpoint(folder, self.cfg.trainer.default_hdfs_dir)
        if self.checkpoint_callback is not None:
            run_checkpoint_callback(self.checkpoint_callback, self, pending.step, folder)

    def load_checkpoint(self, folder) -> None:
        state = read_trainer_state(folder)
        actor_parts = parts_to_load(self.cfg.actor_rollout_ref.actor.checkpoint, "actor_rollout_ref.actor", folder)
        self.workers.load_checkpoint(os.path.join(folder, "actor"), self.moving_reference_folder(folder), actor_parts)
        if self.critic is not None:
            self.critic.load_checkpoint(str(self.checkpoints.critic_folder(folder)),
                                        parts_to_load(self.cfg.critic.checkpoint, "critic", folder))
        if self.iteration is not None:
            self.iteration.load(folder)
            if self.reward_model is not None:
                self.reward_model.load_checkpoint(os.path.join(folder, "reward_model"))
        self.global_step = int(state["global_step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.reward_stats.load_state_dict(state["reward_stats"])
        self.weights_version = int(state.get("weights_version", self.global_step))
        self.launched_step = int(state.get("launched_step", self.global_step))
        self.rollout_version = None  # the pool has the weights of its first push: send the restored ones
        in_flight = os.path.join(folder, IN_FLIGHT_FILE)
        if os.path.exists(in_flight):
            with open(in_flight, "rb") as f:
                self.in_flight = deque(InFlight(step, version, None, batch) for step, version, batch in pickle.load(f))
        logger.info("Resumed from %s at step %d", folder, self.global_step)

    def moving_reference_folder(self, folder: str) -> str | None:
        """Where a checkpoint keeps the reference policy: only iterative RL moves it."""
        iterative = self.cfg.trainer.iterative
        return os.path.join(folder, "ref") if iterative.enable and iterative.reset_reference else None

    # ------------------------------------------------------------------ iterative RL
    def end_iteration(self) -> dict[str, float]:
        """Iterative RL: train the reward model on this iteration's samples and the replay buffer
        (`hybrid_rl/iterative.py`), then make the reference policy the current actor."""
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.reward_model is not None:
            batch = self.iteration.training_batch(self.global_step, self.reward_model_dp)
            if len(batch):
                batch.meta = BatchMeta(step=self.global_step)
                per_rank = self.reward_model.train_reward_model(batch)
                sums = {key: sum(r.pop(key) for r in per_rank) for key in (
                    "replay_loss_sum_before", "replay_loss_sum_after", "replayed_rows", "replayed_examples")}
                metrics.update(reduce_worker_metrics(per_rank))
                metrics["iterative/reward_model_rows"] = float(len(batch))
                metrics["iterative/replayed_rows"] = sums["replayed_rows"]
                if sums["replayed_examples"]:  # the mean loss per replayed row (per step, for a PRM)
                    for when in ("before", "after"):
                        metrics[f"iterative/replay_loss_{when}"] = (sums[f"replay_loss_sum_{when}"]
                                                                    / sums["replayed_examples"])
            if self.iteration.step_scorer is not None:
                metrics["iterative/unlabelled_samples"] = float(self.iteration.unlabelled)
        if self.cfg.trainer.iterative.reset_reference:
            metrics["iterative/reference_reset"] = float(self.workers.reset_reference()[0])
        metrics["timing_s/iteration"] = time.perf_counter() - start
        return metrics

    def train_step(self, indices: list[int]) -> dict[str, float]:
        cfg = self.cfg
        timer = Timer()
        metrics: dict[str, float] = {}
        with timer.phase("step"):
            batch, reward_extra = self.generate_and_score(indices, timer, metrics)

            if self.dynamic_sampling:
                batch, reward_extra = self.keep_varied_groups(batch, reward_extra, timer, metrics)

            with timer.phase("reward"):
                batch["token_level_rewards"] = self.shaped_rewards(batch)

            if cfg.trainer.balance_batch and self.n_ranks > 1:
                model = cfg.actor_rollout_ref.model
                batch = batch[seqlen_balancing.balance_permutation(
                    batch, self.n_ranks, share_prompts=model.use_remove_padding and model.share_prompt_prefix)]

            if self.bypass:  # the behaviour policy's log-probs, as the engine sampled them
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif self.recompute_old_log_probs:
                with timer.phase("old_log_prob"):
                    old = self.workers.compute_log_prob(batch)
                    if ROUTES_KEY in old and ROUTES_KEY in batch:  # R2: the pass's routes replace the rollout's
                        batch.pop([ROUTES_KEY])
                    batch.union(old)

            if self.use_reference:
                with timer.phase("ref"):
                    batch.union(self.workers.compute_ref_log_prob(batch))

            if self.teachers:
                with timer.phase("teacher"):
                    batch["teacher_index"] = teacher_rows(batch, self.teachers, cfg.distillation.teacher_key)
                    batch.union(self.workers.compute_teacher_log_prob(batch))
                    batch.pop(["teacher_index"])

            if self.use_critic:
                with timer.phase("values"):
                    batch.union(self.critic.compute_values(batch))

            with timer.phase("adv"):
                metrics.update(self.reward_kl_and_rollout_correction(batch))
                advantages, returns = self.advantage_fn(
                    batch["token_level_rewards"], batch["response_mask"], index=batch["uid"], config=cfg.algorithm,
                    **{key: batch[key] for key in ADVANTAGE_EXTRAS if key in batch})
                batch["advantages"] = shape_advantages(advantages, batch["response_mask"], cfg.algorithm)
                batch["returns"] = returns
                if "reward_components" in batch:  # read by the estimator only
                    metrics.update(reward_component_metrics(batch.pop(["reward_components"])["reward_components"],
                                                            cfg.algorithm.gdpo_reward_keys))
                if cfg.algorithm.use_pf_ppo:
                    batch, reward_extra = self.policy_filtration(batch, reward_extra, metrics)

            if self.use_critic:
                with timer.phase("update_critic"):
                    metrics.update(reduce_worker_metrics(self.critic.update_critic(batch)))

            # verl's critic warm-up: the first steps train only the critic.
            if self.global_step >= cfg.trainer.critic_warmup:
                with timer.phase("update_actor"):
                    metrics.update(reduce_worker_metrics(self.workers.update_actor(batch)))
                self.weights_version += 1

                if not self.async_rollout:  # the pool takes them when it starts its next batch
                    with timer.phase("update_weights"):
                        pushed = self.workers.sync_rollout_weights()
                    # Every rank's engine receives every weight, in the rollout's dtype.
                    metrics["perf/sync_gb_per_rank"] = pushed[0]["bytes"] / 1e9

        if isinstance(self.sampler, CustomSampler):  # a curriculum learns from the trained batch
            self.sampler.update(batch)

        if self.iteration is not None and self.reward_model is not None:
            self.iteration.collect(batch)
        if cfg.trainer.rollout_data_dir:
            self.dump_generations(cfg.trainer.rollout_data_dir, batch, reward_extra)
        metrics.update({"training/global_step": float(self.global_step), **compute_data_metrics(batch),
                        **timer.timings, **throughput_metrics(batch, timer.timings["timing_s/step"], self.n_ranks)})
        metrics["reward/failed_samples_total"] = float(self.reward_fn.total_failures)
        metrics.update(reward_source_metrics(reward_extra, self.reward_fn.sandbox_failures))
        accuracies = [float(a) for a in reward_extra.get("acc", []) if a is not None]  # None: failed sample
        if accuracies:
            metrics["critic/acc/mean"] = float(np.mean(accuracies))
        return metrics

    def generate_and_score(self, indices: list[int] | None, timer: Timer, metrics: dict) -> tuple[Batch, dict]:
        """n responses to each of the prompts at `indices` (asynchronous training: the batch the
        rollout pool generated for this step), with their (reward model's and) reward function's
        scores as `token_level_scores`; returns the batch and the reward function's per-sample
        values."""
        cfg = self.cfg
        n = cfg.actor_rollout_ref.rollout.n
        if self.async_rollout:
            with timer.phase("gen"):
                batch = self.next_generated(metrics)
        else:
            with timer.phase("gen"):
                prompts, batch = self.generate(indices, metrics)

        if cfg.algorithm.adv_estimator == "remax":
            with timer.phase("gen_max"):
                batch["reward_baselines"] = self.greedy_baseline(prompts).repeat_interleave(n)

        if self.reward_model is not None:
            with timer.phase("reward_model"):
                metrics.update(self.add_rm_scores(batch))

        with timer.phase("reward"):
            scores, reward_extra = self.reward_fn(batch)
            metrics["reward/failed_samples"] = metrics.get("reward/failed_samples", 0.0) + self.reward_fn.failures
            if "step_mask" in reward_extra:
                batch["step_mask"] = reward_extra.pop("step_mask")
            batch["token_level_scores"] = self.add_overlong_penalty(batch, scores, reward_extra, metrics)
            if cfg.algorithm.adv_estimator == "gdpo":
                batch["reward_components"] = reward_components(reward_extra, cfg.algorithm.gdpo_reward_keys, len(batch))
        return batch, reward_extra

    def generate(self, indices: list[int], metrics: dict) -> tuple[Batch, Batch]:
        """The step's prompts (each with its group uid) and their n responses each: generated for the
        prompts at `indices`, or, where the rollout cache serves the step, the prompts and responses
        it dumped (the sampler has still drawn `indices`, so later steps draw what they would have)."""
        step = self.global_step
        lookup = self.rollout_cache.load(step) if self.rollout_cache is not None else None
        if lookup is not None and lookup.loaded is not None:
            return self.cached_batch(lookup, metrics)
        prompts = self.prompt_batch(indices)
        batch = self.workers.generate_sequences(self.rollout_batch(prompts, step))
        if lookup is not None:
            self.rollout_cache.save(lookup, prompts, batch)
        return prompts, batch

    def cached_batch(self, lookup: Lookup, metrics: dict) -> tuple[Batch, Batch]:
        """The prompts and generated batch the rollout cache loaded for `lookup.step`, as the step's own."""
        prompts, batch, source = lookup.loaded
        prompts.meta = batch.meta = BatchMeta(step=lookup.step, temperature=training_temperature(
            self.cfg.actor_rollout_ref.rollout))
        metrics["rollout_cache/loaded_batches"] = metrics.get("rollout_cache/loaded_batches", 0.0) + 1
        metrics["rollout_cache/source_step"] = float(source)
        return prompts, batch

    def add_overlong_penalty(self, batch: Batch, scores: torch.Tensor, reward_extra: dict, metrics: dict) -> torch.Tensor:
        """DAPO's overlong buffer (reward_model.overlong_buffer): each response's penalty added to
        its score on its last token."""
        buffer = self.cfg.reward_model.overlong_buffer
        if not buffer.enable:
            return scores
        penalty = overlong_penalty(batch.response_lengths(), self.cfg.data.max_response_length, buffer.len,
                                   buffer.penalty_factor)
        metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
        metrics["reward/overlong_share"] = float((penalty < 0).float().mean())
        if buffer.log:
            reward_extra["overlong_reward"] = penalty.tolist()
            reward_extra["overlong"] = (penalty < 0).tolist()
        return _add_on_last_token(scores, batch.response_lengths(), penalty)

    def keep_varied_groups(self, batch: Batch, reward_extra: dict, timer: Timer,
                           metrics: dict) -> tuple[Batch, dict]:
        """DAPO's dynamic sampling (algorithm.filter_groups): keep the groups whose responses differ
        in `metric`, generating batches of further prompts until `data.train_batch_size` prompts are
        kept; the surplus of the last batch is dropped."""
        cfg = self.cfg
        n, wanted = cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size
        limit = cfg.algorithm.filter_groups.max_num_gen_batches
        kept: list[tuple[Batch, dict]] = []
        kept_groups = generated_groups = generation_batches = 0
        while True:
            generation_batches += 1
            keep = groups_with_variance(self.filter_values(batch, reward_extra), batch["uid"])
            rows = keep.nonzero().squeeze(-1).tolist()
            kept.append((batch[torch.tensor(rows, dtype=torch.long)], _rows_of(reward_extra, rows)))
            generated_groups += len(batch) // n
            kept_groups += len(rows) // n
            if kept_groups >= wanted:
                break
            if limit and generation_batches >= limit:
                raise DynamicSamplingError(
                    f"dynamic sampling (algorithm.filter_groups) made {generation_batches} generation batches "
                    f"(algorithm.filter_groups.max_num_gen_batches) and kept only {kept_groups} of the {wanted} prompts "
                    f"a step trains on (data.train_batch_size): the other {generated_groups - kept_groups} prompts' "
                    f"responses all scored the same {cfg.algorithm.filter_groups.metric}. The problems are too hard or "
                    "too easy for the model: raise max_num_gen_batches (0: no limit) or use data nearer its level.")
            batch, reward_extra = self.generate_and_score(next(self.batches), timer, metrics)
        batch = Batch.concat([part for part, _ in kept])[: wanted * n]
        keys = dict.fromkeys(key for _, extra in kept for key in extra)
        reward_extra = {key: [v for part, extra in kept for v in extra.get(key, [None] * len(part))][: wanted * n]
                        for key in keys}
        metrics["dynamic_sampling/generation_batches"] = float(generation_batches)
        metrics["dynamic_sampling/zero_variance_groups"] = 1.0 - kept_groups / generated_groups
        return batch, reward_extra

    def policy_filtration(self, batch: Batch, reward_extra: dict, metrics: dict) -> tuple[Batch, dict]:
        """PF-PPO: the rows the step trains on, drawn again by their scores' weights (with a
        generator seeded by the step, so a resumed run draws the same), and the reward
        function's values of each."""
        pf_ppo = self.cfg.algorithm.pf_ppo
        generator = torch.Generator().manual_seed(int(self.cfg.trainer.seed) * 1_000_003 + self.global_step)
        rows = pf_ppo_resample(batch["token_level_scores"].sum(-1), pf_ppo.reweight_method, pf_ppo.weight_pow,
                               generator)
        picked = rows.tolist()
        metrics["pf_ppo/distinct_responses"] = len(set(picked)) / len(picked)
        return batch[rows], {key: [values[i] for i in picked] if len(values) == len(batch) else values
                             for key, values in reward_extra.items()}

    def filter_values(self, batch: Batch, reward_extra: dict) -> torch.Tensor:
        """Per response, the value whose spread within a group dynamic sampling asks for."""
        metric = self.cfg.algorithm.filter_groups.metric
        if metric in FILTER_METRICS_OF_BATCH:
            return batch["token_level_scores"].sum(-1)
        values = reward_extra.get(metric)
        if values is None or len(values) != len(batch) or any(v is None for v in values):
            returned = sorted(key for key, v in reward_extra.items() if len(v) == len(batch))
            raise DynamicSamplingError(
                f"algorithm.filter_groups.metric={metric!r} is not a value the reward function returned for every "
                f"sample (it returned: {', '.join(returned)}); use one of those or "
                f"{', '.join(FILTER_METRICS_OF_BATCH)}.")
        return torch.tensor([float(v) for v in values], dtype=torch.float64)

    def add_rm_scores(self, batch: Batch) -> dict[str, float]:
        """The reward model's scores of the batch's responses (`rm_scores`), when there is one."""
        if self.reward_model is None:
            return {}
        batch.union(self.reward_model.compute_rm_score(batch))
        metrics = {"reward_model/truncated": float(batch["rm_truncated"].sum())}
        if "rm_step_mask" in batch:
            metrics["reward_model/steps_per_response"] = float(batch["rm_step_mask"].sum(-1).float().mean())
        return metrics

    def greedy_baseline(self, prompts: Batch) -> torch.Tensor:
        """ReMax: the reward of a greedy response to each prompt."""
        greedy = prompts.select()
        greedy.meta = replace(prompts.meta, sampling=Sampling.GREEDY)
        greedy = self.workers.generate_sequences(greedy)
        self.add_rm_scores(greedy)
        scores, _ = self.reward_fn(greedy)
        return scores.sum(-1)

    def shaped_rewards(self, batch: Batch) -> torch.Tensor:
        """Token rewards after `algorithm.reward_clip` / `reward_norm` (applied to each response's
        total score; the change lands on its last token)."""
        scores = batch["token_level_scores"]
        totals = scores.sum(-1)
        shaped = shape_scores(totals, batch["uid"], self.cfg.algorithm, self.reward_stats)
        if shaped is totals:
            return scores
        return _add_on_last_token(scores, batch.response_lengths(), shaped - totals)

    def reward_kl_and_rollout_correction(self, batch: Batch) -> dict[str, float]:
        """KL penalty in the reward (`algorithm.use_kl_in_reward`) and, when the trainer's own
        log-probs were recomputed, the train/inference mismatch and rollout correction."""
        cfg = self.cfg.algorithm
        metrics: dict[str, float] = {}
        if cfg.use_kl_in_reward:
            batch["token_level_rewards"], kl_metrics = apply_kl_penalty(
                batch["token_level_rewards"], batch["old_log_probs"], batch["ref_log_prob"],
                batch["response_mask"], self.kl_ctrl, cfg.kl_penalty)
            metrics.update(kl_metrics)
        if "old_log_probs" in batch and "rollout_log_probs" in batch and not self.bypass:
            old, rollout, mask = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
            metrics.update(mismatch_metrics(old, rollout, mask))
            settings = correction_settings(cfg.rollout_correction)
            if settings is not None:
                weights, batch["response_mask"], rc_metrics = compute_rollout_correction(old, rollout, mask, **settings)
                if weights is not None:
                    batch["rollout_is_weights"] = weights
                metrics.update(rc_metrics)
        return metrics

    def rollout_batch(self, prompts: Batch, step: int) -> Batch:
        """`prompts` as the rollout takes them for `step`: each tagged with a group uid (in place:
        ReMax's baseline reuses them), then repeated n times, a group's rows adjacent."""
        prompts["uid"] = [str(uuid.uuid4()) for _ in range(len(prompts))]
        prompts.meta = BatchMeta(step=step, temperature=training_temperature(self.cfg.actor_rollout_ref.rollout))
        return prompts.repeat(self.cfg.actor_rollout_ref.rollout.n, interleave=True)

    def prompt_batch(self, indices) -> Batch:
        rows = [self.train_dataset[i] for i in indices]
        return collate_prompts(rows, self.pad_token_id, self.cfg.data.max_prompt_length)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate for the whole validation set with `rollout.val_kwargs` (greedy by default)
        and report the mean score per data source."""
        cfg = self.cfg
        start = time.perf_counter()
        n = cfg.actor_rollout_ref.rollout.val_kwargs.n
        rows = [self.val_dataset[i] for i in range(len(self.val_dataset))]
        batch = collate_prompts(rows, self.pad_token_id, cfg.data.max_prompt_length)
        # No step: every validation samples with the same seeds, so its scores compare across steps.
        batch.meta = BatchMeta(temperature=cfg.actor_rollout_ref.rollout.temperature, sampling=Sampling.VALIDATE)
        batch = batch.repeat(n, interleave=True)
        if self.async_rollout:
            self.push_rollout_weights()  # validation samples from the weights just trained
        batch = self.generator.generate_sequences(batch)
        self.add_rm_scores(batch)
        scores, reward_extra = self.val_reward_fn(batch)
        batch["token_level_scores"] = scores
        sample_scores = scores.sum(-1)
        values = {**reward_extra, "reward": sample_scores.tolist()}
        if "multi_turn_tool_calls" in batch:
            values["tool_call"] = (batch["multi_turn_tool_calls"] > 0).float().tolist()
        metrics = per_source_means(batch["data_source"], values, n)
        metrics["val/score/mean"] = float(sample_scores.mean())
        metrics.update(multi_turn_metrics(batch, prefix="val/"))
        metrics["val/reward/failed_samples"] = float(self.val_reward_fn.failures)
        metrics.update(reward_source_metrics(reward_extra, self.val_reward_fn.sandbox_failures, prefix="val/"))
        metrics["timing_s/validate"] = time.perf_counter() - start
        self.print_generations(batch, sample_scores)
        if cfg.trainer.validation_data_dir:
            self.dump_generations(cfg.trainer.validation_data_dir, batch, reward_extra)
        return metrics

    def dump_generations(self, folder: str, batch: Batch, reward_extra: dict) -> None:
        """`<folder>/<step>.jsonl`, one line per response, with verl's fields: input (the prompt as
        the model saw it), output, gts (ground truth), score, step, and the reward function's
        extra values."""
        prompt_width = batch["prompts"].shape[1]
        prompt_mask = batch["attention_mask"][:, :prompt_width].bool()
        rows = len(batch)
        columns = {
            "input": [self.tokenizer.decode(batch["prompts"][i][prompt_mask[i]], skip_special_tokens=True)
                      for i in range(rows)],
            "output": [self.tokenizer.decode(batch["responses"][i][:length], skip_special_tokens=True)
                       for i, length in enumerate(batch.response_lengths().tolist())],
            "gts": [(info or {}).get("ground_truth") for info in batch["reward_model"]],
            "score": batch["token_level_scores"].sum(-1).tolist(),
            "step": [self.global_step] * rows,
        }
        columns.update({k: list(v) for k, v in reward_extra.items() if len(v) == rows and k not in columns})
        os.makedirs(os.path.expanduser(folder), exist_ok=True)
        path = os.path.join(os.path.expanduser(folder), f"{self.global_step}.jsonl")
        with open(path, "w") as f:
            for i in range(rows):
                f.write(json.dumps({k: v[i] for k, v in columns.items()}, ensure_ascii=False, default=_plain) + "\n")

    def print_generations(self, batch: Batch, scores: torch.Tensor) -> None:
        for i in range(min(self.cfg.trainer.log_val_generations, len(batch))):
            length = int(batch.response_lengths()[i])
            prompt = batch["raw_prompt"][i][-1]["content"]
            response = self.tokenizer.decode(batch["responses"][i, :length], skip_special_tokens=True)
            logger.info("[val sample %d] %r -> %r (truth %s, score %.2f)", i, prompt, response,
                        batch["reward_model"][i]["ground_truth"], float(scores[i]))
