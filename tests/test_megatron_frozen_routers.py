"""verl's `megatron.override_mcore_model_config.moe_config.freeze_moe_router`: a mixture-of-experts
model's routers and shared-expert gates stay as loaded through an update while the rest trains;
what else is set there, or the setting on a dense model, is refused at start."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from hybrid_rl.engines.megatron import convert
from hybrid_rl.engines.megatron.checks import frozen_routers
from tests.engine_helpers import actor_config, make_engine, step, weights

pytestmark = pytest.mark.slow

FREEZE = "+actor_rollout_ref.actor.megatron.override_mcore_model_config.moe_config.freeze_moe_router=true"
ROUTERS = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")  # Qwen2-MoE's, in transformers' names


def _rank_main(rank, model_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=1)
    results = {}
    for name, extra in (("frozen", (FREEZE,)), ("trained", ())):
        cfg = actor_config("megatron", extra=extra)
        engine = make_engine(cfg, model_dir)
        before = weights(engine)
        results[name] = {"loss": step(engine, cfg, 1)["actor/loss"], "before": before, "after": weights(engine)}
    torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def updates(tiny_moe_model_dirs, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("frozen_routers")
    mp.start_processes(_rank_main, args=(tiny_moe_model_dirs["qwen2_moe"], str(out_dir)), nprocs=1,
                       start_method="spawn")
    return torch.load(out_dir / "results.pt")


def changed(run: dict) -> dict[str, bool]:
    return {name: not torch.equal(run["before"][name], run["after"][name]) for name in run["before"]}


def test_frozen_routers_stay_as_loaded_while_the_rest_trains(updates):
    frozen, trained = changed(updates["frozen"]), changed(updates["trained"])
    routers = [name for name in frozen if name.endswith(ROUTERS)]
    assert {suffix for suffix in ROUTERS if any(name.endswith(suffix) for name in routers)} == set(ROUTERS)
    assert not any(frozen[name] for name in routers)
    assert all(trained[name] for name in routers)  # the same update moves them when not frozen
    assert all(frozen[name] for name in frozen if name not in routers)
    assert updates["frozen"]["loss"] == updates["trained"]["loss"]  # the same forward pass before the step


def test_freezing_routers_is_refused_where_it_cannot_apply(tiny_moe_model_dirs, tiny_model_dir):
    from transformers import AutoConfig

    moe = convert.Layout.from_hf_config(AutoConfig.from_pretrained(tiny_moe_model_dirs["qwen2_moe"]))
    dense = convert.Layout.from_hf_config(AutoConfig.from_pretrained(tiny_model_dir))
    key = "actor_rollout_ref.actor"
    assert frozen_routers(key, OmegaConf.create({"override_mcore_model_config": {}}), moe) is False
    with pytest.raises(ValueError, match="sets share_embeddings, moe_config.freeze_router: verl reads only"):
        frozen_routers(key, OmegaConf.create({"override_mcore_model_config": {
            "share_embeddings": False, "moe_config": {"freeze_router": True}}}), moe)
    with pytest.raises(ValueError, match="the model has no mixture-of-experts routers"):
        frozen_routers(key, OmegaConf.create({"override_mcore_model_config": {
            "moe_config": {"freeze_moe_router": True}}}), dense)
