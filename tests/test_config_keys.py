"""verl's whole config tree composes here, and each key works, has no effect, or refuses a
non-default value at start (hybrid_rl/config_keys.py)."""

from __future__ import annotations

import logging
import shutil

import pytest
from omegaconf import OmegaConf

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import (
    CONF_DIR, DEVIATIONS, NO_EFFECT, NO_EFFECT_ON_CPU, NOT_YET, WORKS, check_verl_keys, default_in, leaves, plain, rule_for,
    status_of, verl_defaults,
)
from hybrid_rl.main import compose_config

VERL_TREES = {name: leaves(OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/verl/{name}.yaml")))
              for name in ("ppo_trainer", "ppo_megatron_trainer", "legacy", "legacy_megatron")}


def override_value(value) -> str:
    """A value written as Hydra's command-line grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"


def changed(value):
    """Some value other than `value`, of a kind the key accepts."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 3
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, list):
        return [] if value else ["other"]
    if isinstance(value, dict):
        return {"other": 1}
    return "other"


class VerlDefaults:
    """verl's default for a key of `cfg`: an interpolation is resolved on one unresolved copy of
    `cfg` (a copy per key made these tests quadratic), the key put back after each lookup, so every
    key is resolved against `cfg` as it is."""

    def __init__(self, cfg):
        self.probe = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))

    def __call__(self, key: str, raw):
        if not (isinstance(raw, str) and "${" in raw):
            return raw
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(self.probe, parent_key) if parent_key else self.probe
        if parent is None:  # a whole branch verl has and we lack: resolve on a throwaway copy
            return default_in(OmegaConf.create(OmegaConf.to_container(self.probe, resolve=False)), key, raw)
        before = OmegaConf.to_container(parent, resolve=False)
        value = default_in(self.probe, key, raw)
        if leaf in before:
            parent[leaf] = before[leaf]
        else:
            del parent[leaf]
        return value


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_every_verl_key_composes_from_the_command_line_with_its_default(name):
    # ppo_megatron_trainer's file holds only what differs, on top of ppo_trainer's keys; both
    # configs also take the keys older verl releases had (legacy).
    keys = {**VERL_TREES["legacy"], **VERL_TREES["ppo_trainer"], **VERL_TREES[name]}
    if name == "ppo_megatron_trainer":
        keys.update(VERL_TREES["legacy_megatron"])
    keys = {k: v for k, v in keys.items() if v != "???"}  # verl's "required": no default to pass
    cfg = compose_config([f"{k}={override_value(v)}" for k, v in keys.items()], config_name=name)
    verl_default = VerlDefaults(cfg)
    for key, value in keys.items():
        assert plain(OmegaConf.select(cfg, key)) == verl_default(key, value), key


def test_every_key_has_verls_default_unless_the_change_is_listed():
    cfg = compose_config([])
    verl_default = VerlDefaults(cfg)
    undeclared = [k for k, raw in {**VERL_TREES["legacy"], **VERL_TREES["ppo_trainer"]}.items() if raw != "???"
                  and plain(OmegaConf.select(cfg, k)) != verl_default(k, raw) and k not in DEVIATIONS]
    assert undeclared == []
    assert [k for k in DEVIATIONS if k not in verl_defaults()] == []


def test_every_key_our_own_groups_lack_is_ruled(tmp_path):
    """A verl key that only the generated layer provides is read by nothing here, so it must say
    so (no effect) or refuse other values (not supported yet); `works` needs our own group."""
    from hydra import compose, initialize_config_dir

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    primary = conf / "ppo_trainer.yaml"
    primary.write_text("\n".join(line for line in primary.read_text().splitlines()
                                 if not line.strip().startswith("- verl/")))
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        ours = leaves(OmegaConf.to_container(compose(config_name="ppo_trainer")))
    unruled = [k for k in verl_defaults() if k not in ours and rule_for(k) is None]
    assert unruled == []
    # ... and every rule is used by some key.
    from hybrid_rl.config_keys import RULES
    import fnmatch
    unused = [r.pattern for r in RULES if not any(fnmatch.fnmatchcase(k, r.pattern) for k in verl_defaults())]
    assert unused == []


@pytest.mark.parametrize("config_name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_composing_with_files_parsed_once_gives_hydras_config(config_name):
    """compose_config reads each YAML file once per process; every compose, the first and a
    repeated one, equals Hydra's own compose of the tree with the same overrides."""
    from hydra import compose, initialize_config_dir

    from hybrid_rl.config import resolve_config
    from hybrid_rl.config_keys import additions_of_verl_keys_as_overrides

    overrides = ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.optim.lr=3e-6", "+trainer.val_before_train=False",
                 "trainer.logger=[console,jsonl]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydras = OmegaConf.to_yaml(resolve_config(compose(
            config_name=config_name, overrides=additions_of_verl_keys_as_overrides(overrides))))
    assert [OmegaConf.to_yaml(compose_config(overrides, config_name)) for _ in range(2)] == [hydras, hydras]


def test_a_config_file_changed_since_it_was_parsed_is_read_again(tmp_path, monkeypatch):
    import hybrid_rl.config_keys as config_keys

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    monkeypatch.setattr(config_keys, "CONF_DIR", conf)
    assert "saved_by_the_test" not in compose_config().data
    data = conf / "data" / "default.yaml"
    data.write_text(data.read_text() + "\nsaved_by_the_test: 1\n")
    assert compose_config().data.saved_by_the_test == 1


def with_values(cfg, values: dict):
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, force_add=False)
    return cfg


def keys_with(status: str, cfg) -> dict:
    present = leaves(OmegaConf.to_container(cfg))
    return {k: raw for k, raw in verl_defaults().items() if k in present and status_of(k)[0] == status}


def test_each_unsupported_key_refuses_any_other_value():
    base = compose_config([])
    unsupported = keys_with(NOT_YET, base)
    assert len(unsupported) > 40
    # Keys whose default copies another key are changed one at a time; the rest all at once.
    copies = {k: raw for k, raw in unsupported.items() if isinstance(raw, str) and "${" in raw}
    plain_keys = {k: raw for k, raw in unsupported.items() if k not in copies}
    errors = check_verl_keys(with_values(base, {k: changed(raw) for k, raw in plain_keys.items()}), "cpu")
    refused = {e.split("=", 1)[0] for e in errors}
    assert set(plain_keys) <= refused and refused - set(plain_keys) <= set(copies)
    assert all(" is not supported yet (" in e for e in errors)
    verl_default = VerlDefaults(base)
    for key, raw in copies.items():
        cfg = with_values(base, {key: changed(verl_default(key, raw))})
        assert [e.split("=", 1)[0] for e in check_verl_keys(cfg, "cpu")] == [key]


def test_unsupported_keys_at_verls_default_pass_and_the_run_says_why_it_stops(caplog):
    assert check_verl_keys(compose_config([]), "cpu") == []
    cfg = compose_config(["actor_rollout_ref.rollout.disaggregation.enabled=true",
                          "actor_rollout_ref.model.lora.a2a_experimental=true"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    lines = f"error: {info.value}".splitlines()
    assert lines == ["error: actor_rollout_ref.rollout.disaggregation.enabled=True is not supported yet (not built yet)",
                     "error: actor_rollout_ref.model.lora.a2a_experimental=True is not supported yet (megatron-bridge's "
                     "all-to-all expert adapters are not built)"]


def test_keys_with_no_effect_accept_any_value_and_are_reported(caplog):
    base = compose_config([])
    no_effect = keys_with(NO_EFFECT, base)
    assert len(no_effect) > 100
    verl_default = VerlDefaults(base)
    cfg = with_values(base, {k: changed(verl_default(k, raw)) for k, raw in no_effect.items()})
    with caplog.at_level(logging.INFO, logger="hybrid_rl.config_keys"):
        assert check_verl_keys(cfg, "cpu") == []
    assert "no effect here (docs/config.md): " in caplog.text and " more" in caplog.text


def test_legacy_critic_offload_has_no_effect_on_cpu_and_is_refused_on_gpu_naming_the_key_that_works():
    key = "critic.model.fsdp_config.param_offload"
    assert status_of(key)[0] == NO_EFFECT_ON_CPU
    cfg = compose_config([f"{key}=true"])
    assert check_verl_keys(cfg, "cpu") == []
    assert check_verl_keys(cfg, "cuda") == [
        f"{key}=True is not supported yet (offloading to host memory; on CPU the model is already there (on GPU, "
        "set verl 0.9's critic.fsdp.* instead))"]


@pytest.mark.parametrize("config_name, keys", [
    ("ppo_trainer", ["actor_rollout_ref.actor.fsdp_config.param_offload",
                     "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                     "actor_rollout_ref.ref.fsdp_config.param_offload", "critic.fsdp.param_offload",
                     "critic.fsdp.optimizer_offload", "critic.fsdp.offload_policy",
                     "reward_model.model.fsdp_config.param_offload"]),
    ("ppo_megatron_trainer", [f"{role}.megatron.{k}" for role in ("actor_rollout_ref.actor", "critic")
                              for k in ("param_offload", "optimizer_offload", "grad_offload")]),
])
def test_offload_is_accepted_on_both_devices(config_name, keys):
    assert {status_of(key)[0] for key in keys} == {WORKS}
    cfg = compose_config([f"{key}=true" for key in keys], config_name=config_name)
    assert check_verl_keys(cfg, "cpu") == check_verl_keys(cfg, "cuda") == []


def test_verl_critic_offload_keys_reach_the_critic_engine():
    cfg = compose_config(["critic.fsdp.param_offload=true", "critic.fsdp.offload_policy=true"])
    assert (cfg.critic.fsdp_config.param_offload, cfg.critic.fsdp_config.optimizer_offload,
            cfg.critic.fsdp_config.offload_policy) == (True, False, True)


def test_our_own_keys_work():
    assert status_of("actor_rollout_ref.actor.clip_ratio")[0] == WORKS
    assert status_of("actor_rollout_ref.rollout.engine_kwargs.vllm")[0] == WORKS


@pytest.mark.parametrize("packed", [True, False])
def test_the_critic_runs_packed_or_padded_rows(packed):
    """Both settings are built (tests/test_megatron_engine.py compares their values)."""
    cfg = compose_config([f"critic.model.use_remove_padding={packed}", "algorithm.adv_estimator=gae"])
    assert check_verl_keys(cfg, "cpu") == check_verl_keys(cfg, "cuda") == []


def test_megatron_config_composes_and_validates_with_verls_megatron_defaults():
    cfg = compose_config(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                          "trainer.n_gpus_per_node=2"], config_name="ppo_megatron_trainer")
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.actor.optim.optimizer == "adam"  # megatron's AdamW: accepted
    validated = validate_config(cfg)
    assert validated.actor_rollout_ref.actor.strategy == validated.actor_rollout_ref.ref.strategy == "megatron"
