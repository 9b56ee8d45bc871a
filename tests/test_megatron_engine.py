"""The Megatron engine against the FSDP engine on the same model, batch and seed (TP=2 with and
without sequence parallelism, PP=2 with and without virtual stages, CP=2 over two gloo ranks): equal log-probs, loss, grad norm
and weight update; a resumed engine continues exactly; the data-parallel dispatch layout; what
the engine refuses at start."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoConfig

from hybrid_rl.algorithms import sum_pi_squared_from_logits
from hybrid_rl.controller.decorator import RankLayout, output_ranks, split_by_layout
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from hybrid_rl.export import export_checkpoint
from hybrid_rl.main import compose_config
from hybrid_rl.protocol import Batch
from tests.conftest import build_tiny_model
from tests.engine_helpers import (actor_config, export_step_folder, make_engine, offloaded, rollout_batch, step,
                                  value_loss_fn, weights)

pytestmark = pytest.mark.slow

# A micro-batch's 15 response positions in 4 chunks of the LM head (the last one short).
SMALL_HEAD_CHUNKS = ("actor_rollout_ref.model.head_chunk_size=4",)
RECOMPUTE = ("actor_rollout_ref.model.enable_gradient_checkpointing=true",)
NO_SEQUENCE_PARALLEL = ("actor_rollout_ref.actor.megatron.sequence_parallel=false",)


def actor_part(inputs: dict, out_dir: str, tp: int, pp: int, cp: int, vpp: int | None) -> dict:
    cfg = actor_config("megatron", tp, pp, extra=SMALL_HEAD_CHUNKS, cp=cp, vpp=vpp)
    engine = make_engine(cfg, inputs["model"])
    infer = engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    sum_pi_squared = engine.infer(rollout_batch(1), Output.LOG_PROBS_SUM_PI_SQUARED, 0.7, 3, None)
    before = weights(engine)
    first = step(engine, cfg, 1)
    after = weights(engine)
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
    second, second_weights = step(engine, cfg, 2), weights(engine)
    resumed = make_engine(cfg, inputs["model"])
    resumed.load_checkpoint(os.path.join(out_dir, "ckpt"))
    resumed_second, resumed_weights = step(resumed, cfg, 2), weights(resumed)
    # checkpoint.load_contents=[model]: the saved weights with a fresh optimizer and schedule, as an
    # engine built from a Hugging Face folder of those weights has them.
    weights_only = make_engine(cfg, inputs["model"])
    weights_only.load_checkpoint(os.path.join(out_dir, "ckpt"), parts=("model",))
    loaded, hf_dir = weights(weights_only), os.path.join(out_dir, "after_hf")
    weights_only.save_hf_model(hf_dir, AutoConfig.from_pretrained(inputs["model"]))
    dist.barrier()  # (rank 0 writes it)
    from_hf = make_engine(cfg, hf_dir)
    model_only = (loaded, step(weights_only, cfg, 2), weights(weights_only), step(from_hf, cfg, 2), weights(from_hf))
    # enable_gradient_checkpointing: megatron's recomputation of every layer in the backward pass.
    cfg = actor_config("megatron", tp, pp, extra=SMALL_HEAD_CHUNKS + RECOMPUTE, cp=cp, vpp=vpp)
    recomputing = make_engine(cfg, inputs["model"])
    recomputed = (step(recomputing, cfg, 1), weights(recomputing), recomputing.config.recompute_granularity)
    # Under TP, sequence parallelism (verl's default) above; whole sequences on every TP rank here.
    whole = None
    if tp > 1:
        cfg = actor_config("megatron", tp, pp, extra=SMALL_HEAD_CHUNKS + NO_SEQUENCE_PARALLEL, cp=cp)
        plain = make_engine(cfg, inputs["model"])
        whole = (plain.config.sequence_parallel, plain.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None),
                 step(plain, cfg, 1), weights(plain))
    return {"output": engine.is_output_rank, "dp": (engine.dp_rank, engine.dp_size), "infer": infer,
            "before": before, "after": after, "first": first, "second": (second, second_weights),
            "resumed": (resumed_second, resumed_weights), "model_only": model_only, "recomputed": recomputed,
            "sequence_parallel": engine.config.sequence_parallel, "whole_sequences": whole,
            "sum_pi_squared": sum_pi_squared}


def lora_part(inputs: dict, out_dir: str, tp: int, pp: int, cp: int, vpp: int | None) -> dict:
    """LoRA on the Megatron engine (verl's model.lora.*), starting from a peft adapter folder."""
    lora = (f"actor_rollout_ref.model.lora.adapter_path={inputs['lora_adapter']}",)
    cfg = actor_config("megatron", tp, pp, extra=SMALL_HEAD_CHUNKS + lora, cp=cp, vpp=vpp)
    engine = make_engine(cfg, inputs["model"])
    infer = engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    with engine.adapter_disabled():
        base = engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    first, after = step(engine, cfg, 1), weights(engine)
    trained = sorted(name for name, _ in engine.per_tensor_weights(None, only_trained=True))
    folder = os.path.join(out_dir, "lora_ckpt")
    engine.save_checkpoint(folder)
    second = (step(engine, cfg, 2), weights(engine))
    resumed = make_engine(cfg, inputs["model"])
    resumed.load_checkpoint(folder)
    resumed_second = (step(resumed, cfg, 2), weights(resumed))
    whole = None
    if tp > 1:  # the adapters' exchanges without sequence parallelism
        cfg = actor_config("megatron", tp, pp, extra=SMALL_HEAD_CHUNKS + lora + NO_SEQUENCE_PARALLEL, cp=cp)
        plain = make_engine(cfg, inputs["model"])
        whole = (plain.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None), step(plain, cfg, 1),
                 weights(plain))
    # lora.dropout in both positions (under TP without sequence parallelism, where the column
    # adapters' input and the row adapters' output are the same on both TP ranks).
    dropped = {}
    for position in ("pre", "post"):
        extra = SMALL_HEAD_CHUNKS + lora + (NO_SEQUENCE_PARALLEL if tp > 1 else ()) + (
            "actor_rollout_ref.model.lora.dropout=0.5", f"actor_rollout_ref.model.lora.dropout_position={position}")
        cfg = actor_config("megatron", tp, pp, extra=extra, cp=cp, vpp=vpp)
        dropping = make_engine(cfg, inputs["model"])
        dropped[position] = (dropping.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None),
                             step(dropping, cfg, 1),
                             {n: p.detach().clone() for m in dropping.models for n, p in m.named_parameters()
                              if "_adapter.lora_" in n})
    # canonical_lora: each projection its own adapter, as peft's of the HF model.
    model, adapter = inputs["canonical_lora"]
    cfg = actor_config("megatron", tp, pp, cp=cp, vpp=vpp, extra=SMALL_HEAD_CHUNKS + (
        f"actor_rollout_ref.model.lora.adapter_path={adapter}", "actor_rollout_ref.model.lora.type=canonical_lora"))
    canonical_engine = make_engine(cfg, model)
    canonical = (canonical_engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None),
                 step(canonical_engine, cfg, 1), weights(canonical_engine), os.path.join(out_dir, "canonical_ckpt"))
    canonical_engine.save_checkpoint(canonical[3])
    try:
        make_engine(actor_config("megatron", tp, pp, extra=("actor_rollout_ref.model.lora.rank=4",
                                                            "actor_rollout_ref.model.lora.target_modules=[dense]"),
                                 cp=cp, vpp=vpp), inputs["model"])
        unmatched = None
    except ValueError as exc:
        unmatched = str(exc)
    # A target of one layer only: under PP the other stage has nothing to adapt, and that is fine.
    first_layer = make_engine(actor_config("megatron", tp, pp, cp=cp, vpp=vpp, extra=(
        "actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.target_modules=['*.layers.0.*']")),
        inputs["model"]).adapters.adapted_weights()
    return {"output": engine.is_output_rank, "infer": infer, "base": base, "first": first, "after": after,
            "trained": trained, "checkpoint": folder, "second": second, "resumed": resumed_second,
            "whole_sequences": whole, "unmatched": unmatched, "canonical": canonical, "first_layer": first_layer,
            "dropout": dropped}


def actor_bf16_part(inputs: dict, out_dir: str, tp: int, pp: int, cp: int, vpp: int | None) -> dict:
    cfg = actor_config("megatron", tp, pp, extra=SMALL_HEAD_CHUNKS, dtype="bf16", cp=cp, vpp=vpp)
    engine = make_engine(cfg, inputs["model"])
    infer = engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    return {"infer": infer, "first": step(engine, cfg, 1), "dtype": engine.config.params_dtype}


@pytest.fixture(scope="module")
def tiny_model_dir4(tmp_path_factory, tiny_tokenizer):
    return build_tiny_model(tmp_path_factory.mktemp("four_layers"), tiny_tokenizer, num_layers=4, rope_theta=1e5)


def test_megatron_engine_matches_fsdp_and_resumes_exactly(megatron_layout, tiny_model_dir4):
    cfg = actor_config("fsdp2")
    fsdp = make_engine(cfg, tiny_model_dir4)
    expected_infer = fsdp.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    expected_sum_pi_squared = fsdp.infer(rollout_batch(1), Output.LOG_PROBS_SUM_PI_SQUARED, 0.7, 3, None)
    logits = fsdp.infer(rollout_batch(1), Output.LOGITS, 0.7, 3, None)["logits"]
    expected = step(fsdp, cfg, 1)
    expected_after = weights(fsdp)
    mask = rollout_batch(1)["response_mask"].bool()
    # The FSDP engine's chunked head: Σπ² of its own full logits, and the same log-probs.
    assert (expected_sum_pi_squared["sum_pi_squared"] - sum_pi_squared_from_logits(logits))[mask].abs().max() <= 1e-6
    assert torch.equal(expected_sum_pi_squared["log_probs"], expected_infer["log_probs"])
    results = megatron_layout.results("actor")
    assert [r["output"] for r in results] == ([True, False] if megatron_layout.pp == 1 else [False, True])
    assert all(r["dp"] == (0, 1) for r in results)
    # verl's default sequence_parallel=true splits the sequence over the TP ranks.
    assert all(r["sequence_parallel"] == (megatron_layout.tp > 1) for r in results)
    for result in results:
        for key in ("log_probs", "sum_pi_squared"):
            assert (result["sum_pi_squared"][key] - expected_sum_pi_squared[key])[mask].abs().max() <= 1e-5
        runs = [(result["infer"], result["first"], result["after"])]
        if result["whole_sequences"] is not None:
            sequence_parallel, *run = result["whole_sequences"]
            assert not sequence_parallel
            runs.append(run)
        for infer, first, after in runs:
            for key in ("log_probs", "entropy"):  # every rank of the replica returns the outputs
                assert (infer[key] - expected_infer[key])[mask].abs().max() <= 1e-5
            assert set(after) == set(expected_after)  # the tied lm_head.weight included, as vLLM needs
            update = torch.cat([(after[k] - result["before"][k]).flatten() for k in after])
            expected_update = torch.cat([(expected_after[k] - result["before"][k]).flatten() for k in after])
            # Adam's first step is about lr x sign(grad): float noise shows only where |grad| ~ eps.
            assert (update - expected_update).norm() / expected_update.norm() <= 1e-3
            assert first["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-4)
        second, second_weights = result["second"]
        resumed, resumed_weights = result["resumed"]
        assert resumed == second
        assert all(torch.equal(second_weights[k], resumed_weights[k]) for k in second_weights)
        # A load of the weights alone: those saved, then the update a fresh optimizer makes from
        # them (not the resumed one, whose Adam moments carry over).
        loaded, model_only, model_only_weights, from_hf, from_hf_weights = result["model_only"]
        assert all(torch.equal(loaded[k], result["after"][k]) for k in loaded)
        assert model_only == from_hf  # (the same loss and gradient norm as the resumed step: the same weights)
        assert all(torch.equal(model_only_weights[k], from_hf_weights[k]) for k in from_hf_weights)
        assert any(not torch.equal(model_only_weights[k], second_weights[k]) for k in second_weights)
        recomputed, recomputed_weights, granularity = result["recomputed"]
        assert granularity == "full" and recomputed == result["first"]
        assert all(torch.equal(recomputed_weights[k], result["after"][k]) for k in recomputed_weights)
    loss = next(r["first"] for r in results if r["output"])["actor/loss"]
    assert loss == pytest.approx(expected["actor/loss"], rel=1e-4)


FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
         ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


def lora_adapter_folder(model_dir: str, folder, shared_a: bool) -> str:
    """A peft adapter of every projection, rank 4, B not zero (so it changes outputs); with
    `shared_a` query, key and value (and gate and up) share A, as one adapter of a fused Megatron
    layer does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[
        name for _, names in FUSED for name in names]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            for block, names in FUSED:
                modules = [getattr(getattr(layer, block), name) for name in names]
                a = torch.randn(modules[0].lora_A["default"].weight.shape, generator=g) * 0.3
                for module in modules:
                    module.lora_A["default"].weight.copy_(a if shared_a else torch.randn(a.shape, generator=g) * 0.3)
                    b = module.lora_B["default"].weight
                    b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    peft_model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def fused_lora_adapter(tiny_model_dir4, tmp_path_factory) -> str:
    return lora_adapter_folder(tiny_model_dir4, tmp_path_factory.mktemp("fused_lora"), shared_a=True)


@pytest.fixture(scope="module")
def canonical_lora_adapter(tiny_tokenizer, tmp_path_factory) -> tuple[str, str]:
    """(model, adapter): 4 heads in 2 query groups, so that TP=2 splits whole groups, as
    canonical_lora needs."""
    model = build_tiny_model(tmp_path_factory.mktemp("four_layers_kv2"), tiny_tokenizer, num_layers=4,
                             rope_theta=1e5, heads=4, kv_heads=2)
    return model, lora_adapter_folder(model, tmp_path_factory.mktemp("canonical_lora"), shared_a=False)


def fused_lora_reference(model_dir: str, adapter: str) -> dict:
    """The fused adapter computed by hand in one process: peft's layers with one shared A
    parameter per fused group, the test loss over the whole batch (one mini-batch), the global
    gradient norm clipped to 1 and one AdamW step, then W + scaling x B A for every weight."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    for layer in model.model.layers:
        for block, names in FUSED:
            first, *others = [getattr(getattr(layer, block), name) for name in names]
            for other in others:
                other.lora_A["default"].weight = first.lora_A["default"].weight
    batch = rollout_batch(1)
    prompt = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, prompt - 1:-1] / 0.7
    log_probs_all = logits.log_softmax(-1)
    log_probs = log_probs_all.gather(-1, batch["responses"][..., None])[..., 0]
    entropy = -(log_probs_all.exp() * log_probs_all).sum(-1)
    mask = batch["response_mask"]
    loss = -((log_probs * batch["advantages"] + 0.01 * entropy) * mask).sum() / mask.sum()
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]  # each shared A once
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    with torch.no_grad():
        after = dict(peft_model.merge_and_unload().state_dict())
    after["lm_head.weight"] = after["model.embed_tokens.weight"]
    return {"log_probs": log_probs.detach(), "entropy": entropy.detach(), "loss": float(loss.detach()), "grad_norm": float(norm),
            "after": after}


def test_megatron_lora_computes_the_fused_adapter_exactly_and_resumes(megatron_layout, tiny_model_dir4,
                                                                     fused_lora_adapter, tmp_path):
    """verl's model.lora.* on the Megatron engine against the same adapter computed by hand, in
    every layout (under TP with and without sequence parallelism): log-probs, gradient norm and
    the merged weights after one step; the adapters off give the base model (the reference
    policy); only the adapted weights are synced as trained; a resumed run continues exactly from
    a checkpoint of the adapters alone, which exports merged or as a peft adapter."""
    from torch.distributed.checkpoint import FileSystemReader

    expected = fused_lora_reference(tiny_model_dir4, fused_lora_adapter)
    base = make_engine(actor_config("fsdp2"), tiny_model_dir4).infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7,
                                                                     3, None)
    mask = rollout_batch(1)["response_mask"].bool()
    before = {name: t for name, t in weights(make_engine(actor_config("fsdp2"), tiny_model_dir4)).items()}
    adapted = sorted(f"model.layers.{i}.{block}.{name}.weight" for i in range(4) for block, names in FUSED
                     for name in names)
    results = megatron_layout.results("lora")
    for result in results:
        assert (result["base"]["log_probs"] - base["log_probs"])[mask].abs().max() <= 1e-5
        assert (result["infer"]["log_probs"] - base["log_probs"])[mask].abs().max() > 0.05  # the adapter acts
        assert result["trained"] == adapted
        runs = [(result["infer"], result["first"], result["after"])]
        if result["whole_sequences"] is not None:
            runs.append(result["whole_sequences"])
        for infer, first, after in runs:
            for key in ("log_probs", "entropy"):
                assert (infer[key] - expected[key])[mask].abs().max() <= 1e-5
            assert first["actor/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
            assert set(after) == set(expected["after"])
            update = torch.cat([(after[k] - before[k]).flatten() for k in adapted])
            expected_update = torch.cat([(expected["after"][k] - before[k]).flatten() for k in adapted])
            assert (update - expected_update).norm() / expected_update.norm() <= 1e-3
            assert all(torch.equal(after[k], before[k]) for k in after if k not in adapted)  # the base is frozen
        assert result["resumed"][0] == result["second"][0]
        assert all(torch.equal(result["second"][1][k], result["resumed"][1][k]) for k in result["second"][1])
        assert "target_modules=['dense']" in result["unmatched"] and "linear_qkv" in result["unmatched"]
    assert set().union(*(r["first_layer"] for r in results)) == {
        f"decoder.layers.0.{name}.weight" for name in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                       "mlp.linear_fc1", "mlp.linear_fc2")}
    loss = next(r["first"] for r in results if r["output"])["actor/loss"]
    assert loss == pytest.approx(expected["loss"], rel=1e-4)
    model_tensors = [key for key in FileSystemReader(results[0]["checkpoint"]).read_metadata().state_dict_metadata
                     if not key.startswith("optimizer")]
    assert model_tensors and all("_adapter.lora_" in key for key in model_tensors)
    # hybrid-rl-export of that checkpoint (taken after the first step): merged, and the adapter
    # alone for peft, as for the FSDP engine's LoRA.
    step_dir = export_step_folder(results[0]["checkpoint"], tiny_model_dir4, tmp_path / "global_step_1")
    merged = load_file(os.path.join(export_checkpoint(str(step_dir), str(tmp_path / "merged")), "model.safetensors"))
    after = results[0]["after"]
    assert all((merged[k] - after[k]).abs().max() <= 1e-6 for k in merged) and set(merged) <= set(after)
    adapter_dir = export_checkpoint(str(step_dir), str(tmp_path / "adapter"), adapter_only=True)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir4, dtype=torch.float32),
                                           adapter_dir)
    state = peft_model.merge_and_unload().state_dict()
    assert all((state[k] - after[k]).abs().max() <= 1e-6 for k in adapted)


def test_megatron_lora_dropout_acts_in_training_only_and_keeps_tp_ranks_alike(megatron_layout):
    """lora.dropout (0.5, before or after the adapter): log-prob passes run without it (the same
    log-probs as the adapter without dropout), the update changes; an adapter factor every rank
    holds whole stays the same on both ranks after the step (TP=2 without sequence parallelism:
    the column adapters' A and the row adapters' B see the same input or output on both ranks and
    must drop the same elements; CP=2: replicas)."""
    results = megatron_layout.results("lora")
    mask = rollout_batch(1)["response_mask"].bool()
    for result in results:
        for position, (infer, first, _) in result["dropout"].items():
            assert (infer["log_probs"] - result["infer"]["log_probs"])[mask].abs().max() <= 1e-5, position
            assert abs(first["actor/grad_norm"] / result["first"]["actor/grad_norm"] - 1) > 1e-3, position
    if megatron_layout.pp > 1:
        return  # the two ranks hold different layers
    for position in ("pre", "post"):
        mine, theirs = (r["dropout"][position][2] for r in results)
        whole = [n for n in mine if megatron_layout.tp == 1 or n.endswith(
            ("linear_qkv_adapter.lora_A", "linear_fc1_adapter.lora_A", "linear_proj_adapter.lora_B",
             "linear_fc2_adapter.lora_B"))]
        assert whole and all(torch.equal(mine[n], theirs[n]) for n in whole), position


def test_megatron_canonical_lora_matches_peft_on_the_fsdp_engine(megatron_layout, canonical_lora_adapter, tmp_path):
    """lora.type=canonical_lora (one adapter per projection of a fused layer) from a peft adapter
    folder against peft's LoRA of the same folder on the FSDP engine, in every layout: log-probs,
    gradient norm, loss and the merged weights after one step; its checkpoint exports as peft's
    adapter, each projection's A its own."""
    model, adapter = canonical_lora_adapter
    cfg = actor_config("fsdp2", extra=[f"actor_rollout_ref.model.lora_adapter_path={adapter}"])
    fsdp = make_engine(cfg, model)
    before = weights(fsdp)
    expected_infer = fsdp.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    expected, expected_after = step(fsdp, cfg, 1), weights(fsdp)
    mask = rollout_batch(1)["response_mask"].bool()
    results = megatron_layout.results("lora")
    for result in results:
        infer, first, after, _ = result["canonical"]
        for key in ("log_probs", "entropy"):
            assert (infer[key] - expected_infer[key])[mask].abs().max() <= 1e-5
        assert first["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-4)
        update = torch.cat([(after[k] - before[k]).flatten() for k in expected_after])
        expected_update = torch.cat([(expected_after[k] - before[k]).flatten() for k in expected_after])
        assert (update - expected_update).norm() / expected_update.norm() <= 1e-3
    loss = next(r["canonical"][1] for r in results if r["output"])["actor/loss"]
    assert loss == pytest.approx(expected["actor/loss"], rel=1e-4)
    step_dir = export_step_folder(results[0]["canonical"][3], model, tmp_path / "global_step_1")
    adapter_dir = export_checkpoint(str(step_dir), str(tmp_path / "adapter"), adapter_only=True)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), adapter_dir)
    merged = exported.merge_and_unload().state_dict()
    assert all((merged[k] - results[0]["canonical"][2][k]).abs().max() <= 1e-6 for k in merged)


def test_megatron_engine_trains_in_bf16(megatron_layout, tiny_model_dir4):
    """Half precision as on GPUs and bf16 CPUs (megatron's Float16Module over fp32 optimizer
    masters): close to the fp32 FSDP engine within bf16's resolution; with PP the activations
    pass between stages in bf16."""
    cfg = actor_config("fsdp2")
    fsdp = make_engine(cfg, tiny_model_dir4)
    expected_infer = fsdp.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
    expected = step(fsdp, cfg, 1)
    mask = rollout_batch(1)["response_mask"].bool()
    for result in megatron_layout.results("actor_bf16"):
        assert result["dtype"] == torch.bfloat16
        diff = (result["infer"]["log_probs"] - expected_infer["log_probs"])[mask].abs().max()
        assert 0 < diff <= 0.1  # bf16 weights and activations, not fp32 ones
        assert result["first"]["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=0.05)


def _offload_rank_main(rank, world, init_file, model_dir, out_dir, dtype, distributed):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = actor_config("megatron", dtype=dtype,
                       extra=[f"actor_rollout_ref.actor.megatron.use_distributed_optimizer={distributed}"])
    runs = {}
    for offload in (False, True):
        engine = make_engine(cfg, model_dir)
        if offload:  # what the engine does on a GPU with param_offload, optimizer_offload, grad_offload
            engine.offload_params = engine.offload_optimizer = engine.offload_grads = True
            engine._place(False, True, True, True)
        first = step(engine, cfg, 1)
        away_after_update = offloaded(engine)
        engine.save_checkpoint(os.path.join(out_dir, f"ckpt{offload}"))
        engine.load_checkpoint(os.path.join(out_dir, f"ckpt{offload}"))
        infer = engine.infer(rollout_batch(3), Output.LOG_PROBS, 0.7, 3, None)
        runs[offload] = {"first": first, "second": step(engine, cfg, 2), "infer": infer, "after": weights(engine),
                         "away": (away_after_update, offloaded(engine))}
    torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype, distributed", [("fp32", True), ("bf16", False)])
def test_megatron_offload_frees_the_memory_between_uses_and_changes_no_number(tiny_model_dir4, dtype, distributed):
    """verl's param_offload / optimizer_offload / grad_offload (a GPU feature; the mechanism is
    the same on the CPU): between uses the weights, Adam's state and the gradient buffers hold no
    memory, and every update, checkpoint, forward and weight export computes what a resident
    engine does. Two data-parallel ranks: the distributed optimizer's shards are views of float32
    weights; the bf16 engine's float32 masters are copies."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_offload_rank_main,
                           args=(2, os.path.join(out_dir, "init"), tiny_model_dir4, out_dir, dtype, distributed),
                           nprocs=2, start_method="spawn")
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    everything = {"params": True, "moments": True, "grads": True}
    for runs in results:
        assert runs[True]["away"] == (everything, everything)
        assert not any(runs[False]["away"][0].values())
        for key in ("first", "second"):
            assert runs[True][key] == runs[False][key]
        assert torch.equal(runs[True]["infer"]["log_probs"], runs[False]["infer"]["log_probs"])
        assert all(torch.equal(runs[True]["after"][k], runs[False]["after"][k]) for k in runs[False]["after"])


def log_prob_change(engine, cfg) -> float:
    """How far one update moves the log-probs of the batch it trained on."""
    before = engine.infer(rollout_batch(1), Output.LOG_PROBS, 0.7, 3, None)["log_probs"]
    step(engine, cfg, 1)
    after = engine.infer(rollout_batch(1), Output.LOG_PROBS, 0.7, 3, None)["log_probs"]
    return float((after - before)[rollout_batch(1)["response_mask"].bool()].abs().max())


SMALL_LR = ("actor_rollout_ref.actor.optim.lr=1e-5",)  # Adam's first step: 1e-5, far below a bf16 rounding step


def _main_weights_rank_main(rank, model_dir, dist_checkpoint, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=1)
    changes = {}
    from_dist_checkpoint = ("actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                            f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={dist_checkpoint}")
    for name, extra in (("distributed optimizer", ()),
                        ("megatron's other optimizer", ("actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",)),
                        ("from a dist-checkpoint", from_dist_checkpoint)):
        cfg = actor_config("megatron", dtype="bf16", extra=SMALL_LR + extra)
        changes[name] = log_prob_change(make_engine(cfg, model_dir), cfg)
    torch.save(changes, os.path.join(out_dir, "changes.pt"))
    dist.destroy_process_group()


def test_megatron_bf16_main_weights_start_from_the_checkpoints_values(tiny_model_dir4, tmp_path):
    """bf16 weights, float32 main weights (both optimizers, and from a float32 dist-checkpoint):
    the main weights hold the float32 checkpoint's values, not their bf16 rounding, so a small
    first update moves the policy as much as the FSDP engine's (whose float32 weights are the
    checkpoint's); from rounded main weights it moved it 5x less."""
    from tests.test_megatron_dist_weights import convert as convert_to_mcore

    cfg = actor_config("fsdp2", dtype="bf16", extra=SMALL_LR)
    expected = log_prob_change(make_engine(cfg, tiny_model_dir4), cfg)
    dist_checkpoint = convert_to_mcore(tiny_model_dir4, str(tmp_path / "mcore"))
    mp.start_processes(_main_weights_rank_main, args=(tiny_model_dir4, dist_checkpoint, str(tmp_path)), nprocs=1,
                       start_method="spawn")
    changes = torch.load(tmp_path / "changes.pt")
    assert len(changes) == 3
    for name, change in changes.items():
        assert 0.8 * expected <= change <= 1.25 * expected, (name, change, expected)


def _lora_dtype_rank_main(rank, model_dir, adapter, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=1)
    runs = {}
    for lora_dtype in ("null", "float32"):
        cfg = actor_config("megatron", dtype="bf16", extra=SMALL_LR + (
            f"actor_rollout_ref.model.lora.adapter_path={adapter}", f"actor_rollout_ref.model.lora.dtype={lora_dtype}"))
        engine = make_engine(cfg, model_dir)

        def adapters(engine=engine):
            return {n: p.detach().clone() for m in engine.models for n, p in m.named_parameters() if "_adapter." in n}

        before = adapters()
        run = {"before": before, "infer": engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None),
               "first": step(engine, cfg, 1), "after": adapters(),
               "base_dtypes": {p.dtype for m in engine.models for n, p in m.named_parameters() if "_adapter." not in n}}
        engine.save_checkpoint(os.path.join(out_dir, lora_dtype))
        run["second"] = (step(engine, cfg, 2), adapters())
        resumed = make_engine(cfg, model_dir)
        resumed.load_checkpoint(os.path.join(out_dir, lora_dtype))
        run["resumed"] = (step(resumed, cfg, 2), adapters(resumed))
        runs[lora_dtype] = run
    torch.save(runs, os.path.join(out_dir, "runs.pt"))
    dist.destroy_process_group()


def test_megatron_lora_dtype_float32_keeps_a_bf16_models_adapters_in_float32(tiny_model_dir4, fused_lora_adapter,
                                                                            tmp_path):
    """verl's model.lora.dtype=float32 beside a bf16 model: the adapters stay float32 (the base
    weights bf16), log-probs and gradient norm are the hand-computed float32 adapter's within
    bf16's resolution, an update of 1e-5 moves every adapter entry (in the model's bf16 almost
    none moves: it is below half a rounding step), and a resumed run continues exactly."""
    expected = fused_lora_reference(tiny_model_dir4, fused_lora_adapter)
    mp.start_processes(_lora_dtype_rank_main, args=(tiny_model_dir4, fused_lora_adapter, str(tmp_path)), nprocs=1,
                       start_method="spawn")
    runs = torch.load(tmp_path / "runs.pt")
    mask = rollout_batch(1)["response_mask"].bool()

    def moved(run) -> float:
        changed = [(run["after"][n] != run["before"][n]).float().mean() for n in run["before"]]
        return float(sum(changed) / len(changed))

    for lora_dtype, adapter_dtype in (("null", torch.bfloat16), ("float32", torch.float32)):
        run = runs[lora_dtype]
        assert run["base_dtypes"] == {torch.bfloat16}
        assert {t.dtype for t in run["after"].values()} == {adapter_dtype}
        assert 0 < (run["infer"]["log_probs"] - expected["log_probs"])[mask].abs().max() <= 0.1
        assert run["first"]["actor/grad_norm"] == pytest.approx(expected["grad_norm"], rel=0.05)
        assert run["resumed"][0] == run["second"][0]
        assert all(torch.equal(run["resumed"][1][n], run["second"][1][n]) for n in run["second"][1])
    assert moved(runs["float32"]) > 0.95
    assert moved(runs["null"]) < 0.2


def _role_overrides_rank_main(rank, model_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=1)
    cfg = actor_config("megatron", extra=("+actor_rollout_ref.ref.megatron.override_transformer_config.attention_dropout=0.25",))
    ref = build_engine(ModelSpec("ref", model_dir, cfg.actor_rollout_ref.model), cfg.actor_rollout_ref.ref,
                       torch.device("cpu"))
    torch.save({"actor": make_engine(cfg, model_dir).config.attention_dropout,
                "ref": ref.config.attention_dropout}, os.path.join(out_dir, "dropout.pt"))
    dist.destroy_process_group()


def test_each_megatron_role_takes_its_own_transformer_overrides(tiny_model_dir4, tmp_path):
    """verl's ref.megatron.override_transformer_config is the actor's unless set; set, it reaches
    the reference engine's TransformerConfig and leaves the actor's alone."""
    from hybrid_rl.config_keys import check_verl_keys

    key = "actor_rollout_ref.ref.megatron.override_transformer_config"
    cfg = compose_config([f"+{key}.attention_dropout=0.25", "critic.nccl_timeout=1200"],
                         config_name="ppo_megatron_trainer")
    assert check_verl_keys(cfg, "cpu") == []
    mp.start_processes(_role_overrides_rank_main, args=(tiny_model_dir4, str(tmp_path)), nprocs=1, start_method="spawn")
    assert torch.load(tmp_path / "dropout.pt") == {"actor": 0.0, "ref": 0.25}


def reward_model_config(tp: int = 1, pp: int = 1, cp: int = 1, vpp: int | None = None):
    return compose_config(["reward_model.enable=true", "reward_model.strategy=megatron", "reward_model.megatron.dtype=fp32",
                           "reward_model.model.fsdp_config.dtype=fp32",
                           f"reward_model.megatron.tensor_model_parallel_size={tp}",
                           f"reward_model.megatron.pipeline_model_parallel_size={pp}",
                           f"reward_model.megatron.context_parallel_size={cp}",
                           f"reward_model.megatron.virtual_pipeline_model_parallel_size={vpp or 'null'}",
                           "trainer.iterative.enable=true",
                           "trainer.iterative.reward_model.lr=1e-3", "trainer.iterative.reward_model.epochs=2",
                           "trainer.iterative.reward_model.mini_batch_size=4",
                           "trainer.iterative.reward_model.micro_batch_size_per_gpu=3"],
                          config_name="ppo_megatron_trainer")


def reward_model_training(rm, batch, cfg) -> dict:
    """Iterative RL's training of `rm` (as `RewardModelWorker.train_reward_model` runs it) on
    `batch` with labels, and the scores before and after."""
    from hybrid_rl.workers.reward_model import train_further

    rows = Batch(tensors={**batch.tensors, "labels": torch.arange(len(batch)).remainder(2).float(),
                          "response_mask": batch["attention_mask"][:, -batch["responses"].shape[1]:]})
    before = rm.infer(rows, Output.SCORES, 1.0, 2, None)["scores"]
    metrics = train_further(rm, rows, cfg.trainer.iterative.reward_model, seed=3)
    return {"before": before, "metrics": metrics, "after": rm.infer(rows, Output.SCORES, 1.0, 2, None)["scores"]}


def reward_model_part(inputs: dict, out_dir: str, tp: int, pp: int, cp: int, vpp: int | None) -> dict:
    from hybrid_rl.workers.reward_model import training_optim

    cfg = reward_model_config(tp, pp, cp, vpp)
    role_cfg = OmegaConf.create({"strategy": "megatron", "megatron": cfg.reward_model.megatron, "grad_clip": 1.0})
    optim = training_optim(cfg.trainer.iterative.reward_model)
    rm = build_engine(ModelSpec("reward_model", inputs["reward_model"], cfg.reward_model.model, head=Head.SCORE,
                                optim_cfg=optim), role_cfg, torch.device("cpu"))
    batch = torch.load(inputs["reward_model_batch"], weights_only=False)
    return {**reward_model_training(rm, batch, cfg), "output": rm.is_output_rank}


@pytest.fixture(scope="module")
def reward_model_case(tmp_path_factory, tiny_tokenizer) -> dict:
    """A sequence classifier (4 layers: two virtual stages on each of two pipeline stages) and six
    rows (mini-batches of 4 and 2) to score and train it on."""
    from tests.rewards.test_reward_model import ANSWERS, CHATS, build_reward_model, rollouts

    folder = tmp_path_factory.mktemp("reward_model")
    batch_file = folder / "batch.pt"
    torch.save(rollouts(tiny_tokenizer, CHATS * 2, ANSWERS[::-1] * 2), batch_file)
    return {"reward_model": build_reward_model(folder / "model", tiny_tokenizer, num_layers=4),
            "reward_model_batch": str(batch_file)}


def test_megatron_reward_model_scores_as_the_fsdp_one(megatron_layout, reward_model_case):
    """`reward_model.strategy=megatron`: a sequence classifier's score at each row's last real
    token, over TP or PP ranks, equal to the FSDP engine's (fp32), before and after iterative
    RL's pointwise training, whose loss, accuracy and grad norm equal the FSDP engine's too."""
    from hybrid_rl.workers.reward_model import training_optim

    rm_dir = reward_model_case["reward_model"]
    batch = torch.load(reward_model_case["reward_model_batch"], weights_only=False)
    cfg = reward_model_config()
    fsdp_role = OmegaConf.create({"strategy": "fsdp", "fsdp_config": cfg.reward_model.model.fsdp_config, "grad_clip": 1.0})
    model_cfg = OmegaConf.merge(cfg.reward_model.model, {"use_remove_padding": False})
    fsdp = build_engine(ModelSpec("reward_model", rm_dir, model_cfg, head=Head.SCORE,
                                  optim_cfg=training_optim(cfg.trainer.iterative.reward_model)),
                        fsdp_role, torch.device("cpu"))
    expected = reward_model_training(fsdp, batch, cfg)
    assert expected["metrics"]["reward_model/loss"] > 0 and not torch.allclose(expected["after"], expected["before"])
    results = megatron_layout.results("reward_model")
    assert sum(result["output"] for result in results) == 1  # one data-parallel replica
    for result in results:
        assert result["before"].shape == (len(batch),)
        for key in ("before", "after"):
            torch.testing.assert_close(result[key], expected[key], rtol=1e-5, atol=1e-5)
        for key in ("reward_model/loss", "reward_model/accuracy", "reward_model/grad_norm") if result["output"] else ():
            assert result["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-4), key


def critic_config(strategy: str, tp: int = 1, pp: int = 1, cp: int = 1, vpp: int | None = None, extra=()):
    return compose_config([
        "critic.fsdp_config.dtype=fp32", "critic.megatron.dtype=fp32", f"critic.strategy={strategy}",
        "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=3",
        "critic.use_dynamic_bsz=false", "critic.optim.lr=1e-3", "critic.optim.weight_decay=0.0",
        f"critic.megatron.tensor_model_parallel_size={tp}", f"critic.megatron.pipeline_model_parallel_size={pp}",
        f"critic.megatron.context_parallel_size={cp}", f"critic.megatron.virtual_pipeline_model_parallel_size={vpp or 'null'}",
        *extra], config_name="ppo_megatron_trainer")


def make_critic(cfg, model_dir):
    return build_engine(ModelSpec("critic", model_dir, cfg.critic.model, head=Head.VALUE, optim_cfg=cfg.critic.optim,
                                  total_steps=4), cfg.critic, torch.device("cpu"))


def critic_update(critic, cfg, seed: int) -> dict:
    return critic.update(rollout_batch(seed), cfg.critic, rollout_n=2, seed=seed, output=Output.VALUES,
                         temperature=1.0, loss_fn=value_loss_fn)


def critic_run(cfg, model_dir, checkpoint: str | None = None) -> dict:
    """Values, one update and the weights around it; with `checkpoint`, the engine saved there
    after it, a second update, and the same from an engine that loads the checkpoint."""
    critic = make_critic(cfg, model_dir)
    values = critic.infer(rollout_batch(1), Output.VALUES, 1.0, 3, None)["values"]
    before = weights(critic)
    result = {"values": values, "metrics": critic_update(critic, cfg, 1), "before": before, "after": weights(critic),
              "output": critic.is_output_rank}
    if checkpoint:
        critic.save_checkpoint(checkpoint)
        result["second"] = (critic_update(critic, cfg, 2), weights(critic))
        resumed = make_critic(cfg, model_dir)
        resumed.load_checkpoint(checkpoint)
        result["resumed"] = (critic_update(resumed, cfg, 2), weights(resumed))
    return result


def critic_part(inputs: dict, out_dir: str, tp: int, pp: int, cp: int, vpp: int | None) -> dict:
    model, adapter = inputs["critic_lora"]
    lora = critic_config("megatron", tp, pp, cp, vpp, extra=(
        f"critic.model.lora.adapter_path={adapter}", "critic.model.lora.type=canonical_lora"))
    return {"full": critic_run(critic_config("megatron", tp, pp, cp, vpp), inputs["value_model"]),
            "lora": critic_run(lora, model, os.path.join(out_dir, "critic_lora_ckpt"))}


@pytest.fixture(scope="module")
def value_model_dir(tiny_model_dir4, tmp_path_factory):
    """A critic's own folder (LlamaForTokenClassification): the backbone plus a trained-looking head."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir4, num_labels=1)
    with torch.no_grad():
        model.score.bias.fill_(0.25)
    folder = tmp_path_factory.mktemp("value_model")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir4).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def critic_lora_case(canonical_lora_adapter, tmp_path_factory) -> tuple[str, str]:
    """(value model, adapter): a critic of the 4-head, 2-group model (TP=2 splits whole groups, as
    canonical_lora needs), and a peft adapter of it (token classification) that adapts every
    projection, B not zero, and holds a head of its own."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    base = canonical_lora_adapter[0]
    folder = tmp_path_factory.mktemp("critic_lora")
    model = AutoModelForTokenClassification.from_pretrained(base, num_labels=1)
    model.save_pretrained(folder / "model")
    AutoTokenizer.from_pretrained(base).save_pretrained(folder / "model")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[
        name for _, names in FUSED for name in names], task_type="TOKEN_CLS"))
    g = torch.Generator().manual_seed(7)
    scales = {"lora_A": 0.3, "lora_B": 0.05, "score": 0.02}  # the head's as transformers draws one
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:  # the adapters and the head's trained copy
                param.copy_(torch.randn(param.shape, generator=g) * next(v for k, v in scales.items() if k in name))
    peft_model.save_pretrained(folder / "adapter")
    return str(folder / "model"), str(folder / "adapter")


PARTS = {"actor": actor_part, "actor_bf16": actor_bf16_part, "lora": lora_part, "critic": critic_part, "reward_model": reward_model_part}


# Each layout as (tensor, pipeline, context parallel size, virtual pipeline stages).
LAYOUTS = {"tp2": (2, 1, 1, None), "pp2": (1, 2, 1, None), "pp2vpp2": (1, 2, 1, 2), "cp2": (1, 1, 2, None)}


def _layouts_rank_main(rank, world, init_file, inputs, out_dir):
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for layout, (tp, pp, cp, vpp) in LAYOUTS.items():
        layout_dir = os.path.join(out_dir, layout)
        for name, part in PARTS.items():
            torch.save(part(inputs, layout_dir, tp, pp, cp, vpp), os.path.join(layout_dir, f"{name}_rank{rank}.pt"))
        parallel_state.destroy_model_parallel()  # the next layout's engines form their own groups
    dist.destroy_process_group()


@dataclass
class LayoutRun:
    tp: int
    pp: int
    cp: int
    vpp: int | None
    out_dir: Path

    def results(self, part: str) -> list[dict]:
        return [torch.load(self.out_dir / f"{part}_rank{rank}.pt") for rank in range(2)]


@pytest.fixture(scope="module")
def megatron_layouts(tiny_model_dir4, value_model_dir, reward_model_case, fused_lora_adapter, canonical_lora_adapter,
                     critic_lora_case, tmp_path_factory) -> Path:
    """The Megatron side of the comparisons with FSDP (actor in fp32 and bf16, critic, reward
    model) on each TP x PP x CP layout (PP with or without virtual stages), all in one spawn of
    two gloo ranks: a spawn costs each rank ~10 s of imports."""
    out_dir = tmp_path_factory.mktemp("megatron_layouts")
    for layout in LAYOUTS:
        (out_dir / layout).mkdir()
    inputs = {"model": tiny_model_dir4, "value_model": value_model_dir, "lora_adapter": fused_lora_adapter,
              "canonical_lora": canonical_lora_adapter, "critic_lora": critic_lora_case, **reward_model_case}
    mp.start_processes(_layouts_rank_main, args=(2, str(out_dir / "init"), inputs, str(out_dir)), nprocs=2,
                       start_method="spawn")
    return out_dir


@pytest.fixture(scope="module", params=list(LAYOUTS))
def megatron_layout(request, megatron_layouts) -> LayoutRun:
    return LayoutRun(*LAYOUTS[request.param], megatron_layouts / request.param)


def test_megatron_critic_matches_fsdp(megatron_layout, value_model_dir):
    expected = critic_run(critic_config("fsdp2"), value_model_dir)
    mask = rollout_batch(1)["response_mask"].bool()
    for result in (r["full"] for r in megatron_layout.results("critic")):
        assert (result["values"] - expected["values"])[mask].abs().max() <= 1e-5
        assert result["metrics"]["critic/grad_norm"] == pytest.approx(expected["metrics"]["critic/grad_norm"], rel=1e-4)
        assert set(result["after"]) == set(expected["after"])  # score.weight and score.bias, no lm_head
        assert all(torch.equal(result["before"][k], expected["before"][k]) for k in expected["before"])
        update = torch.cat([(result["after"][k] - result["before"][k]).flatten() for k in expected["after"]])
        expected_update = torch.cat([(expected["after"][k] - expected["before"][k]).flatten()
                                     for k in expected["after"]])
        assert (update - expected_update).norm() / expected_update.norm() <= 1e-3


def test_megatron_critic_lora_matches_peft_on_the_fsdp_engine(megatron_layout, critic_lora_case, tmp_path):
    """critic.model.lora.* (canonical_lora) from a critic's peft adapter folder, head included,
    against peft's LoRA of the same folder on the FSDP engine, in every layout: values, gradient
    norm and the merged weights and head after one step (the rest of the base frozen); the
    checkpoint, adapters and head alone, resumes exactly and exports as the critic it is."""
    from torch.distributed.checkpoint import FileSystemReader

    model, adapter = critic_lora_case
    expected = critic_run(critic_config("fsdp2", extra=(f"critic.model.lora_adapter_path={adapter}",)), model)
    mask = rollout_batch(1)["response_mask"].bool()
    trained = {k for k in expected["after"] if "proj" in k or k.startswith("score.")}
    results = [r["lora"] for r in megatron_layout.results("critic")]
    for result in results:
        assert (result["values"] - expected["values"])[mask].abs().max() <= 1e-5
        assert result["metrics"]["critic/grad_norm"] == pytest.approx(expected["metrics"]["critic/grad_norm"], rel=1e-4)
        assert result["after"].keys() == expected["after"].keys()
        assert all((result["before"][k] - expected["before"][k]).abs().max() <= 1e-6 for k in expected["before"])
        update = torch.cat([(result["after"][k] - result["before"][k]).flatten() for k in trained])
        expected_update = torch.cat([(expected["after"][k] - expected["before"][k]).flatten() for k in trained])
        assert (update - expected_update).norm() / expected_update.norm() <= 1e-3
        assert all(torch.equal(result["after"][k], result["before"][k]) for k in result["after"] if k not in trained)
        assert not torch.equal(result["after"]["score.weight"], result["before"]["score.weight"])
        assert result["resumed"][0] == result["second"][0]
        assert all(torch.equal(result["resumed"][1][k], result["second"][1][k]) for k in result["second"][1])
    loss = next(r["metrics"]["critic/loss"] for r in results if r["output"])
    assert loss == pytest.approx(expected["metrics"]["critic/loss"], rel=1e-4)
    checkpoint = str(megatron_layout.out_dir / "critic_lora_ckpt")
    tensors = [key for key in FileSystemReader(checkpoint).read_metadata().state_dict_metadata
               if not key.startswith("optimizer")]
    assert any(key.startswith("output_layer.") for key in tensors)
    assert all("_adapter.lora_" in key or key.startswith("output_layer.") for key in tensors)
    step_dir = export_step_folder(checkpoint, model, tmp_path / "global_step_1", role="critic")
    merged = load_file(os.path.join(export_checkpoint(str(step_dir), str(tmp_path / "merged"), role="critic"),
                                    "model.safetensors"))
    after = results[0]["after"]
    assert merged.keys() == after.keys() and all((merged[k] - after[k]).abs().max() <= 1e-6 for k in merged)


def test_fsdp_critic_runs_in_its_dtype_on_packed_rows(value_model_dir):
    """The value forward runs in `critic.fsdp_config.dtype` (on CPU through autocast, not in the
    master weights' fp32) and, with `use_remove_padding`, on packed rows of real tokens, giving the
    values of the padded forward."""
    seen, values = {}, {}
    for dtype, packed in (("fp32", False), ("fp32", True), ("bf16", True)):
        cfg = compose_config(["critic.strategy=fsdp2", f"critic.fsdp_config.dtype={dtype}",
                              f"critic.model.use_remove_padding={packed}"])
        critic = build_engine(ModelSpec("critic", value_model_dir, cfg.critic.model, head=Head.VALUE), cfg.critic,
                              torch.device("cpu"))
        layer = critic.hf_module().model.layers[0].mlp.down_proj
        hook = layer.register_forward_hook(lambda module, args, out, key=(dtype, packed): seen.update({key: out}))
        values[dtype, packed] = critic.infer(rollout_batch(1), Output.VALUES, 1.0, 3, None)["values"]
        hook.remove()
    assert {key: out.dtype for key, out in seen.items()} == {
        ("fp32", False): torch.float32, ("fp32", True): torch.float32, ("bf16", True): torch.bfloat16}
    assert seen["fp32", True].shape[:2].numel() < seen["fp32", False].shape[:2].numel()  # no padding computed
    mask = rollout_batch(1)["response_mask"].bool()
    assert (values["fp32", True] - values["fp32", False])[mask].abs().max() <= 1e-5
    assert (values["fp32", True][~mask] == 0).all()
    assert (values["bf16", True] - values["fp32", False])[mask].abs().max() <= 0.1


def test_dispatch_follows_the_data_parallel_layout():
    # TP=2 x DP=2 over 4 ranks: ranks 0, 1 are replica 0 (rank 0 answers), ranks 2, 3 replica 1.
    layout = [RankLayout(0, 2, True), RankLayout(0, 2, False), RankLayout(1, 2, True), RankLayout(1, 2, False)]
    batch = Batch(tensors={"x": torch.arange(6)})
    per_args, _, pad = split_by_layout(layout, (batch,), {})
    assert pad == 0 and [a[0]["x"].tolist() for a in per_args] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert output_ranks(layout) == [0, 2]
    with pytest.raises(ValueError, match="exactly one output rank"):
        output_ranks([RankLayout(0, 1, True), RankLayout(0, 1, True)])


@pytest.mark.parametrize("overrides, expected", [
    # tiny model: 4 layers, 2 attention heads, 1 key/value head; 2 ranks
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4", "trainer.n_gpus_per_node=4"],
     r"actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 does not fit the model's 2 attention heads"
     r".*valid here: 1, 2\)"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3", "trainer.n_gpus_per_node=3",
      "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6"],
     r"pipeline_model_parallel_size=3 x virtual_pipeline_model_parallel_size=1 does not divide the model's 4 layers"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=3",
      "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6"],
     r"tensor_model_parallel_size \(1\) x pipeline_model_parallel_size \(2\) must divide the number of ranks \(3"),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.context_parallel_size=2"],
     r"tensor_model_parallel_size \(2\) x pipeline_model_parallel_size \(1\) x context_parallel_size \(2\) must "
     r"divide the number of ranks \(2"),
    (["actor_rollout_ref.actor.megatron.context_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.ref.megatron.context_parallel_size=1"],
     "must match.*actor_rollout_ref.actor: TP=1, PP=1, EP=1, CP=2, actor_rollout_ref.ref: TP=1, PP=1, EP=1, CP=1"),
    (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1"],
     "must match.*actor_rollout_ref.actor: TP=1, PP=2, EP=1, CP=1, actor_rollout_ref.ref: TP=1, PP=1, EP=1, CP=1"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "algorithm.adv_estimator=gae"],
     "must match.*actor_rollout_ref.actor: TP=1, PP=2, EP=1, CP=1, .*critic: TP=1, PP=1, EP=1, CP=1"),
    (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"],
     "expert_model_parallel_size=2: the model has no experts"),
    (["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2"],
     "expert_tensor_parallel_size=2: this engine keeps each expert whole on one rank"),
    (["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=full"],
     "kl_loss_type=full needs full-vocabulary logits"),
])
def test_megatron_layouts_the_model_cannot_take_are_refused_before_workers_start(tiny_model_dir4, overrides,
                                                                               expected):
    from hybrid_rl.config import ConfigError, check_model_limits, validate_config

    cfg = validate_config(compose_config(["trainer.n_gpus_per_node=2", "trainer.device=cpu", *overrides],
                                         config_name="ppo_megatron_trainer"))
    with pytest.raises(ConfigError, match=expected):
        check_model_limits(cfg, tiny_model_dir4)


def test_megatron_layouts_that_fit_pass_the_start_checks(tiny_model_dir4):
    from hybrid_rl.config import check_model_limits, validate_config

    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        cfg = validate_config(compose_config([
            "trainer.n_gpus_per_node=4", "trainer.device=cpu", "actor_rollout_ref.actor.use_kl_loss=true",
            f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
            f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"], config_name="ppo_megatron_trainer"))
        check_model_limits(cfg, tiny_model_dir4)  # the reference follows the actor's sizes in verl's tree
    # A mini-batch is split over the data-parallel replicas (here one group of 4 ranks), not the ranks.
    cfg = validate_config(compose_config([
        "trainer.n_gpus_per_node=4", "trainer.device=cpu", "data.train_batch_size=6", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"], config_name="ppo_megatron_trainer"))
    check_model_limits(cfg, tiny_model_dir4)


def test_unbuilt_megatron_settings_are_refused():
    from hybrid_rl.config import validate_config

    cfg = compose_config(["actor_rollout_ref.actor.megatron.use_megatron_fsdp=true"],
                         config_name="ppo_megatron_trainer")
    with pytest.raises(Exception, match="use_megatron_fsdp=True is not supported yet"):
        validate_config(cfg)


def _random_init_rank_main(rank, model_dir, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=1)
    cfg = actor_config("megatron", extra=("actor_rollout_ref.actor.load_weight=false",))
    first = make_engine(cfg, model_dir)
    built = weights(first)
    grad_norm = step(first, cfg, 1)["actor/grad_norm"]
    trained = weights(first)
    again = weights(make_engine(cfg, model_dir))
    ref = build_engine(ModelSpec("ref", model_dir, cfg.actor_rollout_ref.model),
                       OmegaConf.merge(cfg.actor_rollout_ref.ref, {"load_weight": False}), torch.device("cpu"))
    torch.save({"built": built, "again": again, "ref": weights(ref), "grad_norm": grad_norm, "trained": trained},
               os.path.join(out_dir, "random.pt"))
    dist.destroy_process_group()


def test_megatron_load_weight_false_starts_from_megatrons_seeded_initialisation(tiny_model_dir4, tmp_path):
    """verl <= 0.5's `load_weight=false`: the engine reads no weights; it holds megatron's own
    initialisation (normal with init_method_std 0.02, scaled for output projections, norms at one),
    the same for every build with the same seed (the reference's too), and trains from there."""
    cfg = actor_config("megatron", extra=("actor_rollout_ref.actor.load_weight=false",))
    assert cfg.actor_rollout_ref.actor.megatron.seed == cfg.actor_rollout_ref.ref.megatron.seed
    mp.start_processes(_random_init_rank_main, args=(tiny_model_dir4, str(tmp_path)), nprocs=1, start_method="spawn")
    out = torch.load(tmp_path / "random.pt")
    hf = {name: tensor for file in Path(tiny_model_dir4).glob("*.safetensors") for name, tensor in load_file(file).items()}
    built = out["built"]
    assert set(built) >= set(hf) - {"lm_head.weight"}
    assert all(torch.equal(built[name], out["again"][name]) and torch.equal(built[name], out["ref"][name])
               for name in built)
    projection, norm = "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(built[projection], hf[projection])
    assert built[projection].std().item() == pytest.approx(0.02, rel=0.1)
    # A layer's output projections: megatron's scaled initialisation, 0.02 / sqrt(2 x layers).
    layers = AutoConfig.from_pretrained(tiny_model_dir4).num_hidden_layers
    assert built["model.layers.0.mlp.down_proj.weight"].std().item() == pytest.approx(0.02 / (2 * layers) ** 0.5, rel=0.1)
    assert torch.equal(built[norm], torch.ones_like(built[norm]))
    assert out["grad_norm"] > 0 and not torch.equal(out["trained"][projection], built[projection])
