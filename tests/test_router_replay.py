"""Router replay on the Megatron engine (verl's `router_replay.mode`) for the three MoE families, in
every layout that splits a replica's tokens or layers over two gloo ranks: expert and data
parallel, tensor + sequence parallel (with and without expert parallelism), context parallel, and
pipeline parallel (with virtual stages too, on a 4-layer model). The routes an engine records are the experts transformers' own routers pick for
the same rows, whatever the micro-batches; routes imposed on the engine give the log-probs, loss
and gradient norm of transformers' model with its routers forced to the same experts, with the
layers recomputed in the backward pass (gradient checkpointing) too. The command-line run and
the rollout's route table are tested here for both engines; the FSDP engine's passes are
`tests/test_router_replay_fsdp.py`'s."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hybrid_rl.engines import Output
from hybrid_rl.engines.base import ROUTES_KEY
from tests.conftest import build_tiny_moe_model, built_once
from tests.engine_helpers import actor_config, loss_fn, make_engine, rollout_batch, two_rank_results

pytestmark = pytest.mark.slow
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_moe_4_layers")
EXPERT_PARALLEL = ("actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",)
REPLAY = ("actor_rollout_ref.actor.router_replay.mode=R2",)
CHECKPOINTING = ("actor_rollout_ref.model.enable_gradient_checkpointing=true",)
# (layout keywords of actor_config, families run in it); the expert-parallel layout keeps the
# data split (each rank its own rows), the others hold one replica over both ranks.
LAYOUTS = {"ep2": (dict(extra=EXPERT_PARALLEL), FAMILIES[:3]), "tp2": (dict(tp=2), ("qwen2_moe",)),
           "tp2_ep2": (dict(tp=2, extra=EXPERT_PARALLEL), ("mixtral",)),
           "cp2_ep2": (dict(cp=2, extra=EXPERT_PARALLEL), ("qwen3_moe",)), "pp2": (dict(pp=2), ("qwen3_moe",)),
           "pp2vpp2": (dict(pp=2, vpp=2), ("qwen3_moe_4_layers",))}
TEMPERATURE = 0.7


def rows_of(dp_rank: int, dp_size: int):
    """A data-parallel rank's rows: one mini-batch of 4 prompts x 2 samples over the replicas."""
    return rollout_batch(1 + 100 * dp_rank, rows=8 // dp_size)


def forced_routes(batch, layers: int, experts: int, seed: int = 5) -> torch.Tensor:
    """Distinct experts per token, drawn at random (not what the routers pick)."""
    rows, columns = batch["input_ids"].shape
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, columns, layers, experts, generator=g).argsort(-1)[..., :2].to(torch.uint8)


def update(engine, cfg, batch) -> dict:
    return engine.update(batch, cfg.actor_rollout_ref.actor, rollout_n=2, seed=1, output=Output.LOG_PROBS_ENTROPY,
                         temperature=TEMPERATURE, loss_fn=loss_fn)


def _rank_main(rank, world, init_file, model_dirs, out_dir):
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, (layout, families) in LAYOUTS.items():
        parallel_state.destroy_model_parallel()
        for family in families:
            cfg = actor_config("megatron", **{**layout, "extra": layout.get("extra", ()) + REPLAY})
            engine = make_engine(cfg, model_dirs[family])
            batch = rows_of(engine.dp_rank, engine.dp_size)
            with engine.recording_routes():
                recorded = engine.infer(batch, Output.LOG_PROBS, TEMPERATURE, 3, None)
                # Other micro-batches: balanced by tokens, rows regrouped.
                recorded_by_tokens = engine.infer(batch, Output.LOG_PROBS, TEMPERATURE, 3, 20)
            plain_log_probs = engine.infer(batch, Output.LOG_PROBS, TEMPERATURE, 3, None)["log_probs"]
            batch[ROUTES_KEY] = forced_routes(batch, engine.layout.num_layers, engine.layout.experts.count)
            forced = engine.infer(batch, Output.LOG_PROBS_ENTROPY, TEMPERATURE, 3, None)
            first = update(engine, cfg, batch)
            cfg = actor_config("megatron", **{**layout, "extra": layout.get("extra", ()) + REPLAY + CHECKPOINTING})
            recomputing = make_engine(cfg, model_dirs[family])
            results[name, family] = {
                "dp_rank": engine.dp_rank, "dp": engine.dp_size, "last_stage": engine.pp_rank == engine.pp_size - 1,
                "recorded": recorded,
                "recorded_by_tokens": recorded_by_tokens, "plain_log_probs": plain_log_probs, "forced": forced,
                "routes": batch[ROUTES_KEY], "first": first, "recomputed": update(recomputing, cfg, batch),
                "recompute": recomputing.config.recompute_granularity}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tiny_moe_model_dirs, tiny_tokenizer, tmp_path_factory) -> dict[str, str]:
    four = built_once(tmp_path_factory, "tiny_qwen3_moe_4_layers",
                      lambda folder: build_tiny_moe_model(folder, tiny_tokenizer, "qwen3_moe", layers=4))
    return {**tiny_moe_model_dirs, "qwen3_moe_4_layers": str(four)}


@pytest.fixture(scope="module")
def replay_runs(model_dirs, tmp_path_factory) -> list[dict]:
    return two_rank_results(_rank_main, tmp_path_factory.mktemp("router_replay"), model_dirs)


class ForcedRouters:
    """transformers' model with each MoE layer's router returning the experts of a route table
    (the router's probabilities at those experts, renormalised where the model renormalises)."""

    def __init__(self, model):
        self.model, self.routes, self.seen = model, None, {}
        self.renormalise = getattr(model.config, "norm_topk_prob", True)  # Mixtral's always are
        for index, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "gate"):  # not a dense layer
                layer.mlp.gate.register_forward_hook(lambda module, args, out, index=index: self._route(index, out))

    def _route(self, layer: int, out):
        logits, _, chosen = out
        self.seen[layer] = chosen
        if self.routes is None:
            return None
        experts = self.routes[:, :, layer].reshape(-1, self.routes.shape[-1]).long()
        weights = torch.softmax(logits.float(), dim=-1).gather(1, experts)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts

    def outputs(self, batch, routes=None) -> dict[str, torch.Tensor]:
        """Response log-probs and entropies at TEMPERATURE (with gradients)."""
        self.routes = routes
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch["position_ids"]).logits
        responses = batch["responses"]
        log_softmax = torch.log_softmax(logits[:, -responses.shape[1] - 1:-1].float() / TEMPERATURE, dim=-1)
        return {"log_probs": log_softmax.gather(-1, responses.unsqueeze(-1)).squeeze(-1),
                "entropy": -(log_softmax.exp() * log_softmax).sum(-1)}


def changed_share(batch, routes, chosen: dict[int, torch.Tensor]) -> float:
    """The share of (real token, layer) pairs whose `routes` are not the experts `chosen` (the
    routers' own picks, per layer, tokens flattened row-major)."""
    mask = batch["attention_mask"].bool()
    rows, columns = mask.shape
    differs = [(routes[:, :, layer].long().sort(-1).values
                != picked.view(rows, columns, -1).sort(-1).values).any(-1)[mask] for layer, picked in chosen.items()]
    return float(torch.cat(differs).float().mean())


def transformers_model(model_dir):
    from transformers import AutoModelForCausalLM

    return ForcedRouters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def runs_of(replay_runs, family):
    return [(name, runs[name, family]) for runs in replay_runs for name, (_, families) in LAYOUTS.items()
            if family in families]


def batch_of(run):
    return rows_of(run["dp_rank"], run["dp"])


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routes_are_the_experts_transformers_routes_to(replay_runs, model_dirs, family):
    hf = transformers_model(model_dirs[family])
    for name, run in runs_of(replay_runs, family):
        batch = batch_of(run)
        with torch.no_grad():
            hf.outputs(batch)
        mask = batch["attention_mask"].bool()
        rows, columns = mask.shape
        for recorded in (run["recorded"], run["recorded_by_tokens"]):
            table = recorded[ROUTES_KEY]
            assert table.dtype == torch.uint8 and table.shape == (rows, columns, len(hf.seen), 2), name
            for layer, chosen in hf.seen.items():
                assert torch.equal(table[:, :, layer].long()[mask], chosen.view(rows, columns, -1)[mask]), name
            # Padding holds the default experts.
            assert (table[~mask] == torch.arange(2, dtype=torch.uint8)).all(), name
        # Recording changes nothing computed.
        assert torch.equal(run["recorded"]["log_probs"], run["plain_log_probs"]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_imposed_routes_give_transformers_outputs_with_its_routers_forced(replay_runs, model_dirs, family):
    hf = transformers_model(model_dirs[family])
    for name, run in runs_of(replay_runs, family):
        batch = batch_of(run)
        mask = batch["response_mask"].bool()
        with torch.no_grad():
            natural = hf.outputs(batch)["log_probs"]
            expected = hf.outputs(batch, run["routes"])
        assert (expected["log_probs"] - natural)[mask].abs().max() > 1e-2  # the forced experts matter
        for key in ("log_probs", "entropy"):
            assert (run["forced"][key] - expected[key])[mask].abs().max() <= 1e-5, (name, key)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_update_with_imposed_routes_has_the_forced_models_loss_and_gradient(replay_runs, model_dirs,
                                                                               family):
    """The loss on every rank, and the gradient norm of the whole mini-batch (the data-parallel
    ranks' rows together), equal transformers' with forced routers; recomputing the layers in the
    backward pass replays the same routes there."""
    hf = transformers_model(model_dirs[family])
    for name, _ in runs_of(replay_runs[:1], family):
        runs = [runs_of_rank[name, family] for runs_of_rank in replay_runs]
        replicas = {run["dp_rank"]: run for run in runs}
        batches = {dp_rank: batch_of(run) for dp_rank, run in replicas.items()}
        agg = {"dp_size": len(replicas),
               "global_num_tokens": sum(float(b["response_mask"].sum()) for b in batches.values())}
        hf.model.zero_grad()
        for dp_rank, run in replicas.items():
            micro = {**batches[dp_rank].tensors}
            loss, terms = loss_fn(hf.outputs(batches[dp_rank], run["routes"]), micro, agg)
            # The routers' own choices in that pass (from hidden states the imposed routes shaped).
            changed = changed_share(batches[dp_rank], run["routes"], hf.seen)
            (loss / len(replicas)).backward()  # megatron averages the replicas' gradients
            for rank_run in runs:
                if rank_run["dp_rank"] == dp_rank:
                    assert rank_run["first"]["actor/routes_changed"] == pytest.approx(changed, rel=1e-6), name
                    assert rank_run["recomputed"]["actor/routes_changed"] == pytest.approx(changed, rel=1e-6), name
                    if rank_run["last_stage"]:  # the loss exists there
                        assert rank_run["first"]["actor/loss"] == pytest.approx(terms["loss"], rel=1e-5), name
        norm = torch.cat([p.grad.flatten() for p in hf.model.parameters() if p.grad is not None]).norm()
        for run in runs:
            assert run["recompute"] == "full"
            assert run["first"]["actor/grad_norm"] == pytest.approx(float(norm), rel=1e-4), name
            assert run["recomputed"]["actor/grad_norm"] == pytest.approx(run["first"]["actor/grad_norm"],
                                                                         rel=1e-5), name
            if run["last_stage"]:
                assert run["recomputed"]["actor/loss"] == pytest.approx(run["first"]["actor/loss"], rel=1e-5), name


def test_the_rollouts_routes_fill_the_batchs_table_where_the_tokens_are(replay_runs):
    """vLLM's routes per sequence (prompt and response, without the last token) placed in the
    batch's [left-padded prompt | right-padded response] layout: here the routes an engine
    recorded, in vLLM's form, come back where they were; the last token gets the default."""
    from hybrid_rl.engines.routing import route_table

    run = replay_runs[0]["ep2", "qwen3_moe"]
    table, mask = run["recorded"][ROUTES_KEY], batch_of(run)["attention_mask"]
    arrays = [table[row][mask[row].bool()][:-1].numpy() for row in range(len(mask))]
    placed = route_table(mask, arrays)
    last = mask.cumsum(1) == mask.sum(1, keepdim=True)
    last &= mask.bool()
    assert placed.dtype == table.dtype and placed.shape == table.shape
    assert torch.equal(placed[~last], table[~last])
    assert (placed[last] == torch.arange(2, dtype=torch.uint8)).all()


# Per engine, its command line's own settings: verl 0.9's Megatron key (the engine tests above use
# 0.7-0.8's router_replay.mode) on two expert-parallel ranks, and the FSDP tree on one rank.
COMMAND_LINES = {
    "megatron": ["--config-name=ppo_megatron_trainer", "actor_rollout_ref.actor.megatron.dtype=fp32",
                 "trainer.n_gpus_per_node=2", "trainer.cpus_per_worker=1",
                 "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.router_replay.mode=R2"],
    "fsdp": ["actor_rollout_ref.actor.fsdp_config.dtype=fp32", "actor_rollout_ref.actor.router_replay.mode=R2"]}


@pytest.mark.parametrize("engine", COMMAND_LINES)
def test_the_command_line_replays_the_old_log_prob_passs_routes_in_the_update(tiny_moe_model_dirs, arithmetic_files,
                                                                               tmp_path, engine):
    """A command line with router_replay.mode=R2 and two mini-batches: the old-log-prob pass's
    routes reach the update, whose first mini-batch (the weights of that pass) keeps every route
    and whose second (after a large step) does not."""
    import json
    import subprocess
    import sys

    from hybrid_rl.main import REPO_ROOT
    from tests.conftest import run_overrides

    settings = COMMAND_LINES[engine]
    command = [sys.executable, "-m", "hybrid_rl.main", *settings[:1],
               *run_overrides(tiny_moe_model_dirs["qwen3_moe"], arithmetic_files, tmp_path), *settings[1:],
               "data.train_batch_size=4",
               "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_training_steps=1",
               "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.final_model_dir=null",
               "actor_rollout_ref.actor.entropy_coeff=0.1", "actor_rollout_ref.actor.optim.lr=0.05"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # The mean over the two mini-batches: 0 for the first, more for the second.
    assert 0 < metrics["actor/routes_changed"] < 1


def test_router_replay_on_a_model_without_experts_is_refused_at_start(tiny_model_dir):
    from hybrid_rl.config import ConfigError, check_model_limits, validate_config
    from hybrid_rl.main import compose_config

    cfg = validate_config(compose_config(["trainer.device=cpu", "actor_rollout_ref.actor.router_replay.mode=R2"],
                                         config_name="ppo_megatron_trainer"))
    with pytest.raises(ConfigError, match="router_replay.mode=R2 replays the routes of a mixture-of-experts"):
        check_model_limits(cfg, tiny_model_dir)


def test_a_rollout_that_returns_too_few_routes_is_an_error():
    from hybrid_rl.engines.routing import route_table

    mask = torch.tensor([[0, 1, 1, 1, 1]])
    with pytest.raises(RuntimeError, match="routes of 2 tokens for a sequence of 4"):
        route_table(mask, [torch.zeros(2, 1, 2, dtype=torch.uint8).numpy()])
