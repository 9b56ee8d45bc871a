"""DeepSeek-V3-shaped models (multi-head latent attention, sigmoid routing with a correction bias
among expert groups, a dense first layer, a shared expert) on the Megatron engine against the FSDP
engine (transformers' own DeepSeek-V3): equal log-probs, loss, grad norm and update, weights back
to the bit, exact resume, on two data-parallel ranks with EP=2, and with TP=2 (sequence parallel),
PP=2 (the dense layer on one stage, the MoE layer on the other), CP=2 and TP=2 read from a
converted dist-checkpoint against one FSDP process. A second model covers the other settings:
no query latent (one q_proj), two expert groups, a routing scale of 2.5, YaRN rotary and a
checkpoint that rotates halves (rope_interleave=false); a third is DeepSeek-V2-shaped (softmax
routing, not renormalised, limited to the groups of the best experts)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

from hybrid_rl.engines import Output
from hybrid_rl.engines.megatron import convert
from hybrid_rl.engines.megatron.lora import LoraSettings
from hybrid_rl.export import export_checkpoint
from tests.conftest import LATENT_VARIANTS as VARIANTS, YARN
from tests.engine_helpers import (
    actor_config, export_step_folder, make_engine, rollout_batch, step, two_rank_results, weights,
)
from tests.test_megatron_dist_weights import convert as convert_to_mcore
from tests.test_megatron_experts import EXPERT_PARALLEL, run

pytestmark = pytest.mark.slow
LAYOUTS = ("tp", "pp", "cp", "tp_dist")


# LoRA from a peft adapter of the attention's projections (megatron-bridge's Moonlight targets:
# the latent projections, whole on every TP rank or split, and linear_proj).
LATENT_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LORA_LAYOUTS = {"lora_tp": ("deepseek_v3", dict(tp=2)), "lora_pp": ("deepseek_v3", dict(pp=2)),
                "lora_tp_halves": ("deepseek_v3_yarn", dict(tp=2))}


def latent_lora_adapter(model_dir: str, folder) -> str:
    """A peft adapter of the attention's projections, rank 4, both factors drawn (it changes the
    outputs from the start)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=list(LATENT_PROJECTIONS)))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.3 if ".lora_A." in name else 0.05))
    model.save_pretrained(folder)
    return str(folder)


def _rank_main(rank, world, init_file, model_dirs, mcore, adapters, out_dir):
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, model_dir in model_dirs.items():
        extra = EXPERT_PARALLEL if name == "deepseek_v3" else ()
        parallel_state.destroy_model_parallel()
        for strategy in ("fsdp2", "megatron"):
            folder = os.path.join(out_dir, f"{name}_{strategy}")
            os.makedirs(folder, exist_ok=True)
            results[name, strategy] = run(actor_config(strategy, extra=extra), model_dir, folder)
    dist_weights = ("actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                    f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={mcore}")
    layouts = {"tp": dict(tp=2), "pp": dict(pp=2), "cp": dict(cp=2), "tp_dist": dict(tp=2, extra=dist_weights)}
    for layout, sizes in layouts.items():
        parallel_state.destroy_model_parallel()
        cfg = actor_config("megatron", **sizes)
        engine = make_engine(cfg, model_dirs["deepseek_v3"])
        before = weights(engine)
        results[layout] = {"infer": engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None),
                           "first": step(engine, cfg, 1), "dp": engine.dp_size, "before": before,
                           "after": weights(engine), "checkpoint": os.path.join(out_dir, f"ckpt_{layout}")}
        engine.save_checkpoint(results[layout]["checkpoint"])
    for layout, (name, sizes) in LORA_LAYOUTS.items():
        parallel_state.destroy_model_parallel()
        cfg = actor_config("megatron", **sizes, extra=(f"actor_rollout_ref.model.lora.adapter_path={adapters[name]}",))
        engine = make_engine(cfg, model_dirs[name])
        with engine.adapter_disabled():
            base = engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
        results[layout] = {"base": base,
                           "infer": engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None),
                           "first": step(engine, cfg, 1), "after": weights(engine),
                           "trained": sorted(n for n, _ in engine.per_tensor_weights(None, only_trained=True)),
                           "checkpoint": os.path.join(out_dir, f"ckpt_{layout}")}
        engine.save_checkpoint(results[layout]["checkpoint"])
    # verl's default targets: linear_qkv names no layer of latent attention, which a warning says.
    parallel_state.destroy_model_parallel()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hybrid_rl.engines.megatron.lora").addHandler(handler)
    make_engine(actor_config("megatron", extra=("actor_rollout_ref.model.lora.rank=4",)), model_dirs["deepseek_v3"])
    results["default_targets_warnings"] = [record.getMessage() for record in records]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def latent_adapters(tiny_latent_model_dirs, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("latent_adapters")
    return {name: latent_lora_adapter(tiny_latent_model_dirs[name], out / name) for name, _ in LORA_LAYOUTS.values()}


@pytest.fixture(scope="module")
def latent_runs(tiny_latent_model_dirs, latent_adapters, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("megatron_latent")
    mcore = convert_to_mcore(tiny_latent_model_dirs["deepseek_v3"], str(out / "mcore"))
    return two_rank_results(_rank_main, out, tiny_latent_model_dirs, mcore, latent_adapters)


@pytest.mark.parametrize("name", VARIANTS)
def test_latent_attention_megatron_matches_fsdp(latent_runs, name):
    for rank, runs in enumerate(latent_runs):
        fsdp, megatron = runs[name, "fsdp2"], runs[name, "megatron"]
        assert megatron["dp"] == fsdp["dp"] == 2
        mask = rollout_batch(1 + 100 * rank, rows=4)["response_mask"].bool()
        for key in ("log_probs", "entropy"):
            assert (megatron["infer"][key] - fsdp["infer"][key])[mask].abs().max() <= 1e-5
        # HF -> Megatron -> HF is exact: latent projections, the routers' correction bias, the
        # dense first layer, the shared and the stacked experts under transformers' names.
        assert set(megatron["before"]) == set(fsdp["before"])
        assert {"model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.shared_experts.gate_proj.weight",
                "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"} <= set(fsdp["before"])
        assert all(torch.equal(megatron["before"][k], fsdp["before"][k]) for k in fsdp["before"])
        for key in ("actor/loss", "actor/grad_norm"):
            assert megatron["first"][key] == pytest.approx(fsdp["first"][key], rel=1e-4)
        update = torch.cat([(megatron["after"][k] - megatron["before"][k]).flatten() for k in fsdp["after"]])
        expected = torch.cat([(fsdp["after"][k] - fsdp["before"][k]).flatten() for k in fsdp["after"]])
        assert (update - expected).norm() / expected.norm() <= 1e-3
        # transformers holds DeepSeek-V3's correction bias fixed, and so does the engine.
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert (bias in fsdp["before"]) == (VARIANTS[name][0] == "deepseek_v3")
        assert bias not in fsdp["before"] or torch.equal(megatron["after"][bias], megatron["before"][bias])
        assert megatron["resumed"] == megatron["second"]
        assert megatron["params"] == fsdp["params"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_latent_attention_layouts_match_one_fsdp_process(latent_runs, tiny_latent_model_dirs, layout):
    cfg = actor_config("fsdp2")
    fsdp = make_engine(cfg, tiny_latent_model_dirs["deepseek_v3"])
    expected_infer = fsdp.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    before, expected = weights(fsdp), step(fsdp, cfg, 1)
    expected_after = weights(fsdp)
    mask = rollout_batch(1)["response_mask"].bool()
    for runs in latent_runs:
        result = runs[layout]
        assert result["dp"] == 1
        assert all(torch.equal(result["before"][k], before[k]) for k in before)
        for key in ("log_probs", "entropy"):
            assert (result["infer"][key] - expected_infer[key])[mask].abs().max() <= 1e-5
        assert result["first"]["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-5)
        if "actor/loss" in result["first"]:  # the last pipeline stage's
            assert result["first"]["actor/loss"] == pytest.approx(expected["actor/loss"], rel=1e-5)
        for name in expected_after:
            update = result["after"][name] - before[name]
            expected_update = expected_after[name] - before[name]
            assert (update - expected_update).norm() <= 1e-3 * expected_update.norm() + 1e-9, name


@pytest.mark.parametrize("layout", ("tp", "pp"))
def test_a_trained_latent_attention_checkpoint_exports_to_transformers(latent_runs, tiny_latent_model_dirs, layout,
                                                                       tmp_path):
    from transformers import AutoModelForCausalLM

    run = latent_runs[0][layout]
    step_dir = export_step_folder(run["checkpoint"], tiny_latent_model_dirs["deepseek_v3"], tmp_path / "global_step_1")
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(str(step_dir), str(tmp_path / "hf")),
                                                    dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in run["after"].items())


@pytest.mark.parametrize("layout", LORA_LAYOUTS)
def test_lora_on_latent_attention_matches_peft_on_the_fsdp_engine(latent_runs, latent_adapters, tiny_latent_model_dirs,
                                                                   layout, tmp_path):
    """LoRA on latent attention's projections (verl's model.lora.* from a peft adapter folder) with
    TP=2 (the down projections' adapters whole on each rank, over its part of the sequence) or
    PP=2, and with a checkpoint that rotates halves, against peft's LoRA of the same adapter on the
    FSDP engine: log-probs, loss, grad norm and the merged weights after one step; with the
    adapter off, the base model; the checkpoint exports merged and as peft's adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name = LORA_LAYOUTS[layout][0]
    model_dir = tiny_latent_model_dirs[name]
    cfg = actor_config("fsdp2", extra=[f"actor_rollout_ref.model.lora_adapter_path={latent_adapters[name]}"])
    fsdp = make_engine(cfg, model_dir)
    before, expected_infer = weights(fsdp), fsdp.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    with fsdp.adapter_disabled():
        expected_base = fsdp.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    expected, expected_after = step(fsdp, cfg, 1), weights(fsdp)
    mask = rollout_batch(1)["response_mask"].bool()
    for result in (runs[layout] for runs in latent_runs):
        assert (result["infer"]["log_probs"] - result["base"]["log_probs"])[mask].abs().max() > 0.01
        for key in ("log_probs", "entropy"):
            assert (result["infer"][key] - expected_infer[key])[mask].abs().max() <= 1e-5
            assert (result["base"][key] - expected_base[key])[mask].abs().max() <= 1e-5
        assert result["first"]["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-4)
        if "actor/loss" in result["first"]:  # the last pipeline stage's
            assert result["first"]["actor/loss"] == pytest.approx(expected["actor/loss"], rel=1e-4)
        update = torch.cat([(result["after"][k] - before[k]).flatten() for k in expected_after])
        expected_update = torch.cat([(expected_after[k] - before[k]).flatten() for k in expected_after])
        assert (update - expected_update).norm() / expected_update.norm() <= 1e-3
        # Only the adapted projections change (the rollout gets those alone).
        assert result["trained"] and {n.rsplit(".", 2)[-2] for n in result["trained"]} <= set(LATENT_PROJECTIONS)
    run = latent_runs[0][layout]
    step_dir = export_step_folder(run["checkpoint"], model_dir, tmp_path / "global_step_1")
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(str(step_dir), str(tmp_path / "merged")),
                                                  dtype=torch.float32).state_dict()
    adapter = export_checkpoint(str(step_dir), str(tmp_path / "adapter"), adapter_only=True)
    from_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                             adapter).merge_and_unload().state_dict()
    for state in (merged, from_adapter):
        assert all((state[k] - run["after"][k]).abs().max() <= 1e-6 for k in run["after"])


def test_verls_default_lora_targets_on_latent_attention_warn_of_linear_qkv(latent_runs):
    """verl's default target_modules on a DeepSeek-V3 model: linear_proj and the MLPs are adapted,
    and rank 0 warns that linear_qkv names nothing, listing the model's linear layers."""
    (warning,) = latent_runs[0]["default_targets_warnings"]
    assert "target_modules: ['linear_qkv'] adapt nothing in this model" in warning
    assert "linear_kv_down_proj" in warning and "linear_q_up_proj" in warning
    assert latent_runs[1]["default_targets_warnings"] == []


def test_unmatched_lora_targets_count_wildcards_and_projection_names():
    settings = LoraSettings(4, 8.0, ("linear_qkv", "linear_kv_down_proj", "*.layers.1.*.linear_proj", "*.layers.7.*"),
                            (), "xavier", "zero", None)
    names = ["decoder.layers.0.self_attention.linear_kv_down_proj", "decoder.layers.1.self_attention.linear_proj"]
    assert settings.unmatched_targets(names) == ["linear_qkv", "*.layers.7.*"]


@pytest.mark.parametrize("name", VARIANTS)
def test_a_converted_latent_attention_checkpoint_reads_back_as_transformers_weights(tiny_latent_model_dirs, name,
                                                                                    tmp_path):
    """megatron keys the layers of a model with dense and MoE layers one by one
    (`decoder.layers.N.*`); they read back to transformers' weights to the bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid_rl.export import read_model_state

    model_dir = tiny_latent_model_dirs[name]
    tensors = read_model_state(convert_to_mcore(model_dir, str(tmp_path / "mcore")))
    assert ("decoder.layers.1.mlp.router.expert_bias" in tensors) == (VARIANTS[name][0] == "deepseek_v3")
    state = convert.hf_state_from_dist_checkpoint(tensors, convert.Layout.from_hf_config(
        AutoConfig.from_pretrained(model_dir)))
    expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[key], expected[key]) for key in state)


def test_rotary_rows_of_a_halves_checkpoint_are_interleaved_for_megatron():
    """megatron's latent attention pairs neighbouring rotary dimensions: a checkpoint rotating
    halves has its last `rope` rows of each head (4 rotary of 6) put in pair order."""
    latent = convert.LatentAttention(q_rank=None, kv_rank=8, nope=2, rope=4, value=2, interleaved=False)
    assert latent.interleaving_order(12, 6).tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


@pytest.mark.parametrize("settings, overrides, expected", [
    ({}, ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
          "actor_rollout_ref.actor.megatron.sequence_parallel=false"),
     "tensor_model_parallel_size=2 with sequence_parallel=false: the engine runs latent attention"),
    (dict(norm_topk_prob=False), (), "norm_topk_prob=false"),
    (dict(n_group=2, topk_group=2), (), "scores a group by its best top_k / topk_group"),
    (dict(rope_scaling={**YARN, "attention_factor": 1.3}), (), "YaRN setting attention_factor"),
])
def test_latent_models_the_engine_cannot_reproduce_are_refused_at_start(tmp_path, settings, overrides, expected):
    from transformers import DeepseekV3Config

    from hybrid_rl.config import ConfigError, check_model_limits, validate_config
    from hybrid_rl.main import compose_config

    base = dict(vocab_size=318, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    DeepseekV3Config(**{**base, **settings}, architectures=["DeepseekV3ForCausalLM"]).save_pretrained(tmp_path)
    cfg = validate_config(compose_config([
        "trainer.n_gpus_per_node=2", "trainer.device=cpu", "data.train_batch_size=6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6", *overrides], config_name="ppo_megatron_trainer"))
    with pytest.raises(ConfigError, match=expected):
        check_model_limits(cfg, str(tmp_path))


def test_a_deepseek_v2_model_megatron_would_route_otherwise_is_refused(tmp_path):
    """transformers' DeepSeek-V2 scores an expert group by its best expert; megatron by the sum of
    its best top_k / topk_group, the same only when that is 1."""
    from transformers import AutoConfig, DeepseekV2Config

    DeepseekV2Config(vocab_size=318, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4,
                     num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                     architectures=["DeepseekV2ForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="by their best 1 expert"):
        convert.Layout.from_hf_config(AutoConfig.from_pretrained(tmp_path))
