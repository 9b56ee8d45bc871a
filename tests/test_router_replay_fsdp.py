"""Router replay on the FSDP engine (verl's `router_replay.mode`; verl replays on Megatron only), for
transformers' five router families: Qwen3-MoE, Qwen2-MoE, Mixtral (softmax), DeepSeek-V2 (softmax
from groups, scaled) and DeepSeek-V3 (sigmoid with a correction bias, groups, scaled; a dense first
layer). In packed rows where two responses share one prompt copy, and in padded rows:

- the routes an engine records are the experts transformers' routers pick, whatever the micro-batches;
- replaying them gives the model's own outputs (within float32 rounding), so the weights recomputed
  at imposed experts are each family's router's own;
- imposed routes give the outputs, loss and gradient of transformers' model with its routers forced
  to the same experts, also where gradient checkpointing recomputes the layers in the backward pass;
- on two gloo ranks the same holds under Ulysses sequence parallelism (each rank routes half of each
  row) and under data parallelism (FSDP-sharded routers, each rank its own rows).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hybrid_rl.engines import Output
from hybrid_rl.engines.base import ROUTES_KEY
from hybrid_rl.engines.fsdp import decoder_layers
from hybrid_rl.engines.packing import pack_rows
from tests.engine_helpers import actor_config, loss_fn, make_engine, rollout_batch, two_rank_results
from tests.test_router_replay import TEMPERATURE, changed_share, forced_routes, transformers_model

pytestmark = pytest.mark.slow
SOFTMAX = ("qwen3_moe", "qwen2_moe", "mixtral")
FAMILIES = (*SOFTMAX, "deepseek_v2", "deepseek_v3_yarn")
REPLAY = "actor_rollout_ref.actor.router_replay.mode=R2"
LAYOUTS = {"packed": (), "padded": ("actor_rollout_ref.model.use_remove_padding=false",)}
CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing=true"


def grouped(seed: int, rows: int = 8):
    """Rows in pairs with one prompt, as a GRPO batch has them: packed, each pair shares a copy."""
    batch = rollout_batch(seed, rows=rows)
    prompt_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    for key in ("input_ids", "attention_mask"):
        batch[key][1::2, :prompt_len] = batch[key][0::2, :prompt_len]
    batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp_min(0)
    return batch


def engine_config(*extra: str):
    return actor_config("fsdp2", extra=[REPLAY, "actor_rollout_ref.model.share_prompt_prefix=true", *extra])


def random_routes(batch, layers: int, experts: int, top_k: int, seed: int = 5) -> torch.Tensor:
    """Distinct experts per token drawn at random, for any number of experts and choices."""
    rows, columns = batch["input_ids"].shape
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, columns, layers, experts, generator=g).argsort(-1)[..., :top_k].to(torch.uint8)


def update(engine, cfg, batch) -> dict:
    return engine.update(batch, cfg.actor_rollout_ref.actor, rollout_n=2, seed=1, output=Output.LOG_PROBS_ENTROPY,
                         temperature=TEMPERATURE, loss_fn=loss_fn)


def engine_passes(cfg, model_dir, batch) -> dict:
    """What the tests compare, from one engine: recorded tables, plain / replayed / forced outputs."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    experts = next(getattr(hf_config, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                   if getattr(hf_config, name, None))
    engine = make_engine(cfg, model_dir)
    batch = batch.select(list(batch.tensors.keys()), non_tensor_keys=[])
    with engine.recording_routes():
        recorded = engine.infer(batch, Output.LOG_PROBS, TEMPERATURE, 3, None)
        recorded_by_tokens = engine.infer(batch, Output.LOG_PROBS, TEMPERATURE, 3, 20)  # rows regrouped
    plain = engine.infer(batch, Output.LOG_PROBS_ENTROPY, TEMPERATURE, 3, None)
    batch[ROUTES_KEY] = recorded[ROUTES_KEY]
    replayed = engine.infer(batch, Output.LOG_PROBS_ENTROPY, TEMPERATURE, 3, None)
    batch[ROUTES_KEY] = random_routes(batch, hf_config.num_hidden_layers, experts, hf_config.num_experts_per_tok)
    forced = engine.infer(batch, Output.LOG_PROBS_ENTROPY, TEMPERATURE, 3, None)
    return {"dp_rank": engine.dp_rank, "dp": engine.dp_size, "recorded": recorded,
            "recorded_by_tokens": recorded_by_tokens, "plain": plain, "replayed": replayed, "forced": forced,
            "routes": batch[ROUTES_KEY], "first": update(engine, cfg, batch)}


@pytest.fixture(scope="module")
def model_dirs(tiny_moe_model_dirs, tiny_latent_model_dirs) -> dict[str, str]:
    return {**tiny_moe_model_dirs, **tiny_latent_model_dirs}


@pytest.fixture(scope="module")
def one_rank_runs(model_dirs):
    cache = {}

    def runs(family: str, layout: str) -> dict:
        if (family, layout) not in cache:
            cache[family, layout] = engine_passes(engine_config(*LAYOUTS[layout]), model_dirs[family], grouped(1))
        return cache[family, layout]

    return runs


def check_recorded(hf, batch, table: torch.Tensor, name) -> None:
    """`table` holds the experts `hf`'s routers pick for `batch`, the default where none routed."""
    with torch.no_grad():
        hf.outputs(batch)
    mask = batch["attention_mask"].bool()
    rows, columns = mask.shape
    layers, top_k = hf.model.config.num_hidden_layers, hf.model.config.num_experts_per_tok
    assert table.dtype == torch.uint8 and table.shape == (rows, columns, layers, top_k), name
    for layer in range(layers):
        if layer in hf.seen:
            assert torch.equal(table[:, :, layer].long()[mask], hf.seen[layer].view(rows, columns, -1)[mask]), name
        else:  # a dense layer
            assert (table[:, :, layer] == torch.arange(top_k, dtype=torch.uint8)).all(), name
    assert (table[~mask] == torch.arange(top_k, dtype=torch.uint8)).all(), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routes_are_the_experts_transformers_routes_to(one_rank_runs, model_dirs, family, layout):
    run = one_rank_runs(family, layout)
    hf = transformers_model(model_dirs[family])
    batch = grouped(1)
    for recorded in (run["recorded"], run["recorded_by_tokens"]):
        check_recorded(hf, batch, recorded[ROUTES_KEY], (family, layout))
    assert torch.equal(run["recorded"]["log_probs"], run["plain"]["log_probs"])  # recording changes nothing


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_recorded_routes_gives_the_models_own_outputs(one_rank_runs, family, layout):
    """The weights recomputed at imposed experts are the router's own: replaying its own choices
    changes nothing, while other experts change the outputs."""
    run = one_rank_runs(family, layout)
    mask = grouped(1)["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert (run["replayed"][key] - run["plain"][key])[mask].abs().max() <= 1e-5, key
    assert (run["forced"]["log_probs"] - run["plain"]["log_probs"])[mask].abs().max() > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", SOFTMAX)
def test_imposed_routes_give_transformers_outputs_with_its_routers_forced(one_rank_runs, model_dirs, family, layout):
    run = one_rank_runs(family, layout)
    hf = transformers_model(model_dirs[family])
    batch = grouped(1)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        expected = hf.outputs(batch, run["routes"])
    for key in ("log_probs", "entropy"):
        assert (run["forced"][key] - expected[key])[mask].abs().max() <= 1e-5, (layout, key)


def forced_update_reference(hf, batches: dict, routes: dict) -> tuple[dict, dict, float]:
    """transformers' forced model over the data-parallel ranks' rows (`batches`, `routes` by
    rank): each rank's loss and share of changed routes, and the mini-batch's gradient norm."""
    agg = {"dp_size": len(batches),
           "global_num_tokens": sum(float(b["response_mask"].sum()) for b in batches.values())}
    hf.model.zero_grad()
    losses, changed = {}, {}
    for rank, batch in batches.items():
        loss, terms = loss_fn(hf.outputs(batch, routes[rank]), {**batch.tensors}, agg)
        losses[rank], changed[rank] = terms["loss"], changed_share(batch, routes[rank], hf.seen)
        (loss / len(batches)).backward()  # FSDP averages the ranks' gradients
    norm = torch.cat([p.grad.flatten() for p in hf.model.parameters() if p.grad is not None]).norm()
    return losses, changed, float(norm)


@pytest.mark.parametrize("family", SOFTMAX)
def test_an_update_with_imposed_routes_has_the_forced_models_loss_and_gradient(one_rank_runs, model_dirs, family):
    """Three micro-batches; the layers recomputed in the backward pass (gradient checkpointing)
    replay the same routes there."""
    run = one_rank_runs(family, "packed")
    batch = grouped(1)
    losses, changed, norm = forced_update_reference(transformers_model(model_dirs[family]), {0: batch},
                                                    {0: run["routes"]})
    cfg = engine_config(CHECKPOINTING)
    recomputing = make_engine(cfg, model_dirs[family])
    assert recomputing.module.is_gradient_checkpointing
    batch[ROUTES_KEY] = run["routes"]
    recomputed = update(recomputing, cfg, batch)
    for result in (run["first"], recomputed):
        assert result["actor/loss"] == pytest.approx(losses[0], rel=1e-5)
        assert result["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert result["actor/routes_changed"] == pytest.approx(changed[0], rel=1e-6)


def test_rows_share_a_prompt_copy_only_where_their_prompt_routes_agree():
    batch = grouped(1)
    prompt_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    alone = pack_rows(ids, mask, prompt_len, share_prompts=False, dense_mask=True).num_tokens
    shared = pack_rows(ids, mask, prompt_len, share_prompts=True, dense_mask=True).num_tokens
    assert shared < alone
    routes = random_routes(batch, 2, 4, 2)
    routes[1::2, :prompt_len] = routes[0::2, :prompt_len]
    assert pack_rows(ids, mask, prompt_len, True, True, routes=routes).num_tokens == shared
    routes[1, prompt_len - 1] = (routes[0, prompt_len - 1] + 1) % 4  # one prompt token routed elsewhere
    apart = pack_rows(ids, mask, prompt_len, True, True, routes=routes)
    assert apart.num_tokens == shared + int(mask[1, :prompt_len].sum())
    # Every real token has a place among the packed tokens, the padding none.
    assert ((apart.slots >= 0) == mask.bool()).all()
    assert torch.equal(apart.input_ids.flatten()[apart.slots[mask.bool()]], ids[mask.bool()])


def test_routers_that_lora_adapts_record_and_replay_their_adapted_routes(model_dirs):
    """peft's all-linear LoRA adapts the routers' weights too (peft wraps each router): after an
    update has moved the adapters, the routes recorded are the adapted routers' (not the base's:
    with the adapter off they differ), and replaying them reproduces the adapted model's outputs."""
    cfg = engine_config("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.target_modules=all-linear",
                        "actor_rollout_ref.actor.optim.lr=0.05")
    engine = make_engine(cfg, model_dirs["qwen3_moe"])
    assert all(hasattr(layer.mlp.gate, "get_base_layer") for layer in decoder_layers(engine.module))
    batch = grouped(1)
    update(engine, cfg, batch)
    with engine.recording_routes():
        adapted = engine.infer(batch, Output.LOG_PROBS, TEMPERATURE, 3, None)
        with engine.adapter_disabled():
            base = engine.infer(batch, Output.LOG_PROBS, TEMPERATURE, 3, None)
    mask = batch["attention_mask"].bool()
    assert not torch.equal(adapted[ROUTES_KEY][mask], base[ROUTES_KEY][mask])
    batch[ROUTES_KEY] = adapted[ROUTES_KEY]
    replayed = engine.infer(batch, Output.LOG_PROBS, TEMPERATURE, 3, None)
    response_mask = batch["response_mask"].bool()
    assert (replayed["log_probs"] - adapted["log_probs"])[response_mask].abs().max() <= 1e-5


# ---------------------------------------------------------------------- two ranks
TWO_RANK_LAYOUTS = {"sp2": ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                            "actor_rollout_ref.actor.ppo_mini_batch_size=4"),
                    "dp2": ("actor_rollout_ref.actor.ppo_mini_batch_size=8",)}


def rows_of(dp_rank: int, dp_size: int):
    return grouped(1 + 100 * dp_rank, rows=8 // dp_size)


def _rank_main(rank, world, init_file, model_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, extra in TWO_RANK_LAYOUTS.items():
        cfg = engine_config(*extra)
        dp_rank = 0 if name == "sp2" else rank
        results[name] = engine_passes(cfg, model_dir, rows_of(dp_rank, 1 if name == "sp2" else 2))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_runs(model_dirs, tmp_path_factory) -> list[dict]:
    return two_rank_results(_rank_main, tmp_path_factory.mktemp("fsdp_router_replay"), model_dirs["qwen3_moe"])


@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_two_ranks_record_and_impose_the_routes_transformers_does(two_rank_runs, model_dirs, layout):
    hf = transformers_model(model_dirs["qwen3_moe"])
    runs = [results[layout] for results in two_rank_runs]
    assert [run["dp"] for run in runs] == ([1, 1] if layout == "sp2" else [2, 2])
    batches = {run["dp_rank"]: rows_of(run["dp_rank"], run["dp"]) for run in runs}
    for run in runs:
        batch = batches[run["dp_rank"]]
        check_recorded(hf, batch, run["recorded"][ROUTES_KEY], layout)
        check_recorded(hf, batch, run["recorded_by_tokens"][ROUTES_KEY], layout)
        mask = batch["response_mask"].bool()
        with torch.no_grad():
            expected = hf.outputs(batch, run["routes"])
        for key in ("log_probs", "entropy"):
            assert (run["forced"][key] - expected[key])[mask].abs().max() <= 1e-5, (layout, key)
            assert (run["replayed"][key] - run["plain"][key])[mask].abs().max() <= 1e-5, (layout, key)
    losses, changed, norm = forced_update_reference(hf, batches, {run["dp_rank"]: run["routes"] for run in runs})
    for run in runs:
        assert run["first"]["actor/loss"] == pytest.approx(losses[run["dp_rank"]], rel=1e-5), layout
        assert run["first"]["actor/routes_changed"] == pytest.approx(changed[run["dp_rank"]], rel=1e-6), layout
        assert run["first"]["actor/grad_norm"] == pytest.approx(norm, rel=1e-4), layout


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("family, message", [
    (None, "this model has no experts"),
    ("olmoe", "its olmoe routers are not among those the FSDP engine replays (qwen2_moe, qwen3_moe"),
])
def test_router_replay_on_a_model_it_cannot_replay_is_refused_at_start(tiny_model_dir, tmp_path, family, message):
    from transformers import OlmoeConfig

    from hybrid_rl.config import ConfigError, check_model_limits, validate_config
    from hybrid_rl.main import compose_config

    model_dir = tiny_model_dir
    if family is not None:
        OlmoeConfig(num_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)
        model_dir = str(tmp_path)
    cfg = validate_config(compose_config(["trainer.device=cpu", "actor_rollout_ref.actor.router_replay.mode=R2"]))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_model_limits(cfg, model_dir)
