"""The training engines on a CUDA GPU (skipped without one): the Megatron engine against the FSDP
engine on the same model, batch and seed; megatron's bf16 path; FSDP2's CPU offload
(`fsdp_config.offload_policy`) and verl's `param_offload` / `optimizer_offload` (and on Megatron
`grad_offload`) change where the weights live, not what a step computes, as `model.enable_activation_offload`
does for the saved activations; LoRA on CUDA (bf16 compute) computes what it does on the CPU."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from hybrid_rl.engines import Output, activation_offload
from tests.conftest import build_tiny_model
from tests.engine_helpers import actor_config, make_engine, offloaded, rollout_batch, step, weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module", autouse=True)
def one_rank_process_group():
    """The process group a one-GPU worker has (NCCL for CUDA tensors, gloo for CPU ones)."""
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{os.path.join(folder, 'init')}",
                                rank=0, world_size=1)
        yield
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    return build_tiny_model(tmp_path_factory.mktemp("gpu_model"), tiny_tokenizer, num_layers=4, rope_theta=1e5)


def test_megatron_matches_fsdp_on_cuda(model_dir):
    mask = rollout_batch(1)["response_mask"].bool()
    results = {}
    for strategy in ("fsdp2", "megatron"):
        cfg = actor_config(strategy)  # fp32
        engine = make_engine(cfg, model_dir, CUDA)
        assert engine.device.type == "cuda"
        before = weights(engine)
        infer = engine.infer(rollout_batch(1), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)
        first = step(engine, cfg, 1)
        results[strategy] = {"before": before, "infer": infer, "first": first, "after": weights(engine)}
    fsdp, megatron = results["fsdp2"], results["megatron"]
    for key in ("log_probs", "entropy"):
        assert (megatron["infer"][key] - fsdp["infer"][key])[mask].abs().max() <= 1e-4
    assert megatron["first"]["actor/loss"] == pytest.approx(fsdp["first"]["actor/loss"], rel=1e-4)
    assert megatron["first"]["actor/grad_norm"] == pytest.approx(fsdp["first"]["actor/grad_norm"], rel=1e-4)
    assert set(megatron["after"]) == set(fsdp["after"])
    update = torch.cat([(megatron["after"][k] - fsdp["before"][k]).flatten() for k in fsdp["after"]])
    expected = torch.cat([(fsdp["after"][k] - fsdp["before"][k]).flatten() for k in fsdp["after"]])
    assert (update - expected).norm() / expected.norm() <= 1e-3


def test_megatron_bf16_on_cuda(model_dir):
    fsdp_cfg = actor_config("fsdp2")
    expected = make_engine(fsdp_cfg, model_dir, CUDA).infer(rollout_batch(1), Output.LOG_PROBS, 0.7, 3, None)
    cfg = actor_config("megatron", dtype="bf16")
    engine = make_engine(cfg, model_dir, CUDA)
    assert engine.config.params_dtype == torch.bfloat16
    infer = engine.infer(rollout_batch(1), Output.LOG_PROBS, 0.7, 3, None)
    mask = rollout_batch(1)["response_mask"].bool()
    assert 0 < (infer["log_probs"] - expected["log_probs"])[mask].abs().max() <= 0.1
    metrics = step(engine, cfg, 1)
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"])) and metrics["actor/skipped_steps"] == 0


def test_fsdp_cpu_offload_on_cuda(model_dir):
    runs = {}
    for offload in (False, True):
        cfg = actor_config("fsdp2", extra=[f"actor_rollout_ref.actor.fsdp_config.offload_policy={offload}"])
        engine = make_engine(cfg, model_dir, CUDA)
        devices = {p.to_local().device.type for p in engine.module.parameters()}
        before = weights(engine)
        runs[offload] = {"devices": devices, "before": before, "first": step(engine, cfg, 1),
                         "second": step(engine, cfg, 2), "after": weights(engine)}
    assert runs[False]["devices"] == {"cuda"} and runs[True]["devices"] == {"cpu"}
    for key in ("actor/loss", "actor/grad_norm"):
        assert runs[True]["first"][key] == pytest.approx(runs[False]["first"][key], rel=1e-5)
        assert runs[True]["second"][key] == pytest.approx(runs[False]["second"][key], rel=1e-4)
    for name, tensor in runs[False]["after"].items():
        assert tensor.device.type == runs[True]["after"][name].device.type == "cuda"
        torch.testing.assert_close(runs[True]["after"][name], tensor, rtol=1e-5, atol=1e-6)


def test_fsdp_activation_offload_on_cuda(model_dir, monkeypatch):
    """What the forward saves waits in pinned host memory (with and without recomputation), and the
    backward pass computes the same update from it."""
    monkeypatch.setattr(activation_offload, "MIN_OFFLOAD_BYTES", 0)  # the tiny model's tensors are small
    for checkpointing in (False, True):
        runs = {}
        for offload in (False, True):
            cfg = actor_config("fsdp2", extra=[
                f"actor_rollout_ref.model.enable_activation_offload={offload}",
                f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}"])
            engine = make_engine(cfg, model_dir, CUDA)
            runs[offload] = {"first": step(engine, cfg, 1), "second": step(engine, cfg, 2), "after": weights(engine)}
        assert "actor/activation_offload_gb" not in runs[False]["first"]
        assert runs[True]["first"]["actor/activation_offload_gb"] > 0
        for key in ("actor/loss", "actor/grad_norm"):
            assert runs[True]["first"][key] == pytest.approx(runs[False]["first"][key], rel=1e-6)
            assert runs[True]["second"][key] == pytest.approx(runs[False]["second"][key], rel=1e-6)
        for name, tensor in runs[False]["after"].items():
            torch.testing.assert_close(runs[True]["after"][name], tensor, rtol=1e-6, atol=1e-7)


def test_fsdp_param_and_optimizer_offload_on_cuda(model_dir, tmp_path):
    """Between uses the weights and the Adam moments wait in host memory; every forward, update
    and checkpoint brings them back first, and computes what a resident engine computes."""
    keys = ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload")
    runs = {}
    for offload in (False, True):
        cfg = actor_config("fsdp2", extra=[f"{key}={offload}" for key in keys])
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        engine = make_engine(cfg, model_dir, CUDA)
        first = step(engine, cfg, 1)
        engine.save_checkpoint(str(tmp_path / f"ckpt_{offload}"))
        engine.load_checkpoint(str(tmp_path / f"ckpt_{offload}"))
        infer = engine.infer(rollout_batch(3), Output.LOG_PROBS, 0.7, 3, None)
        second = step(engine, cfg, 2)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - baseline
        runs[offload] = {
            "first": first, "second": second, "infer": infer, "after": weights(engine), "held": held,
            "params": {p.to_local().device.type for p in engine.module.parameters()},
            "optimizer": {v.device.type for state in engine.optimizer.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor)},
        }
        del engine
    assert runs[False]["params"] == runs[False]["optimizer"] == {"cuda"}
    assert runs[True]["params"] == runs[True]["optimizer"] == {"cpu"}
    assert runs[True]["held"] < 0.05 * runs[False]["held"]
    for key in ("actor/loss", "actor/grad_norm"):
        assert runs[True]["first"][key] == pytest.approx(runs[False]["first"][key], rel=1e-5)
        assert runs[True]["second"][key] == pytest.approx(runs[False]["second"][key], rel=1e-4)
    torch.testing.assert_close(runs[True]["infer"]["log_probs"], runs[False]["infer"]["log_probs"])
    for name, tensor in runs[False]["after"].items():
        torch.testing.assert_close(runs[True]["after"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_megatron_offload_on_cuda(model_dir, tmp_path, dtype):
    """Megatron with verl's param_offload, optimizer_offload and grad_offload holds (almost) no
    GPU memory between uses, and computes what a resident engine computes."""
    keys = [f"actor_rollout_ref.actor.megatron.{k}" for k in ("param_offload", "optimizer_offload", "grad_offload")]
    runs = {}
    for offload in (False, True):
        cfg = actor_config("megatron", dtype=dtype, extra=[f"{key}={offload}" for key in keys])
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        # "cuda" without an index, as the workers name it: cuda:0 tensors are on it too.
        engine = make_engine(cfg, model_dir, torch.device("cuda"))
        before = {k: v.cpu() for k, v in weights(engine).items()}
        first = step(engine, cfg, 1)
        engine.save_checkpoint(str(tmp_path / f"ckpt_{dtype}_{offload}"))
        engine.load_checkpoint(str(tmp_path / f"ckpt_{dtype}_{offload}"))
        infer = engine.infer(rollout_batch(3), Output.LOG_PROBS, 0.7, 3, None)
        second = step(engine, cfg, 2)
        torch.cuda.synchronize()
        held, away = torch.cuda.memory_allocated() - baseline, offloaded(engine)
        after = {k: v.cpu() for k, v in weights(engine).items()}
        runs[offload] = {"first": first, "second": second, "infer": infer, "held": held, "away": away,
                         "update": torch.cat([(after[k] - before[k]).flatten() for k in sorted(after)])}
        del engine
    assert runs[True]["away"] == {"params": True, "moments": True, "grads": True}
    assert runs[True]["held"] < 0.05 * runs[False]["held"]
    # CUDA's attention backward accumulates in no fixed order: equal up to that, not bitwise.
    rel = 1e-2 if dtype == "bf16" else 1e-4
    for key in ("actor/loss", "actor/grad_norm"):
        assert runs[True]["first"][key] == pytest.approx(runs[False]["first"][key], rel=rel)
        assert runs[True]["second"][key] == pytest.approx(runs[False]["second"][key], rel=rel)
    torch.testing.assert_close(runs[True]["infer"]["log_probs"], runs[False]["infer"]["log_probs"], rtol=rel, atol=rel)
    expected = runs[False]["update"]
    assert (runs[True]["update"] - expected).norm() <= rel * expected.norm()


def test_lora_on_cuda_matches_the_cpu(model_dir):
    """An adapter trained on the GPU (FSDP2, float32): the same losses, the same merged weights,
    and the same reference (the base model) as on the CPU."""
    from hybrid_rl.engines.lora import AdapterDisabled

    cfg = actor_config("fsdp2", extra=["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"])
    runs = {}
    for device in (torch.device("cpu"), CUDA):
        torch.manual_seed(0)  # the adapter's A, as the worker seeds it
        engine = make_engine(cfg, model_dir, device)
        runs[device.type] = {"first": step(engine, cfg, 1), "second": step(engine, cfg, 2), "after": weights(engine),
                             "ref": AdapterDisabled(engine).infer(rollout_batch(3), Output.LOG_PROBS, 0.7, 3, None)}
    for key in ("actor/loss", "actor/grad_norm"):
        assert runs["cuda"]["second"][key] == pytest.approx(runs["cpu"]["second"][key], rel=1e-4)
    for name, tensor in runs["cpu"]["after"].items():
        torch.testing.assert_close(runs["cuda"]["after"][name].cpu(), tensor, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runs["cuda"]["ref"]["log_probs"], runs["cpu"]["ref"]["log_probs"], rtol=0, atol=1e-4)


def test_compiled_layers_on_cuda(model_dir):
    """Decoder layers compiled by Inductor's CUDA (Triton) backend train as the eager ones."""
    from tests.test_compiled_layers import assert_same_training, run

    torch._dynamo.reset()
    assert_same_training(run(model_dir, False, device=CUDA), run(model_dir, True, device=CUDA))


def test_megatron_recomputation_on_cuda(model_dir):
    """`enable_gradient_checkpointing` on the Megatron engine: megatron's full per-layer
    recomputation, the same update with far fewer activations kept."""
    from tests.test_gradient_checkpointing import assert_same_update_fewer_activations, checkpointed_update

    runs = [checkpointed_update(model_dir, flag, CUDA, strategy="megatron") for flag in (False, True)]
    assert_same_update_fewer_activations(*runs)


def test_megatron_reward_model_on_cuda(tmp_path, tiny_tokenizer):
    """`reward_model.strategy=megatron` on CUDA: float32 scores equal the FSDP engine's."""
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.engines import Head, ModelSpec, build_engine

    torch.manual_seed(0)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=tiny_tokenizer.pad_token_id,
        num_labels=1)).save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    rm = compose_config(["reward_model.megatron.dtype=fp32", "reward_model.model.fsdp_config.dtype=fp32"],
                        config_name="ppo_megatron_trainer").reward_model
    scores = {}
    for strategy in ("fsdp", "megatron"):
        role_cfg = OmegaConf.create({"strategy": strategy, "fsdp_config": rm.model.fsdp_config, "megatron": rm.megatron})
        engine = build_engine(ModelSpec("reward_model", str(tmp_path / "rm"), rm.model, head=Head.SCORE), role_cfg,
                              CUDA)
        scores[strategy] = engine.infer(rollout_batch(1), Output.SCORES, 1.0, 3, None)["scores"]
    torch.testing.assert_close(scores["megatron"], scores["fsdp"], rtol=1e-4, atol=1e-4)


def test_megatron_from_a_dist_checkpoint_on_cuda(model_dir, tmp_path):
    """`megatron.use_dist_checkpointing`: the converted checkpoint loads onto the GPU with the
    Hugging Face folder's exact weights."""
    import subprocess
    import sys

    out = tmp_path / "mcore"
    subprocess.run([sys.executable, "tools/convert_hf_to_mcore.py", "--hf-model-path", model_dir, "--output-path",
                    str(out)], check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dist_keys = [f"actor_rollout_ref.actor.megatron.{k}" for k in ("use_dist_checkpointing=true",
                                                                     f"dist_checkpointing_path={out}")]
    hf = weights(make_engine(actor_config("megatron"), model_dir, CUDA))
    converted = weights(make_engine(actor_config("megatron", extra=dist_keys), model_dir, CUDA))
    assert set(hf) == set(converted) and all(torch.equal(hf[k], converted[k]) for k in hf)
