"""LoRA on the FSDP engine (`actor_rollout_ref.model.lora_rank`): only the adapter trains, the
rollout and export get merged weights under the base model's names, the reference policy is the
base model with the adapter off, checkpoints hold the adapter and its optimizer state alone.
(The whole run with vLLM: tests/test_end_to_end.py; kill -9 and resume, export: tests/test_resume.py.)"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.engines import Output
from hybrid_rl.engines.lora import AdapterDisabled
from tests.conftest import build_tiny_model
from tests.engine_helpers import actor_config, make_engine, rollout_batch, step, value_loss_fn, weights

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        # A gradient for the adapter's A as well as its B from the first step on.
        "actor_rollout_ref.actor.optim.weight_decay=0.0"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    return build_tiny_model(tmp_path_factory.mktemp("lora_model"), tiny_tokenizer, num_layers=2)


def lora_engine(model_dir, extra=()):
    """A LoRA actor; its adapter's A is drawn from torch's generator, seeded here as the worker does."""
    cfg = actor_config("fsdp2", extra=[*LORA, *extra])
    torch.manual_seed(0)
    return cfg, make_engine(cfg, model_dir)


def test_only_the_adapter_trains_and_the_weights_come_out_merged(model_dir):
    plain = make_engine(actor_config("fsdp2"), model_dir)
    cfg, engine = lora_engine(model_dir)
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(p.numel() for group in engine.optimizer.param_groups for p in group["params"]) == \
        sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    base = weights(plain)
    assert weights(engine).keys() == base.keys()  # the base model's names: what vLLM and export load
    assert all(torch.equal(weights(engine)[k], base[k]) for k in base)  # B starts at zero

    step(engine, cfg, 1)
    step(engine, cfg, 2)
    after = weights(engine)
    changed = {k for k in after if not torch.equal(after[k], base[k])}
    assert changed and changed == set(dict(engine.per_tensor_weights(torch.float32, only_trained=True)))
    # Each merged weight against peft's own delta of that layer.
    layers = dict(engine.module.named_modules())
    for name in changed:
        layer = layers[name.removesuffix(".weight")]
        expected = layer.base_layer.weight + layer.get_delta_weight("default")
        torch.testing.assert_close(after[name], expected, rtol=0, atol=1e-6)


def test_the_reference_is_the_base_model_with_the_adapter_off(model_dir):
    plain = make_engine(actor_config("fsdp2"), model_dir)
    cfg, engine = lora_engine(model_dir)
    step(engine, cfg, 1)
    batch = rollout_batch(3)
    mask = batch["response_mask"].bool()
    base = plain.infer(batch, Output.LOG_PROBS, 0.7, 3, None)["log_probs"]
    reference = AdapterDisabled(engine).infer(batch, Output.LOG_PROBS, 0.7, 3, None)["log_probs"]
    actor = engine.infer(batch, Output.LOG_PROBS, 0.7, 3, None)["log_probs"]
    assert torch.equal(reference, base)
    assert (actor - base)[mask].abs().max() > 1e-4
    # The adapter is back on after the reference's pass.
    assert torch.equal(engine.infer(batch, Output.LOG_PROBS, 0.7, 3, None)["log_probs"], actor)


def test_the_checkpoint_holds_the_adapter_and_resumes_exactly(model_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    cfg, engine = lora_engine(model_dir)
    step(engine, cfg, 1)
    engine.save_checkpoint(str(tmp_path))
    tensors = [k for k, v in FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata.items()
               if k.startswith("model.") and hasattr(v, "size")]
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert (tmp_path / "adapter_config.json").is_file()

    _, resumed = lora_engine(model_dir)
    resumed.load_checkpoint(str(tmp_path))
    expected, got = step(engine, cfg, 2), step(resumed, cfg, 2)
    assert got == expected
    a, b = weights(engine), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_adapter_folder_to_start_from(model_dir, tmp_path):
    cfg, engine = lora_engine(model_dir)
    step(engine, cfg, 1)
    engine.peft.save_pretrained(str(tmp_path))  # what hybrid-rl-export --adapter-only writes
    _, started = lora_engine(model_dir, [f"actor_rollout_ref.model.lora_adapter_path={tmp_path}"])
    a, b = weights(engine), weights(started)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(p.requires_grad for p in started.module.parameters())


def test_gradient_checkpointing_with_lora_gives_the_same_update(model_dir):
    runs = []
    for flag in (False, True):
        cfg, engine = lora_engine(model_dir, [f"actor_rollout_ref.model.enable_gradient_checkpointing={flag}"])
        runs.append((step(engine, cfg, 1), weights(engine)))
    (plain_metrics, plain_weights), (ckpt_metrics, ckpt_weights) = runs
    assert ckpt_metrics["actor/loss"] == pytest.approx(plain_metrics["actor/loss"], rel=1e-6)
    assert ckpt_metrics["actor/grad_norm"] == pytest.approx(plain_metrics["actor/grad_norm"], rel=1e-6)
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(ckpt_weights[name], tensor, rtol=1e-6, atol=1e-7)


def test_skipping_peft_input_casts_under_cpu_autocast_changes_nothing(model_dir):
    from peft.tuners.lora import LoraLayer

    cfg, engine = lora_engine(model_dir, ["actor_rollout_ref.actor.fsdp_config.dtype=bf16"])
    step(engine, cfg, 1)  # a non-zero adapter
    layers = [m for m in engine.module.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(layer.cast_input_dtype_enabled for layer in layers)
    skipped = engine.infer(rollout_batch(3), Output.LOG_PROBS, 0.7, 3, None)["log_probs"]
    for layer in layers:
        layer.cast_input_dtype_enabled = True
    assert torch.equal(engine.infer(rollout_batch(3), Output.LOG_PROBS, 0.7, 3, None)["log_probs"], skipped)


@pytest.fixture(scope="module")
def bf16_model_dir(model_dir, tmp_path_factory):
    """The tiny model with every value rounded to bf16 (stored in float32): what a bf16 checkpoint holds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("lora_bf16_model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.copy_(tensor.bfloat16())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("compute", ["bf16", "fp32"])
def test_a_base_exact_in_bf16_is_held_in_bf16_with_the_same_numbers(model_dir, bf16_model_dir, monkeypatch, compute):
    """On CPU the frozen base's linear layers are held in bf16 when that loses nothing, under bf16
    autocast and in float32 compute (cast up at each use): the same losses, log-probs and merged
    (synced, exported) weights, bit for bit. A base with float32 values stays float32."""
    from hybrid_rl.engines import hf_model

    dtype = [f"actor_rollout_ref.actor.fsdp_config.dtype={compute}"]
    cfg, engine = lora_engine(bf16_model_dir, dtype)
    dtypes = {n: p.dtype for n, p in engine.module.named_parameters()}
    base = [n for n in dtypes if ".base_layer." in n]
    assert base and all(dtypes[n] == torch.bfloat16 for n in base)
    assert all(dtypes[n] == torch.float32 for n in dtypes if ".lora_" in n or "norm" in n or "embed" in n)
    upcast = [m for m in engine.module.modules() if isinstance(m, hf_model.UpcastLinear)]
    assert len(upcast) == (len(base) if compute == "fp32" else 0)
    _, in_float32 = lora_engine(model_dir, dtype)  # values not exact in bf16
    assert all(p.dtype == torch.float32 for p in in_float32.module.parameters())

    monkeypatch.setattr(hf_model, "cast_frozen_linears", lambda *args, **kwargs: 0)
    _, uncast = lora_engine(bf16_model_dir, dtype)
    assert all(p.dtype == torch.float32 for p in uncast.module.parameters())
    for seed in (1, 2):
        assert step(engine, cfg, seed) == step(uncast, cfg, seed)
    ours, reference = (e.infer(rollout_batch(3), Output.LOG_PROBS, 0.7, 3, None)["log_probs"] for e in (engine, uncast))
    assert torch.equal(ours, reference)
    merged, expected = weights(engine), weights(uncast)
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in expected)


def test_target_modules_that_match_nothing_name_the_key_and_the_layers(model_dir):
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.target_modules=.*q_proj"):
        lora_engine(model_dir, ["actor_rollout_ref.model.target_modules=[attention_dense]"])


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.model.lora_rank=-4"], r"lora_rank=-4 must be a whole number >= 0"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=0"], r"lora_alpha=0 must be a positive number"),
    (["actor_rollout_ref.model.lora_adapter_path=/nonexistent/adapter"], r"is not a peft adapter folder"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.strategy=megatron"],
     r"lora_rank is the FSDP engine's LoRA key; with actor_rollout_ref.actor.strategy=megatron set "
     r"actor_rollout_ref\.model\.lora\.rank"),
    (["actor_rollout_ref.model.lora.rank=8"], r"lora.rank is the Megatron engine's LoRA key; with "
     r"actor_rollout_ref.actor.strategy=fsdp2 set actor_rollout_ref.model.lora_rank"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora_rank=8"], r"are both set"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.strategy=megatron",
      "actor_rollout_ref.model.lora.alpha=0"], r"lora.alpha=0 must be a positive number"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.strategy=megatron",
      "actor_rollout_ref.model.lora.exclude_modules=[linear_fc2]"], r"target_modules=\[\] to use it"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.strategy=megatron",
      "actor_rollout_ref.model.lora.lora_A_init_method=orthogonal"], r"lora_A_init_method='orthogonal' is not valid"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.strategy=megatron",
      "actor_rollout_ref.model.lora.type=dora"], r"lora.type=dora is not supported yet"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.strategy=megatron",
      "actor_rollout_ref.model.lora.dropout=1.5"], r"lora.dropout=1.5 must be a probability in \[0, 1\)"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.strategy=megatron",
      "actor_rollout_ref.model.lora.dropout_position=middle"], r"lora.dropout_position='middle' is not valid"),
    (["actor_rollout_ref.model.lora.adapter_path=/nonexistent/adapter", "actor_rollout_ref.actor.strategy=megatron"],
     r"lora.adapter_path='/nonexistent/adapter' is not a peft adapter folder"),
    (["actor_rollout_ref.model.lora_rank=8", "trainer.iterative.enable=true"], r"reset_reference=true with LoRA"),
    # The critic's, under the same rules.
    (["algorithm.adv_estimator=gae", "critic.model.lora_rank=8", "critic.strategy=megatron"],
     r"critic.model.lora_rank is the FSDP engine's LoRA key; with critic.strategy=megatron set critic.model.lora.rank"),
    (["algorithm.adv_estimator=gae", "critic.model.lora.rank=8"],
     r"critic.model.lora.rank is the Megatron engine's LoRA key; with critic.strategy=fsdp2 set critic.model.lora_rank"),
    (["algorithm.adv_estimator=gae", "critic.model.lora_rank=8", "critic.model.lora_alpha=-1"],
     r"critic.model.lora_alpha=-1 must be a positive number"),
    # Half-precision adapters beside a float32 model; a dtype of no name.
    (["algorithm.adv_estimator=gae", "critic.model.lora.rank=8", "critic.strategy=megatron",
      "critic.megatron.dtype=fp32", "critic.model.lora.dtype=bf16"],
     r"critic.model.lora.dtype=bfloat16: the adapters are kept in the model's float32 \(megatron.dtype; set null\) "
     r"or in float32"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.strategy=megatron",
      "actor_rollout_ref.model.lora.dtype=int4"], r"actor_rollout_ref.model.lora.dtype='int4' is not valid"),
])
def test_lora_settings_that_cannot_work_stop_at_start(overrides, message):
    # The Megatron engine's cases in verl's Megatron tree, as verl users run them.
    name = "ppo_megatron_trainer" if any(o.endswith("strategy=megatron") for o in overrides) else "ppo_trainer"
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(overrides, config_name=name))


@pytest.mark.parametrize("lora_dtype", ["null", "fp32", "float32"])
def test_megatron_lora_keys_start_with_the_megatron_engine(lora_dtype):
    validate_config(compose_config(["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
                                    "actor_rollout_ref.model.lora.lora_A_init_method=kaiming",
                                    "actor_rollout_ref.actor.megatron.dtype=bf16",
                                    f"actor_rollout_ref.model.lora.dtype={lora_dtype}"],
                                   config_name="ppo_megatron_trainer"))


def test_a_frozen_float32_engine_holds_a_bf16_checkpoints_linears_in_bf16(model_dir, bf16_model_dir, monkeypatch):
    """A reference (or reward) engine computing in float32 on CPU holds the linear layers of a
    checkpoint whose values are bf16 numbers in bf16, cast up at each use: the same log-probs, bit
    for bit; a checkpoint with float32 values stays float32."""
    from hybrid_rl.engines import ModelSpec, build_engine, hf_model

    cfg = actor_config("fsdp2")
    cpu = torch.device("cpu")

    def reference(folder):
        return build_engine(ModelSpec("ref", folder, cfg.actor_rollout_ref.model), cfg.actor_rollout_ref.actor, cpu)

    frozen, in_float32 = reference(bf16_model_dir), reference(model_dir)
    dtypes = {name: p.dtype for name, p in frozen.module.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == dtypes["model.layers.1.mlp.down_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == torch.float32
    assert all(p.dtype == torch.float32 for p in in_float32.module.parameters())
    monkeypatch.setattr(hf_model, "cast_frozen_linears", lambda *args, **kwargs: 0)
    uncast = reference(bf16_model_dir)
    batch = rollout_batch(0)
    ours, expected = (e.infer(batch, Output.LOG_PROBS, 0.7, 3, None)["log_probs"] for e in (frozen, uncast))
    assert torch.equal(ours, expected) and ours.abs().sum() > 0


# --- the critic (critic.model.lora_rank): its backbone adapted, its new value head trained whole
CRITIC = ["critic.fsdp_config.dtype=fp32", "critic.strategy=fsdp2", "critic.ppo_mini_batch_size=4",
          "critic.ppo_micro_batch_size_per_gpu=3", "critic.use_dynamic_bsz=false", "critic.optim.lr=1e-3",
          "critic.optim.weight_decay=0.0", "algorithm.adv_estimator=gae"]


def critic_engine(model_dir, extra=()):
    from hybrid_rl.engines import Head, ModelSpec, build_engine

    cfg = compose_config([*CRITIC, *extra])
    torch.manual_seed(0)
    spec = ModelSpec("critic", model_dir, cfg.critic.model, head=Head.VALUE, optim_cfg=cfg.critic.optim, total_steps=4)
    return cfg, build_engine(spec, cfg.critic, torch.device("cpu"))


def critic_step(engine, cfg, seed: int) -> dict:
    return engine.update(rollout_batch(seed), cfg.critic, rollout_n=2, seed=seed, output=Output.VALUES,
                         temperature=1.0, loss_fn=value_loss_fn)


@pytest.fixture(scope="module")
def critic_adapter(model_dir, tmp_path_factory) -> str:
    """A critic's peft adapter (token classification): every projection adapted with B not zero,
    and a head of its own (peft's `modules_to_save`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  exclude_modules=["score"], task_type="TOKEN_CLS"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:  # the adapters and the head
                param.copy_(torch.randn(param.shape, generator=g) * (0.05 if "lora_B" in name else 0.3))
    folder = tmp_path_factory.mktemp("critic_adapter")
    peft_model.save_pretrained(folder)
    return str(folder)


def critic_reference(model_dir: str, adapter: str) -> dict:
    """The same update by hand: peft's token classifier from `adapter`, the squared error over the
    whole batch (one mini-batch), the gradient norm clipped to 1, one AdamW step."""
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    batch = rollout_batch(1)
    response = batch["responses"].shape[1]
    values = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=batch["position_ids"]).logits[:, -response - 1:-1, 0]
    mask = batch["response_mask"]
    loss = (((values - batch["advantages"]) ** 2) * mask).sum() / mask.sum()
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    with torch.no_grad():
        after = dict(peft_model.merge_and_unload().state_dict())
    return {"values": values.detach() * mask, "loss": float(loss.detach()), "grad_norm": float(norm), "after": after}


def test_a_critic_trains_its_adapter_and_its_whole_head_as_peft_computes_them(model_dir, critic_adapter):
    expected = critic_reference(model_dir, critic_adapter)
    cfg, engine = critic_engine(model_dir, [f"critic.model.lora_adapter_path={critic_adapter}"])
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert {n for n in trained if ".lora_" not in n} == {"score.modules_to_save.default.weight",
                                                        "score.modules_to_save.default.bias"}
    before = weights(engine)
    mask = rollout_batch(1)["response_mask"].bool()
    values = engine.infer(rollout_batch(1), Output.VALUES, 1.0, 3, None)["values"]
    assert (values - expected["values"])[mask].abs().max() <= 1e-5
    metrics = critic_step(engine, cfg, 1)
    assert metrics["critic/loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert metrics["critic/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    after = weights(engine)
    assert after.keys() == expected["after"].keys()
    # Merged weights move by up to 5e-3 here. AdamW's first step is about lr (1e-3) on every
    # element however small its gradient, down to ~eps: the last layer's query adapter has one
    # (7.5e-8 after clipping, beside ~1e-3 in its row), a sum that nearly cancels, whose float32
    # rounding depends on the order of the sums (micro-batches here, one pass in peft) and on the
    # CPU's kernels. On an AMX Xeon its step, and so its row of the merged weight, came out 3.7e-6
    # from peft's; elsewhere within 1e-7.
    for name, tensor in expected["after"].items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=1e-5)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert {"score.weight", "score.bias"} <= changed
    assert all("proj" in k or k.startswith("score.") for k in changed)  # the rest of the base is frozen


def test_a_critics_checkpoint_holds_its_adapter_and_head_resumes_exactly_and_exports(model_dir, critic_adapter,
                                                                                     tmp_path):
    import json
    import shutil

    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForTokenClassification

    from hybrid_rl.export import export_checkpoint

    extra = ["critic.model.lora_rank=4", "critic.model.lora_alpha=8"]
    cfg, engine = critic_engine(model_dir, extra)
    critic_step(engine, cfg, 1)
    folder = tmp_path / "global_step_1" / "critic"
    engine.save_checkpoint(str(folder))
    tensors = [k for k, v in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items()
               if k.startswith("model.") and hasattr(v, "size")]
    assert tensors and all(".lora_A." in k or ".lora_B." in k or ".score.modules_to_save." in k for k in tensors)
    assert any("score" in k for k in tensors)
    _, resumed = critic_engine(model_dir, extra)
    resumed.load_checkpoint(str(folder))
    assert critic_step(resumed, cfg, 2) == critic_step(engine, cfg, 2)
    a, b = weights(engine), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # hybrid-rl-export --role critic of the step-1 checkpoint: merged, and the adapter with its head.
    step_dir = folder.parent
    shutil.copytree(model_dir, step_dir / "huggingface", ignore=shutil.ignore_patterns("*.safetensors"))
    (step_dir / "trainer_state.json").write_text(json.dumps({"config": {"critic": {"model": {"path": model_dir}}}}))
    _, at_step1 = critic_engine(model_dir, extra)
    at_step1.load_checkpoint(str(folder))
    values = at_step1.infer(rollout_batch(3), Output.VALUES, 1.0, 3, None)["values"]
    batch, mask = rollout_batch(3), rollout_batch(3)["response_mask"]
    response = batch["responses"].shape[1]

    def values_of(model):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"]).logits[:, -response - 1:-1, 0].detach() * mask

    merged = AutoModelForTokenClassification.from_pretrained(
        export_checkpoint(str(step_dir), str(tmp_path / "merged"), role="critic"))
    assert (values_of(merged) - values).abs().max() <= 1e-5
    assert load_file(tmp_path / "merged" / "model.safetensors").keys() == a.keys()
    adapter = export_checkpoint(str(step_dir), str(tmp_path / "adapter"), role="critic", adapter_only=True)
    with_adapter = PeftModel.from_pretrained(AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1),
                                             adapter)
    assert (values_of(with_adapter) - values).abs().max() <= 1e-5


def test_a_critic_starts_from_a_policy_adapter_with_its_own_head(model_dir, tmp_path):
    """A policy's adapter (causal LM, no head) starts the critic's backbone; the head is the new
    one, trained whole."""
    cfg, actor = lora_engine(model_dir)
    step(actor, cfg, 1)
    actor.peft.save_pretrained(str(tmp_path))
    _, critic = critic_engine(model_dir, [f"critic.model.lora_adapter_path={tmp_path}"])
    adapters = {n: p for n, p in critic.module.named_parameters() if ".lora_" in n}
    policy = dict(actor.module.named_parameters())
    assert adapters and all(torch.equal(p, policy[n]) for n, p in adapters.items())
    assert {n for n, p in critic.module.named_parameters() if p.requires_grad} == {
        *adapters, "score.modules_to_save.default.weight", "score.modules_to_save.default.bias"}
