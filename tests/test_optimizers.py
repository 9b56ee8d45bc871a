"""verl's optimizer keys on the FSDP engine: `optim.optimizer` from `optim.optimizer_impl` with
verl's arguments, its state through a checkpoint, and the refusals at start."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.engines import optimizers
from hybrid_rl.main import compose_config
from tests.engine_helpers import actor_config, make_engine, step, weights

OPTIM = "actor_rollout_ref.actor.optim"
SGD = [f"{OPTIM}.optimizer=SGD", f"+{OPTIM}.override_optimizer_config.momentum=0.9"]


def optim(**keys):
    return OmegaConf.create({"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.01, "optimizer_impl": "torch.optim",
                             **keys})


def test_the_arguments_are_verls():
    """lr and weight_decay for every class, betas for Adam-like names only, fused for torch's Adam
    and AdamW unless the override asks for foreach; a decay of 0 is left out for a class without it."""
    adamw = optimizers.optimizer_arguments("o", optim(optimizer="AdamW"), torch.optim.AdamW)
    assert adamw == {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.99), "fused": True}
    sgd = optim(optimizer="SGD", override_optimizer_config={"momentum": 0.5, "nesterov": True})
    assert optimizers.optimizer_arguments("o", sgd, torch.optim.SGD) == {
        "lr": 1e-3, "weight_decay": 0.01, "momentum": 0.5, "nesterov": True}
    foreach = optim(optimizer="Adam", override_optimizer_config={"foreach": True})
    assert "fused" not in optimizers.optimizer_arguments("o", foreach, torch.optim.Adam)
    assert optimizers.optimizer_arguments("o", optim(optimizer="Rprop", weight_decay=0.0), torch.optim.Rprop) == {
        "lr": 1e-3}
    built = optimizers.build("o", sgd, list(torch.nn.Linear(2, 2).parameters()))
    assert type(built) is torch.optim.SGD and built.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("keys, fragments", [
    ({"optimizer_impl": "no_such_optimizers", "optimizer": "AdamW"},
     ["o.optimizer_impl=no_such_optimizers cannot be imported", "torch.optim"]),
    ({"optimizer": "AdamW9000"}, ["o.optimizer=AdamW9000 is not an optimizer class of torch.optim", "SGD"]),
    ({"optimizer": "lr_scheduler"}, ["o.optimizer=lr_scheduler is not an optimizer class"]),
    ({"optimizer": "SGD", "override_optimizer_config": {"eps": 1e-6}},
     ["torch.optim.SGD does not take eps (from o.override_optimizer_config)", "momentum"]),
    ({"optimizer": "Rprop"}, ["torch.optim.Rprop does not take weight_decay (from o.weight_decay)", "etas"]),
    ({"optimizer": "SGD", "override_optimizer_config": 3}, ["o.override_optimizer_config=3 must be a mapping"]),
])
def test_bad_optimizer_settings_name_the_key(keys, fragments):
    with pytest.raises(ValueError) as error:
        cfg = optim(**keys)
        optimizers.optimizer_arguments("o", cfg, optimizers.optimizer_class("o", cfg))
    assert all(fragment in str(error.value) for fragment in fragments), str(error.value)


@pytest.mark.parametrize("overrides, fragments", [
    ([f"{OPTIM}.optimizer=Adamw"], [f"{OPTIM}.optimizer=Adamw is not an optimizer class of torch.optim", "AdamW"]),
    (["critic.optim.optimizer=SGD", "+critic.optim.override_optimizer_config.betas=[0.9,0.9]"],
     ["torch.optim.SGD does not take betas (from critic.optim.override_optimizer_config)"]),
])
def test_the_run_stops_at_start(overrides, fragments):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(overrides))
    assert all(fragment in str(error.value) for fragment in fragments), str(error.value)


def test_megatron_runs_its_adam_only():
    validate_config(compose_config([f"{OPTIM}.optimizer=adam"], config_name="ppo_megatron_trainer"))
    with pytest.raises(ConfigError, match="optimizer=sgd: the Megatron engine runs megatron's adam"):
        validate_config(compose_config([f"{OPTIM}.optimizer=sgd"], config_name="ppo_megatron_trainer"))


def test_sgd_with_momentum_updates_the_engine_and_resumes_exactly(tiny_model_dir, tmp_path):
    """Each step moves a weight by lr x SGD's momentum buffer; the buffer goes through the
    checkpoint (without it the resumed step would differ), and is left out of a load that leaves
    out the optimizer (checkpoint.load_contents)."""
    cfg = actor_config("fsdp2", extra=SGD)
    engine = make_engine(cfg, tiny_model_dir)
    assert type(engine.optimizer) is torch.optim.SGD
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    step(engine, cfg, 1)
    buffers = [engine.optimizer.state[p]["momentum_buffer"] for p in params]
    assert min(b.abs().max() for b in buffers) > 1e-4  # moves far beyond the tolerance below
    for p, old, buffer in zip(params, before, buffers):
        torch.testing.assert_close(p.detach(), old - 1e-3 * buffer, rtol=0, atol=1e-8)  # float32 rounding

    engine.save_checkpoint(str(tmp_path))
    resumed = make_engine(cfg, tiny_model_dir)
    resumed.load_checkpoint(str(tmp_path))
    expected, got = step(engine, cfg, 2), step(resumed, cfg, 2)
    assert got == expected
    a, b = weights(engine), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    fresh = make_engine(cfg, tiny_model_dir)  # the same weights, no momentum: another step
    fresh.load_checkpoint(str(tmp_path))
    fresh.optimizer.state.clear()
    step(fresh, cfg, 2)
    assert any(not torch.equal(a[k], v) for k, v in weights(fresh).items())

    # checkpoint.load_contents without optimizer: the saved weights and schedule, no momentum.
    weights_only = make_engine(cfg, tiny_model_dir)
    weights_only.load_checkpoint(str(tmp_path), parts=("model", "extra"))
    assert not weights_only.optimizer.state and weights_only.scheduler.last_epoch == 1
    step(weights_only, cfg, 2)
    b = weights(fresh)
    assert all(torch.equal(b[k], v) for k, v in weights(weights_only).items())
    model_only = make_engine(cfg, tiny_model_dir)  # without extra the schedule starts over too
    model_only.load_checkpoint(str(tmp_path), parts=("model",))
    assert model_only.scheduler.last_epoch == 0 and not model_only.optimizer.state
