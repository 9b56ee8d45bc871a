"""verl's `megatron.use_dist_checkpointing` + `dist_checkpointing_path`: a model converted once
into a Megatron dist-checkpoint (tools/convert_hf_to_mcore.py) loads into any TP x PP layout with
exactly the weights of the Hugging Face folder; a critic takes the backbone and keeps its fresh
value head; a missing or wrong path is refused at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_rl.config_keys import compose_config
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from tests.conftest import build_tiny_model
from tests.engine_helpers import actor_config, make_engine, rollout_batch, weights

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST = "actor_rollout_ref.actor.megatron"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    return build_tiny_model(tmp_path_factory.mktemp("dist_weights"), tiny_tokenizer, num_layers=4, rope_theta=1e5)


def convert(model_dir: str, out: str) -> str:
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_mcore.py"),
                          "--hf_model_path", model_dir, "--output_path", out], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def converted(model_dir, tmp_path_factory):
    return convert(model_dir, str(tmp_path_factory.mktemp("mcore") / "ckpt"))


def test_the_converter_writes_megatron_names_with_every_layer_stacked(converted):
    from torch.distributed.checkpoint import FileSystemReader

    assert "sharded_backend" in json.load(open(os.path.join(converted, "metadata.json")))
    tensors = {k: m.size for k, m in FileSystemReader(converted).read_metadata().state_dict_metadata.items()
               if hasattr(m, "size")}
    # Transformer Engine's names (the local spec maps its norms onto them), four layers in one tensor.
    assert tensors["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][0] == 4
    assert tensors["decoder.layers.mlp.linear_fc1.layer_norm_weight"][0] == 4
    assert "embedding.word_embeddings.weight" in tensors and "decoder.final_layernorm.weight" in tensors


def _rank_main(rank, world, init_file, model_dir, converted, out_dir, tp, pp):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for from_dist in (False, True):
        extra = [f"{DIST}.use_dist_checkpointing=true", f"{DIST}.dist_checkpointing_path={converted}"] if from_dist else []
        cfg = actor_config("megatron", tp, pp, extra=extra)
        engine = make_engine(cfg, model_dir)
        results[from_dist] = {"weights": weights(engine),
                              "infer": engine.infer(rollout_batch(1), Output.LOG_PROBS, 0.7, 3, None)}
    critic_cfg = compose_config([
        "critic.strategy=megatron", "critic.megatron.dtype=fp32", f"critic.megatron.tensor_model_parallel_size={tp}",
        f"critic.megatron.pipeline_model_parallel_size={pp}", "critic.megatron.use_dist_checkpointing=true",
        f"critic.megatron.dist_checkpointing_path={converted}"], config_name="ppo_megatron_trainer").critic
    critic = build_engine(ModelSpec("critic", model_dir, critic_cfg.model, head=Head.VALUE, optim_cfg=critic_cfg.optim,
                                    total_steps=4), critic_cfg, torch.device("cpu"))
    results["critic"] = weights(critic)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_a_converted_checkpoint_loads_exactly_into_any_layout(model_dir, converted, tp, pp):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(2, os.path.join(out_dir, "init"), model_dir, converted, out_dir, tp, pp),
                           nprocs=2, start_method="spawn")
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    for result in results:
        hf, mcore = result[False], result[True]
        assert set(hf["weights"]) == set(mcore["weights"])
        assert all(torch.equal(hf["weights"][k], mcore["weights"][k]) for k in hf["weights"])
        assert torch.equal(hf["infer"]["log_probs"], mcore["infer"]["log_probs"])
        critic = result["critic"]
        backbone = {k for k in critic if k.startswith("model.")}
        assert backbone and all(torch.equal(critic[k], hf["weights"][k]) for k in backbone)
        assert "score.weight" in critic  # the fresh value head, not the policy's output layer


@pytest.mark.parametrize("extra, message", [
    ([f"{DIST}.use_dist_checkpointing=true"], f"{DIST}.use_dist_checkpointing=true needs {DIST}.dist_checkpointing_path"),
    ([f"{DIST}.use_dist_checkpointing=true", f"{DIST}.dist_checkpointing_path=/nonexistent/mcore"],
     "is not a Megatron dist-checkpoint"),
])
def test_a_missing_or_wrong_dist_checkpoint_is_refused_naming_the_key(model_dir, extra, message):
    from hybrid_rl.engines.megatron.checks import check_dist_weights

    cfg = actor_config("megatron", extra=extra)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_dist_weights("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.megatron)


def _other_model_rank_main(rank, world, init_file, model_dir, converted, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = actor_config("megatron", extra=[f"{DIST}.use_dist_checkpointing=true",
                                          f"{DIST}.dist_checkpointing_path={converted}"])
    try:
        make_engine(cfg, model_dir)
        message = None
    except ValueError as exc:
        message = str(exc)
    torch.save(message, os.path.join(out_dir, "message.pt"))
    dist.destroy_process_group()


def test_a_checkpoint_of_another_model_is_refused(model_dir, tmp_path, tiny_tokenizer):
    other = convert(build_tiny_model(tmp_path / "two_layers", tiny_tokenizer, num_layers=2),
                    str(tmp_path / "other_ckpt"))
    mp.start_processes(_other_model_rank_main, args=(1, str(tmp_path / "init"), model_dir, other, str(tmp_path)),
                       nprocs=1, start_method="spawn")
    message = torch.load(tmp_path / "message.pt")
    assert message is not None and message.startswith(f"The Megatron dist-checkpoint {other} does not fit this model")
