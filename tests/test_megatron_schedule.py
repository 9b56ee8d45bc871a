"""The Megatron engine's learning-rate schedule from verl's Megatron optimizer keys, against the
schedule's formulas written out here; weight decay by parameter group; resume; the start checks
of the schedule keys and of the gradient clip's two keys."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.engines import ModelSpec, build_engine
from hybrid_rl.engines.base import lr_lambda
from tests.engine_helpers import actor_config, step

LR, MIN_LR, INIT_LR, TOTAL = 1e-3, 1e-4, 2e-4, 8
OPTIM = "actor_rollout_ref.actor.optim"
CASES = {
    "cosine": (f"{OPTIM}.lr_decay_style=cosine", f"{OPTIM}.lr_warmup_steps=2", f"{OPTIM}.lr_warmup_init={INIT_LR}",
               f"{OPTIM}.min_lr={MIN_LR}"),
    "linear, 6 decay steps": (f"{OPTIM}.lr_decay_style=linear", f"{OPTIM}.lr_decay_steps=6",
                              f"{OPTIM}.lr_warmup_steps_ratio=0.5", f"{OPTIM}.min_lr={MIN_LR}"),
    "WSD": (f"{OPTIM}.lr_decay_style=WSD", f"{OPTIM}.lr_wsd_decay_style=linear", f"{OPTIM}.lr_wsd_decay_steps=2",
            f"{OPTIM}.min_lr={MIN_LR}"),
    "lr_scheduler_type=cosine": (f"{OPTIM}.lr_scheduler_type=cosine", f"{OPTIM}.min_lr_ratio=0.1",
                                 f"{OPTIM}.lr_warmup_steps=2"),
}


def expected_lr(case: str, k: int) -> float:
    """The learning rate of training step k (from 0), as megatron's schedule defines it."""
    if k > TOTAL:  # past the decay steps
        return 0.1 * LR if case == "lr_scheduler_type=cosine" else MIN_LR
    if case == "cosine":
        if k <= 2:
            return INIT_LR + (LR - INIT_LR) * k / 2
        return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (k - 2) / (TOTAL - 2)))
    if case == "linear, 6 decay steps":  # warmup: half of the 6 decay steps, from 0
        if k <= 3:
            return LR * k / 3
        return MIN_LR if k > 6 else MIN_LR + (LR - MIN_LR) * (1 - (k - 3) / 3)
    if case == "WSD":  # constant until the last 2 of 8 steps
        return LR if k <= TOTAL - 2 else MIN_LR + (LR - MIN_LR) * (1 - (k - (TOTAL - 2)) / 2)
    if k <= 2:  # lr_scheduler_type=cosine: megatron's cosine to min_lr_ratio x lr
        return LR * k / 2
    return 0.1 * LR + 0.9 * LR * 0.5 * (1 + math.cos(math.pi * (k - 2) / (TOTAL - 2)))


def build(model_dir: str, extra=()):
    cfg = actor_config("megatron", extra=(f"{OPTIM}.lr={LR}", *extra))
    actor = cfg.actor_rollout_ref.actor
    spec = ModelSpec("actor", model_dir, cfg.actor_rollout_ref.model, optim_cfg=actor.optim, total_steps=TOTAL)
    return build_engine(spec, actor, torch.device("cpu")), cfg


def group_lrs(engine) -> list[float]:
    return [group["lr"] for group in engine.optimizer.param_groups]


def _rank_main(rank, model_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=1)
    results = {}
    for case, extra in CASES.items():
        engine, cfg = build(model_dir, extra)
        lrs = [group_lrs(engine)]
        logged = step(engine, cfg, 1)["actor/lr"]  # an update, then the schedule's step
        lrs.append(group_lrs(engine))
        for _ in range(2, TOTAL + 2):
            engine.scheduler.step()
            lrs.append(group_lrs(engine))
        results[case] = {"lrs": lrs, "logged": logged}
    # Resume: the schedule's state, and a checkpoint from torch LambdaLR schedules (before megatron's).
    engine, _ = build(model_dir, CASES["cosine"])
    for _ in range(3):
        engine.scheduler.step()
    resumed, _ = build(model_dir, CASES["cosine"])
    resumed.scheduler.load_state_dict(engine.scheduler.state_dict())
    older, _ = build(model_dir, CASES["cosine"])
    older.scheduler.load_state_dict({"schedules": [{"last_epoch": 3, "base_lrs": [LR], "_step_count": 4}]})
    results["resumed"] = [group_lrs(resumed), group_lrs(older)]
    # Weight decay: none on biases and one-dimensional weights, as megatron groups them (its
    # other optimizer, whose groups hold the weights themselves rather than flat shards).
    engine, _ = build(model_dir, (f"{OPTIM}.weight_decay=0.1",
                                  "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false"))
    results["decay"] = [(group["weight_decay"], {tuple(p.shape) for p in group["params"]})
                        for group in engine.optimizer.param_groups]
    torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def schedules(tiny_model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("schedule")
    mp.start_processes(_rank_main, args=(tiny_model_dir, str(out_dir)), nprocs=1, start_method="spawn")
    return torch.load(out_dir / "results.pt")


@pytest.mark.parametrize("case", CASES)
def test_megatron_learning_rate_follows_verls_megatron_keys(schedules, case):
    result = schedules[case]
    for k, lrs in enumerate(result["lrs"]):
        assert lrs == pytest.approx([expected_lr(case, k)] * len(lrs), rel=1e-9, abs=1e-15), (case, k)
    assert result["logged"] == pytest.approx(expected_lr(case, 1), rel=1e-9, abs=1e-15)


def test_megatron_cosine_of_lr_scheduler_type_is_the_fsdp_engines_after_the_warmup(schedules):
    optim = OmegaConf.create({"lr_warmup_steps": 2, "lr_warmup_steps_ratio": 0.0, "lr_scheduler_type": "cosine",
                              "min_lr_ratio": 0.1, "num_cycles": 0.5})
    fsdp = lr_lambda(optim, TOTAL)
    for k in range(2, TOTAL + 1):
        assert schedules["lr_scheduler_type=cosine"]["lrs"][k][0] == pytest.approx(LR * fsdp(k), rel=1e-9)


def test_megatron_schedule_resumes_at_its_step(schedules):
    for lrs in schedules["resumed"]:
        assert lrs == pytest.approx([expected_lr("cosine", 3)] * len(lrs), rel=1e-9)


def test_megatron_weight_decay_spares_biases_and_norms(schedules):
    decays = {}
    for decay, shapes in schedules["decay"]:
        for shape in shapes:
            decays.setdefault(len(shape), set()).add(decay)
    assert decays == {1: {0.0}, 2: {0.1}}


def _validated(overrides, config_name="ppo_megatron_trainer"):
    return validate_config(compose_config(list(overrides), config_name=config_name))


@pytest.mark.parametrize("overrides, message", [
    ((f"{OPTIM}.lr_decay_style=exponential",), "lr_decay_style=exponential is not one of"),
    ((f"{OPTIM}.lr_decay_style=WSD",), "needs actor_rollout_ref.actor.optim.lr_wsd_decay_steps"),
    ((f"{OPTIM}.lr_scheduler_type=cosine", f"{OPTIM}.lr_decay_style=linear"), "ask for two schedules"),
    ((f"{OPTIM}.lr_scheduler_type=cosine", f"{OPTIM}.num_cycles=1.5"), "is a half cycle"),
    ((f"{OPTIM}.lr_scheduler_type=cosine", f"{OPTIM}.min_lr_ratio=0.1", f"{OPTIM}.min_lr=0.5e-7"), "disagree"),
    ((f"{OPTIM}.min_lr=1.0",), "must be between 0 and"),
    ((f"{OPTIM}.lr_decay_style=cosine", "actor_rollout_ref.actor.strategy=fsdp2"), "only the Megatron engine"),
    (("critic.optim.min_lr=1e-7", "critic.strategy=fsdp2"), "critic.optim.min_lr set megatron's schedule"),
    ((f"{OPTIM}.clip_grad=0.5", "actor_rollout_ref.actor.grad_clip=2.0"), "are the same setting"),
])
def test_schedule_and_clip_keys_that_cannot_work_are_refused_at_start(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _validated(overrides)


def test_schedule_warmup_longer_than_the_decay_is_refused_when_the_engine_is_built():
    from hybrid_rl.engines.megatron.schedule import settings

    optim = OmegaConf.create({"lr": 1e-3, "weight_decay": 0.0, "lr_warmup_steps": 8, "lr_decay_steps": 5})
    with pytest.raises(ValueError, match="8 warmup steps do not fit in 5 decay steps"):
        settings("actor_rollout_ref.actor.optim", optim, 10)


@pytest.mark.parametrize("overrides, clip", [((), 1.0), ((f"{OPTIM}.clip_grad=0.5",), 0.5),
                                             (("actor_rollout_ref.actor.grad_clip=0.3",), 0.3),
                                             ((f"{OPTIM}.clip_grad=0.5", "actor_rollout_ref.actor.grad_clip=0.5"), 0.5)])
def test_verl_09s_clip_grad_and_older_verls_grad_clip_set_the_same_clip(overrides, clip):
    for name in ("ppo_trainer", "ppo_megatron_trainer"):
        assert _validated(overrides, name).actor_rollout_ref.actor.grad_clip == clip
    critic = _validated(("critic.optim.clip_grad=0.25",), "ppo_trainer").critic
    assert critic.grad_clip == 0.25
