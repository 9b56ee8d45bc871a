"""FSDP's hybrid sharding (verl's fsdp_config.fsdp_size): two gloo ranks that each hold the whole
model (fsdp_size=1, two groups of one) train exactly as two ranks that shard it (fsdp_size=-1),
each rank on a batch of its own, and resume exactly from their checkpoint."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.engines import Output
from tests.engine_helpers import actor_config, loss_fn, make_engine, rollout_batch, weights

pytestmark = pytest.mark.slow


def update(engine, cfg, seed: int) -> dict:
    batch = rollout_batch(seed + 100 * dist.get_rank())  # each rank its own rows
    return engine.update(batch, cfg.actor_rollout_ref.actor, rollout_n=2, seed=seed,
                         output=Output.LOG_PROBS_ENTROPY, temperature=0.7, loss_fn=loss_fn)


def _rank_main(rank, world, init_file, model_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    runs = {}
    for fsdp_size in (-1, 1):
        cfg = actor_config("fsdp2", extra=[f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size}"])
        engine = make_engine(cfg, model_dir)
        mesh = next(p for p in engine.module.parameters() if isinstance(p, DTensor)).device_mesh
        first, after = update(engine, cfg, 1), weights(engine)
        engine.save_checkpoint(os.path.join(out_dir, f"ckpt{fsdp_size}"))
        second, second_weights = update(engine, cfg, 2), weights(engine)
        resumed = make_engine(cfg, model_dir)
        resumed.load_checkpoint(os.path.join(out_dir, f"ckpt{fsdp_size}"))
        runs[fsdp_size] = {"mesh": tuple(mesh.shape), "first": first, "after": after, "second": second,
                           "second_weights": second_weights, "resumed": update(resumed, cfg, 2),
                           "resumed_weights": weights(resumed)}
    torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_hybrid_sharding_trains_as_full_sharding(tiny_model_dir):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(2, os.path.join(out_dir, "init"), tiny_model_dir, out_dir),
                           nprocs=2, start_method="spawn")
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    for runs in results:
        sharded, replicated = runs[-1], runs[1]
        assert sharded["mesh"] == (2,) and replicated["mesh"] == (2, 1)
        for key in ("actor/loss", "actor/grad_norm"):
            assert replicated["first"][key] == pytest.approx(sharded["first"][key], rel=1e-5)
        for name, tensor in sharded["after"].items():
            torch.testing.assert_close(replicated["after"][name], tensor, rtol=1e-5, atol=1e-6)
        for run in (sharded, replicated):
            assert run["resumed"] == run["second"]
            assert all(torch.equal(run["resumed_weights"][k], run["second_weights"][k]) for k in run["second_weights"])
    # Both ranks end with the same weights: the groups' gradients were all-reduced.
    assert all(torch.equal(results[0][1]["after"][k], results[1][1]["after"][k]) for k in results[0][1]["after"])


@pytest.mark.parametrize("size", [3, 0])
def test_an_fsdp_size_that_does_not_divide_the_ranks_is_refused(size):
    with pytest.raises(ConfigError, match=rf"actor_rollout_ref.actor.fsdp_config.fsdp_size={size} must be -1 "
                                          r"\(shard over all 4 ranks\) or a divisor of 4: 1, 2, 4"):
        validate_config(compose_config(["trainer.n_gpus_per_node=4", f"actor_rollout_ref.actor.fsdp_config.fsdp_size={size}"]))
