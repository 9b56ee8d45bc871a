"""Entry point: `python -m hybrid_rl.main [dotted overrides]` (`--cfg job` prints the config).

Everything that can be checked cheaply is checked here, on the driver, before Ray or any worker
starts: the config, the model path and context window, the data files and the reward function.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from hybrid_rl.config import ConfigError, check_model_limits, validate_config
from hybrid_rl.models import ModelPathError, cache_dir, resolve_model_path

logger = logging.getLogger("hybrid_rl")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF_DIR = os.path.join(REPO_ROOT, "conf")


def compose_config(overrides=()) -> DictConfig:
    """The resolved config for these dotted overrides, as the command line would build it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="ppo_trainer", overrides=list(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def default_data_files() -> tuple[str, str]:
    """The built-in two-digit arithmetic set, written once to the cache folder."""
    from hybrid_rl.data.arithmetic import dataset_tag, write_arithmetic_dataset

    folder = cache_dir() / "data" / dataset_tag()
    train, test = folder / "train.parquet", folder / "test.parquet"
    if not (train.is_file() and test.is_file()):
        write_arithmetic_dataset(str(folder))
        logger.info("Wrote the built-in arithmetic data set to %s", folder)
    return str(train), str(test)


def load_tokenizer(cfg: DictConfig, model_path: str):
    from transformers import AutoTokenizer

    model_cfg = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer_path or model_path,
                                              trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.custom_chat_template:
        tokenizer.chat_template = model_cfg.custom_chat_template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prepare(cfg: DictConfig):
    """Everything the run needs before workers start; raises on bad input."""
    from hybrid_rl.data import RLDataset
    from hybrid_rl.rewards import RewardManager, load_custom_reward_fn

    validate_config(cfg)
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path)
    check_model_limits(cfg, model_path)
    tokenizer = load_tokenizer(cfg, model_path)

    train_files, val_files = cfg.data.train_files, cfg.data.val_files
    if train_files is None:
        train_files, default_val = default_data_files()
        val_files = val_files or default_val
    data_kwargs = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                       truncation=cfg.data.truncation, filter_overlong_prompts=cfg.data.filter_overlong_prompts,
                       seed=cfg.data.seed, apply_chat_template_kwargs=cfg.data.apply_chat_template_kwargs)
    train_dataset = RLDataset(train_files, tokenizer, max_samples=cfg.data.train_max_samples, **data_kwargs)
    val_dataset = (RLDataset(val_files, tokenizer, max_samples=cfg.data.val_max_samples, **data_kwargs)
                   if val_files else None)

    custom = cfg.custom_reward_function
    compute_score = load_custom_reward_fn(custom.path, custom.name, custom.reward_kwargs)
    reward_fn = RewardManager(tokenizer, compute_score, cfg.data.reward_fn_key, cfg.reward_model.num_examine)
    val_reward_fn = RewardManager(tokenizer, compute_score, cfg.data.reward_fn_key, 0)
    return model_path, tokenizer, train_dataset, val_dataset, reward_fn, val_reward_fn


def build_trainer(cfg: DictConfig):
    """Check all input, start Ray (or join a cluster) and the worker group; returns the trainer."""
    from hybrid_rl.controller import init_ray
    from hybrid_rl.trainer import Trainer

    try:
        model_path, tokenizer, train_dataset, val_dataset, reward_fn, val_reward_fn = prepare(cfg)
        trainer = Trainer(cfg, model_path, tokenizer, train_dataset, val_dataset, reward_fn, val_reward_fn)
    except (ConfigError, ModelPathError, FileNotFoundError, ValueError, TypeError) as exc:
        raise SetupError(str(exc)) from exc
    logger.info("Model %s, %d training prompts, %d validation prompts, device %s", model_path,
                len(train_dataset), len(val_dataset) if val_dataset else 0, cfg.trainer.device)
    # Workers must import hybrid_rl even when it runs from a source checkout.
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    init_ray(address=cfg.trainer.ray_address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    trainer.init_workers()
    return trainer


def run(cfg: DictConfig) -> dict[str, float]:
    return build_trainer(cfg).fit()


class SetupError(RuntimeError):
    """Bad input found before any worker started."""


@hydra.main(config_path="../conf", config_name="ppo_trainer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    OmegaConf.resolve(cfg)
    try:
        run(cfg)
    except SetupError as exc:
        # One clear line, no traceback to decode.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
