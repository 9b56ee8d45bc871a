"""Entry point: `python -m hybrid_rl.main [dotted overrides]` (`--cfg job` prints the config).

Everything that can be checked cheaply is checked here, on the driver, before Ray or any worker
starts: the config, the model path and context window, the data files and the reward function.
"""

from __future__ import annotations

import difflib
import logging
import os
import signal
import sys

import hydra
from hydra.core.plugins import Plugins
from omegaconf import DictConfig, OmegaConf

from hybrid_rl import agent
from hybrid_rl.algorithms.distillation import TOP_K_MODE as DISTILLATION_TOP_K_MODE
from hybrid_rl.config import (PRIME_PROCESSES, PRIME_TIMEOUT_S, REF_MODEL_KEY, ConfigError, adopt_served_reward_model,
                              check_model_limits, custom_reward_function, custom_reward_manager, distillation_teachers,
                              reference_model_path, resolve_config, reward_manager_kwargs, settings_given_twice,
                              validate_config)
from hybrid_rl.config_keys import (CONF_DIR, OurConfigTree, additions_of_verl_keys_as_overrides, compose_config, leaves,
                                  verl_defaults)
from hybrid_rl.console import quiet_third_party_output
from hybrid_rl.models import ModelPathError, cache_dir, load_tokenizer, model_config, resolve_model_path

quiet_third_party_output()  # before transformers, vLLM or Ray are imported
logger = logging.getLogger("hybrid_rl")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_data_files() -> tuple[str, str]:
    """The built-in two-digit arithmetic set, written once to the cache folder."""
    from hybrid_rl.data.arithmetic import dataset_tag, write_arithmetic_dataset

    folder = cache_dir() / "data" / dataset_tag()
    train, test = folder / "train.parquet", folder / "test.parquet"
    if not (train.is_file() and test.is_file()):
        write_arithmetic_dataset(str(folder))
        logger.info("Wrote the built-in arithmetic data set to %s", folder)
    return str(train), str(test)


def prepare(cfg: DictConfig):
    """Everything the run needs before workers start; raises on bad input."""
    from hybrid_rl.config import needs_critic
    from hybrid_rl.data import RLDataset, custom_rows
    from hybrid_rl.iterative import load_step_scorer
    from hybrid_rl.rewards import RewardManager, default_compute_score, load_custom_reward_fn
    from hybrid_rl.rewards.custom import keyword_parameter
    from hybrid_rl.rewards.mixture import sources_from_config
    from hybrid_rl.user_code import import_external_libs
    from hybrid_rl.workers.reward_server import SERVED_KWARGS

    validate_config(cfg)
    import_external_libs(cfg)  # before any model config is read
    check_resume(cfg)
    key, custom = custom_reward_function(cfg)
    batched = cfg.reward_model.reward_manager == "batch"
    reward_kwargs = dict(custom.reward_kwargs)
    if batched:  # verl's batch manager passes its own keyword arguments on to the function
        manager_key, manager_kwargs = reward_manager_kwargs(cfg)
        clash = sorted(set(manager_kwargs) & set(reward_kwargs))
        if clash:
            raise ConfigError(f"{manager_key} and {key}.reward_kwargs both set {', '.join(clash)}; keep one.")
        reward_kwargs.update(manager_kwargs)
    compute_score = load_custom_reward_fn(custom.path, custom.name, reward_kwargs, key=key, provided=SERVED_KWARGS,
                                          batched=batched)
    if cfg.reward_model.enable and compute_score is not None and keyword_parameter(compute_score,
                                                                                    "reward_router_address"):
        adopt_served_reward_model(cfg)  # verl 0.7-0.8's reward loop wrote it under reward_model.*
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path)
    if needs_critic(cfg) and cfg.critic.model.path:
        resolve_model_path(cfg.critic.model.path, key="critic.model.path")
    reward_model_config = None
    if cfg.reward_model.enable:
        _, config = check_reward_model(cfg.reward_model, "reward_model.model.path")
        if cfg.reward_model.strategy == "megatron":  # its layout is checked with the other Megatron roles'
            reward_model_config = config
    ref_path = reference_model_path(cfg)
    if ref_path is not None:
        ref_path = resolve_model_path(ref_path, key=REF_MODEL_KEY)
    teachers = distillation_teachers(cfg) or []
    teacher_paths = [(teacher.path_key, resolve_model_path(teacher.path, key=teacher.path_key)) for teacher in teachers]
    check_model_limits(cfg, model_path, reward_model_config, ref_path, teacher_paths)
    tokenizer = load_checked_tokenizer(cfg, model_path)
    if ref_path is not None:
        check_reference_vocabulary(cfg, tokenizer, model_path, ref_path)
    for path_key, path in teacher_paths:
        check_teacher_vocabulary(cfg, tokenizer, model_path, path, path_key)

    train_files, val_files = cfg.data.train_files, cfg.data.val_files
    if train_files is None:
        train_files, default_val = default_data_files()
        val_files = val_files or default_val
    data_kwargs = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                       truncation=cfg.data.truncation, filter_overlong_prompts=cfg.data.filter_overlong_prompts,
                       seed=cfg.data.seed, apply_chat_template_kwargs=cfg.data.apply_chat_template_kwargs)
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        # The tools are built once here so a bad tool config stops the run before any worker starts.
        tools = agent.setup(cfg.actor_rollout_ref.rollout, tokenizer, cfg.data.apply_chat_template_kwargs)
        tools.close()
        data_kwargs.update(apply_chat_template_kwargs=tools.chat_template_kwargs, system_prompt=tools.system_prompt)

    def load_dataset(files, max_samples: int) -> RLDataset:
        # verl's data.custom_cls: a user's dataset class gives the rows.
        rows = custom_rows(cfg.data, files, tokenizer, max_samples) if cfg.data.custom_cls.path else None
        return RLDataset(files, tokenizer, max_samples=max_samples, rows=rows, **data_kwargs)

    train_dataset = load_dataset(train_files, cfg.data.train_max_samples)
    val_dataset = load_dataset(val_files, cfg.data.val_max_samples) if val_files else None
    rollout = cfg.actor_rollout_ref.rollout
    custom_loops = ()
    if rollout.agent.agent_loop_config_path is not None:  # imported here too, so a bad file stops the run now
        from hybrid_rl.agent.verl_agent_loops import load_agent_loops

        custom_loops = tuple(load_agent_loops(rollout.agent.agent_loop_config_path))
    for files, dataset in ((train_files, train_dataset), (val_files, val_dataset)):
        if dataset is None:
            continue
        agent.check_agent_names(dataset.agent_names(), rollout, custom_loops, files)
        if rollout.multi_turn.enable and tools.interactions:  # each tool-loop row names one, or there is one
            names = agent.row_agent_names(dataset.agent_names(), rollout)
            agent.check_interaction_rows([info for info, name in zip(dataset.extra_infos(), names)
                                          if name == agent.TOOL_AGENT], tools.interactions, files)

    sources = sources_from_config(cfg.reward, ConfigError, reward_model=cfg.reward_model.enable,
                                  process=cfg.reward_model.process.enable, provided=SERVED_KWARGS)
    check_served_reward_model_callers(cfg, [compute_score] + [s.fn for s in sources or []])
    if cfg.algorithm.adv_estimator == "gdpo" and cfg.algorithm.gdpo_reward_keys is None:
        # The config check let this through with two or more reward.funcs: their scores are the components.
        cfg.algorithm.gdpo_reward_keys = [f"reward/{source.name}" for source in sources]
        if cfg.algorithm.gdpo_reward_weights is None:
            cfg.algorithm.gdpo_reward_weights = [source.weight for source in sources]
    if cfg.reward_model.enable and not cfg.reward.funcs and compute_score is not None:
        logger.warning("reward_model.enable=true and %s.path=%s: the reward model alone scores the responses, as in "
                       "verl. To add the function, set reward.funcs=[reward_model,'%s:%s'].", key, custom.path,
                       custom.path, custom.name)
        compute_score = None
    if sources is not None and compute_score is not None:
        raise ConfigError(f"both reward.funcs and {key}.path are set; list the function in reward.funcs "
                          f"(as '{custom.path}:{custom.name}') and leave {key}.path unset.")
    check_teacher_rows(cfg, train_dataset, teachers, "data.train_files")
    if len(train_dataset) < cfg.data.train_batch_size:
        raise ConfigError(
            f"data.train_files has {len(train_dataset)} usable prompts, fewer than data.train_batch_size="
            f"{cfg.data.train_batch_size}, so there is not a single full training batch. Lower "
            f"data.train_batch_size to at most {len(train_dataset)} or add data.")
    labels_by_rule = cfg.trainer.iterative.enable and cfg.reward_model.enable  # hybrid_rl/iterative.py
    if labels_by_rule or (compute_score is None and (sources is None or
                                                    any(s.fn is default_compute_score for s in sources))):
        check_builtin_data_sources(train_dataset, "data.train_files")
        if val_dataset is not None:
            check_builtin_data_sources(val_dataset, "data.val_files")
    load_step_scorer(cfg)  # a missing or broken step scorer stops the run here
    # verl's prime and remote managers: the calls in worker processes (prime's with its 300-s limit).
    manager = cfg.reward_model.reward_manager
    processes = {"prime": min(PRIME_PROCESSES, os.cpu_count() or 1),
                 "remote": OmegaConf.select(cfg, "reward.num_workers")}.get(manager, 0)
    timeout_s = cfg.reward_model.timeout_s
    if manager == "prime" and timeout_s is None:
        timeout_s = PRIME_TIMEOUT_S
    faults = dict(on_error=cfg.reward_model.on_error, timeout_s=timeout_s, sources=sources, processes=processes,
                  extra_info_fields=({"experiment_name": cfg.trainer.experiment_name}
                                     if cfg.reward_model.reward_manager == "gdpo" else None), batched=batched)
    reward_fn = RewardManager(tokenizer, compute_score, cfg.data.reward_fn_key, cfg.reward_model.num_examine, **faults,
                              manager=users_reward_manager(cfg, tokenizer, compute_score, cfg.reward_model.num_examine))
    val_reward_fn = RewardManager(tokenizer, compute_score, cfg.data.reward_fn_key, 0, **faults,
                                  manager=users_reward_manager(cfg, tokenizer, compute_score, 0))
    return model_path, tokenizer, train_dataset, val_dataset, reward_fn, val_reward_fn


def users_reward_manager(cfg: DictConfig, tokenizer, compute_score, num_examine: int):
    """verl's `reward_manager.source=importlib`: the user's reward manager class, built as verl
    builds it (its interface decides how: rewards/custom_manager.py); None without one."""
    from hybrid_rl.rewards import default_compute_score
    from hybrid_rl.rewards.custom_manager import RewardManagerBase, load_reward_manager_class

    found = custom_reward_manager(cfg)
    if found is None:
        return None
    prefix, path, name = found
    cls = load_reward_manager_class(path, name, prefix)
    compute_score = compute_score or default_compute_score
    try:
        if issubclass(cls, RewardManagerBase):
            return cls(config=cfg, tokenizer=tokenizer, compute_score=compute_score, reward_router_address=None,
                       reward_model_tokenizer=None)
        _, kwargs = reward_manager_kwargs(cfg)
        return cls(tokenizer=tokenizer, num_examine=num_examine, compute_score=compute_score,
                   reward_fn_key=cfg.data.reward_fn_key, **kwargs)
    except Exception as exc:  # re-raised with the settings to fix
        raise ConfigError(f"{prefix}.name={name} ({path}): building it as verl does failed with {type(exc).__name__}: "
                          f"{exc}") from exc


def check_served_reward_model_callers(cfg: DictConfig, functions: list) -> None:
    """A served reward model (`reward.reward_model`) needs a reward function to call it, and a
    function that needs one needs it served."""
    from hybrid_rl.rewards import default_compute_score
    from hybrid_rl.rewards.custom import keyword_parameter

    functions = [fn for fn in functions if fn is not None and fn is not default_compute_score]
    callers = [fn for fn in functions if keyword_parameter(fn, "reward_router_address") == "required"]
    if not cfg.reward.reward_model.enable:
        if callers:
            raise ConfigError(f"reward function {getattr(callers[0], '__name__', callers[0])} takes "
                              "reward_router_address: it calls a served reward model (verl's generative reward "
                              "models). Set reward.reward_model.enable=true and reward.reward_model.model_path=<model "
                              "folder> to start one.")
        return
    resolve_model_path(cfg.reward.reward_model.model_path, key="reward.reward_model.model_path")
    if not functions:
        raise ConfigError(
            "reward.reward_model.enable=true serves a model for your reward function to call, but no function is "
            "set: set reward.custom_reward_function.path to a file whose function takes reward_router_address (and "
            "reward_model_tokenizer) and posts to http://<address>/v1/chat/completions (docs/rewards.md). A sequence "
            "classifier that scores by itself is reward_model.enable=true reward_model.model.path=<folder>.")


def check_reward_model(rm_cfg: DictConfig, key: str):
    """(folder, transformers config) of the reward model: a sequence classifier with one label, or with
    `reward_model.process.enable` a token classifier with one or two labels (a causal LM with
    `process.step_tag`)."""
    from transformers import AutoConfig

    process = bool(rm_cfg.process.enable)
    step_tag = process and rm_cfg.process.step_tag is not None
    kind = "causal LM (step-tag scorer)" if step_tag else "token-classification" if process else "sequence-classification"
    if not rm_cfg.model.path:
        raise ConfigError(f"reward_model.enable=true needs {key}: a {kind} model folder"
                          + ("." if process else " (train one from a policy with python tools/train_reward_model.py)."))
    path = resolve_model_path(rm_cfg.model.path, key=key)
    config = AutoConfig.from_pretrained(path, trust_remote_code=rm_cfg.model.trust_remote_code)
    architectures = list(getattr(config, "architectures", None) or [])
    held = f"{key}={rm_cfg.model.path} holds {', '.join(architectures) or 'a model without architectures'} (config.json)"

    def require(suffix: str, message: str) -> None:
        if not any(name.endswith(suffix) for name in architectures):
            raise ModelPathError(f"{held}, {message}")

    if step_tag:
        require("ForCausalLM", "not a causal LM. With reward_model.process.step_tag set the reward model is a step-tag "
                "scorer that reads next-token logits at each tag (AutoModelForCausalLM); for a token classifier set "
                "reward_model.process.step_tag=null.")
        return path, config
    if process:
        require("ForTokenClassification", "not a token classifier. With reward_model.process.enable=true the reward "
                "model scores every step, so it must be an AutoModelForTokenClassification (one label: its score; "
                "two: the probability of label 1); for an outcome reward model set reward_model.process.enable=false.")
        if config.num_labels not in (1, 2):
            raise ModelPathError(f"{key}={rm_cfg.model.path} has {config.num_labels} labels; a process reward model "
                                 "has one (a score) or two (bad, good: the score is P(good)).")
        return path, config
    require("ForSequenceClassification", "not a sequence classifier. A reward model is an "
            "AutoModelForSequenceClassification with one label; train one from a policy with python "
            "tools/train_reward_model.py" + (" (a token classifier scores steps: reward_model.process.enable=true)."
                                             if any(name.endswith("ForTokenClassification") for name in architectures)
                                             else "."))
    if config.num_labels != 1:
        raise ModelPathError(f"{key}={rm_cfg.model.path} has {config.num_labels} labels; a reward model gives one "
                             "score per response (num_labels=1).")
    return path, config


def check_resume(cfg: DictConfig) -> None:
    """Resolve trainer.resume_mode / resume_from_path now, before models and data are loaded."""
    from hybrid_rl.checkpoint import CheckpointError, CheckpointManager

    trainer = cfg.trainer
    checkpoints = CheckpointManager(trainer.default_local_dir)
    path = trainer.resume_from_path
    if trainer.resume_mode == "resume_path" and path and not os.path.isdir(os.path.expanduser(path)):
        complete = [str(p) for p in checkpoints.completed()] if checkpoints.root.is_dir() else []
        raise CheckpointError(
            f"trainer.resume_from_path={path} does not exist. Point it at a global_step_<N> folder of an "
            f"earlier run (complete ones under trainer.default_local_dir: {complete or 'none'}), or set "
            "trainer.resume_mode=auto (latest checkpoint, if any) or disable (start fresh).")
    checkpoints.resume_folder(trainer.resume_mode, path)


def load_checked_tokenizer(cfg: DictConfig, model_path: str):
    """load_tokenizer, with a missing or unreadable tokenizer reported as a bad model path."""
    from pathlib import Path

    source = cfg.actor_rollout_ref.model.tokenizer_path or model_path
    key = ("actor_rollout_ref.model.tokenizer_path" if cfg.actor_rollout_ref.model.tokenizer_path
           else "actor_rollout_ref.model.path")
    folder = Path(os.path.expanduser(source))
    if not folder.exists() and source.startswith(("/", ".", "~")):
        raise ModelPathError(f"{key}={source!r} does not exist; point it at the model's tokenizer folder "
                             "(or leave actor_rollout_ref.model.tokenizer_path null to use the model folder).")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if folder.is_dir() and not any((folder / name).is_file() for name in tokenizer_files):
        raise ModelPathError(
            f"{key}={source!r} has no tokenizer files ({', '.join(tokenizer_files)}). Copy the model's "
            "tokenizer into that folder, or set actor_rollout_ref.model.tokenizer_path to a folder that has it.")
    try:
        return load_tokenizer(cfg, model_path)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = reason if len(reason) <= 200 else reason[:200] + "..."
        raise ModelPathError(
            f"Cannot load a tokenizer from {key}={source!r} ({type(exc).__name__}: {reason}). Point "
            f"{key} at a folder with the tokenizer files (tokenizer.json / tokenizer_config.json) of "
            "this model.") from exc


def check_vocabulary(cfg: DictConfig, tokenizer, model_path: str, other_path: str, key: str,
                     whole: tuple[str, str] | None = None) -> None:
    """A model that scores the actor's token ids (a reference model of its own, a distillation
    teacher) must have the actor's tokenizer (when its folder has one) and an embedding that holds
    every id. `whole`: the setting that compares whole next-token distributions (and what to use
    instead), which needs the same vocabulary size too."""
    from transformers import AutoTokenizer

    try:
        other_tokenizer = AutoTokenizer.from_pretrained(other_path)
    except (OSError, ValueError):
        other_tokenizer = None  # a folder of weights only: the ids are checked against its embedding below
    if other_tokenizer is not None and other_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ModelPathError(f"{key}={other_path}: its tokenizer's vocabulary differs from the actor's, so the same "
                             "token ids would be different text to it. Use a model of the same tokenizer family "
                             "(e.g. a larger model of the actor's series).")
    other_vocab = model_config(other_path, cfg.actor_rollout_ref.model).vocab_size
    if other_vocab < len(tokenizer):
        raise ModelPathError(f"{key}={other_path}: its embedding has {other_vocab} rows, fewer than the actor's "
                             f"tokenizer's {len(tokenizer)} tokens.")
    actor_vocab = model_config(model_path, cfg.actor_rollout_ref.model).vocab_size
    if whole is not None and other_vocab != actor_vocab:
        setting, instead = whole
        raise ConfigError(f"{setting} compares whole next-token distributions, but {key}'s model has {other_vocab} "
                          f"vocabulary rows and the actor's {actor_vocab}: {instead}")


def check_reference_vocabulary(cfg: DictConfig, tokenizer, model_path: str, ref_path: str) -> None:
    actor = cfg.actor_rollout_ref.actor
    check_vocabulary(cfg, tokenizer, model_path, ref_path, REF_MODEL_KEY, whole=(
        "actor_rollout_ref.actor.kl_loss_type=full", "use kl_loss_type=low_var_kl (k3), kl (k1) or mse (k2), which "
        "read the sampled tokens only.") if actor.use_kl_loss and actor.kl_loss_type == "full" else None)


def check_teacher_vocabulary(cfg: DictConfig, tokenizer, model_path: str, teacher_path: str, key: str) -> None:
    top_k = cfg.distillation.distillation_loss.loss_mode == DISTILLATION_TOP_K_MODE
    check_vocabulary(cfg, tokenizer, model_path, teacher_path, key, whole=(
        f"distillation.distillation_loss.loss_mode={DISTILLATION_TOP_K_MODE}", "use loss_mode=k3 (or another "
        "estimator on the sampled tokens).") if top_k else None)


def check_teacher_rows(cfg: DictConfig, dataset, teachers, key: str) -> None:
    """With several distillation teachers routed by data_source, every row's must have one."""
    if len(teachers) < 2 or cfg.distillation.teacher_key != "data_source":
        return
    known = {teacher.key for teacher in teachers}
    unknown = sorted({str(source) for source in dataset.data_sources()} - known)
    if unknown:
        raise ConfigError(f"{key} has rows whose data_source ({', '.join(map(repr, unknown[:5]))}) no distillation "
                          f"teacher's key names (the teachers': {', '.join(map(repr, sorted(known)))}). Add a "
                          "teacher with that key, or route by another field (distillation.teacher_key).")


def check_builtin_data_sources(dataset, key: str) -> None:
    """Without custom_reward_function.path every row's data_source needs a built-in scorer."""
    from collections import Counter

    from hybrid_rl.rewards import KNOWN_DATA_SOURCES, builtin_scorer

    unknown = Counter(str(s) for s in dataset.data_sources() if builtin_scorer(s) is None)
    if unknown:
        found = ", ".join(f"{name!r} ({count} rows)" for name, count in unknown.most_common(5))
        raise ConfigError(
            f"{key} has rows whose data_source no built-in reward function scores: {found}. Known "
            f"data sources: {', '.join(KNOWN_DATA_SOURCES)}. Set custom_reward_function.path=/file.py "
            "(and custom_reward_function.name) to score them, or fix the data_source column.")


def build_trainer(cfg: DictConfig):
    """Check all input, start Ray (or join a cluster) and the worker group; returns the trainer."""
    trainer = checked_trainer(cfg)
    start_ray(cfg)
    trainer.init_workers()
    return trainer


def checked_trainer(cfg: DictConfig):
    """The trainer, with every input checked; nothing started yet."""
    from hybrid_rl.trainer import Trainer

    try:
        model_path, tokenizer, train_dataset, val_dataset, reward_fn, val_reward_fn = prepare(cfg)
        trainer = Trainer(cfg, model_path, tokenizer, train_dataset, val_dataset, reward_fn, val_reward_fn)
    except (ConfigError, ModelPathError, FileNotFoundError, ValueError, TypeError) as exc:
        raise SetupError(str(exc)) from exc
    logger.info("Model %s, %d training prompts, %d validation prompts, device %s", model_path,
                len(train_dataset), len(val_dataset) if val_dataset else 0, cfg.trainer.device)
    return trainer


def start_ray(cfg: DictConfig) -> None:
    from hybrid_rl.controller import init_ray

    # Workers must import hybrid_rl even when it runs from a source checkout, and the user's
    # modules (agent loops, tools) as the driver does, from the working directory; inside a Ray job
    # (`ray job submit`) the job's runtime env (its working_dir) already brings them.
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    ray_init = cfg.ray_kwargs.ray_init
    in_ray_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    runtime_env = {} if in_ray_job else {"env_vars": {"PYTHONPATH": pythonpath}}
    if ray_init.runtime_env.py_executable:
        runtime_env["py_executable"] = ray_init.runtime_env.py_executable
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    try:
        init_ray(address=cfg.trainer.ray_address, num_cpus=ray_init.num_cpus, runtime_env=runtime_env)
    except (ConnectionError, RuntimeError) as exc:
        if not address:
            raise
        raise SetupError(
            f"cannot join the Ray cluster at {address} ({join_failure(exc)}). Check that its head is up (`ray status "
            f"--address {address}` on a node of the cluster) and the address is right (trainer.ray_address or "
            "RAY_ADDRESS). A cluster with token authentication also needs RAY_AUTH_MODE=token and its token "
            "here (~/.ray/auth_token or RAY_AUTH_TOKEN): docs/cluster.md.") from exc


def join_failure(exc: BaseException) -> str:
    """The telling sentence of Ray's many-line, chained connection error: an authentication
    failure if there is one, else the first line."""
    lines, err = [], exc
    while err is not None:
        lines += str(err).splitlines()
        err = err.__cause__ or err.__context__
    line = next((line for line in lines if "InvalidAuthToken" in line), lines[0] if lines else type(exc).__name__)
    return line.split(". ")[0]


class GracefulStop:
    """SIGINT (Ctrl-C) and SIGTERM (`kill`, SLURM's `scancel`): the first one lets the training
    step in progress finish, saves a checkpoint when checkpointing is on and ends the run; before
    the training loop, or at a second signal, the run is abandoned at once. Either way the
    workers and Ray are shut down and the exit code is 128 + the first signal's number."""

    def __init__(self) -> None:
        self.trainer = None  # set while the training loop runs
        self.signum: int | None = None

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        name = signal.Signals(signum).name
        if first and self.trainer is not None:
            self.trainer.request_stop(name)
            print(f"\n{name}: stopping after the current step (a checkpoint is saved when trainer.save_freq > 0). "
                  "Press Ctrl-C again to stop at once.", file=sys.stderr, flush=True)
            return
        raise KeyboardInterrupt(name)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


def run(cfg: DictConfig, stop: GracefulStop):
    """Train; after a worker failure, restart the workers from the last checkpoint up to
    `trainer.max_restarts` times. Returns the run's `RunSummary`."""
    from hybrid_rl.controller import PlacementError, WorkerError
    from hybrid_rl.trainer import WorkerFailure, out_of_memory_advice

    trainer = checked_trainer(cfg)
    restarts = 0
    try:
        start_ray(cfg)
        stop.install()  # again: Ray's driver replaces the SIGTERM handler with one that aborts
        try:
            trainer.init_workers()
        except WorkerError as exc:
            advice = f". {out_of_memory_advice(cfg)}" if exc.out_of_memory else ""
            raise SetupError(f"the workers failed to start: {str(exc).splitlines()[0]}{advice}") from exc
        except PlacementError as exc:
            raise SetupError(str(exc)) from exc
        stop.trainer = trainer
        while True:
            try:
                return trainer.fit()
            except WorkerFailure as exc:
                if restarts >= cfg.trainer.max_restarts or trainer.stop_requested:
                    raise
                restarts += 1
                logger.error("%s. Restarting the workers (%d of trainer.max_restarts=%d) from the last "
                             "checkpoint.", exc, restarts, cfg.trainer.max_restarts)
                stop.trainer = None
                trainer.restart_workers()
                stop.trainer = trainer
    finally:
        stop.trainer = None
        trainer.shutdown()
        write_ray_timeline(cfg.ray_kwargs.timeline_json_file)


def write_ray_timeline(path: str | None) -> None:
    """Ray's task timeline of the run (chrome://tracing format), when `ray_kwargs.timeline_json_file` asks."""
    import ray

    if path and ray.is_initialized():
        ray.timeline(filename=os.path.expanduser(path))
        logger.info("Wrote Ray's timeline to %s", path)


class SetupError(RuntimeError):
    """Bad input found before any worker started."""


@hydra.main(config_path=str(CONF_DIR), config_name="ppo_trainer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    resolve_config(cfg)
    from hybrid_rl.checkpoint import CheckpointCallbackError, CheckpointMirrorError
    from hybrid_rl.trainer import DynamicSamplingError, WorkerFailure

    stop = GracefulStop()
    stop.install()
    try:
        summary = run(cfg, stop)
        print("\n".join(summary.lines()), flush=True)
        if summary.stopped_by:
            sys.exit(stop.exit_code)
    except SetupError as exc:
        # One clear line, no traceback to decode.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except WorkerFailure as exc:
        print(f"error: {exc}. The last checkpoint is intact; rerun the same command to resume "
              "(or set trainer.max_restarts to restart automatically).", file=sys.stderr)
        sys.exit(1)
    except DynamicSamplingError as exc:
        print(f"error: {exc} Complete checkpoints are intact.", file=sys.stderr)
        sys.exit(1)
    except (CheckpointCallbackError, CheckpointMirrorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"Stopped by {signal.Signals(stop.exit_code - 128).name}; no checkpoint was written for the "
              "step in progress (complete checkpoints are intact).", file=sys.stderr)
        sys.exit(stop.exit_code)
    finally:
        shutdown_ray()


def shutdown_ray() -> None:
    """Stop the local Ray instance this driver started (and its workers), or leave a cluster."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def split_command_line(argv: list[str]) -> tuple[str | None, str, list[str]]:
    """(--config-path or --config-dir, --config-name, overrides) of a Hydra command line."""
    config_path, config_name, overrides = None, "ppo_trainer", []
    args = iter(argv)
    for arg in args:
        flag, _, value = arg.partition("=")
        if flag in ("--config-path", "-cp", "--config-dir", "-cd"):
            config_path = value or next(args, "")
        elif flag in ("--config-name", "-cn"):
            config_name = (value or next(args, "")).removesuffix(".yaml")
        elif not arg.startswith("-"):
            overrides.append(arg)
    return config_path, config_name, overrides


def unknown_override_keys(argv: list[str]) -> list[str]:
    """Errors for command-line overrides of keys the config lacks, each with the nearest real key
    (Hydra itself only says "Could not override"). Keys verl knows are taken without composing."""
    config_path, config_name, overrides = split_command_line(argv)
    if config_path is not None:
        return []  # another config tree: Hydra's own check applies
    keys = [o.partition("=")[0] for o in overrides if "=" in o and not o.startswith(("+", "~", "hydra."))]
    keys = [k for k in keys if k not in verl_defaults()]
    if not keys:
        return []
    try:
        cfg = compose_config([], config_name)
    except Exception:  # a bad --config-name: Hydra reports it
        return []
    absent = object()
    known = sorted({k.rsplit(".", i)[0] for k in leaves(OmegaConf.to_container(cfg)) for i in range(k.count(".") + 1)})
    errors = []
    for key in keys:
        if OmegaConf.select(cfg, key, default=absent, throw_on_resolution_failure=False) is absent:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else "docs/config.md lists every key."
            errors.append(f"{key} is not a config key; {hint} (A key of your own needs a leading +.)")
    return errors


def cli() -> None:
    """`python -m hybrid_rl.main` and the `hybrid-rl-train` command."""
    sys.argv[1:] = additions_of_verl_keys_as_overrides(sys.argv[1:])
    Plugins.instance().register(OurConfigTree)
    if errors := unknown_override_keys(sys.argv[1:]) + settings_given_twice(
            o.partition("=")[0].lstrip("+") for o in split_command_line(sys.argv[1:])[2]):
        print("\n".join(f"error: {e}" for e in errors), file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
