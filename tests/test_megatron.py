"""The Megatron-core model on this CPU: HF <-> Megatron conversion is bit-exact, including TP
splits and the pipeline stages' broadcast; the model's logits equal transformers', and its
response log-probs and entropies the FSDP engine's, for TP=1 and TP=2; the CPU device layer
restores everything it patched."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_rl.engines.hf_model import ForwardOptions, response_log_probs
from hybrid_rl.engines.megatron import convert
from tests.conftest import build_tiny_model


@pytest.fixture(scope="module")
def gqa_layout():
    """4 query heads in 2 groups, an odd vocabulary (so TP=2 pads it), qkv bias (Qwen2)."""
    return convert.Layout(num_layers=2, heads=4, groups=2, head_dim=3, vocab=11, tied=False, qkv_bias=True,
                          rope_theta=1e4)


def test_qkv_and_gate_up_fuse_and_split_exactly(gqa_layout):
    g = torch.Generator().manual_seed(0)
    hidden = 12
    q, k, v = (torch.randn(n * 3, hidden, generator=g) for n in (4, 2, 2))
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    fused = convert.to_megatron(name, [q, k, v], gqa_layout)
    # Megatron's order: per query group, its 2 query heads, then its key, then its value.
    assert torch.equal(fused[:6], q[:6]) and torch.equal(fused[6:9], k[:3]) and torch.equal(fused[9:12], v[:3])
    assert torch.equal(fused[12:18], q[6:]) and torch.equal(fused[18:21], k[3:])
    back = convert.to_hf(name, fused, gqa_layout)
    assert [n for n, _ in back] == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    assert all(torch.equal(a, b) for (_, a), b in zip(back, [q, k, v]))
    # TP=2: each rank gets whole query groups.
    shards = convert.split_tp(name, fused, 2, gqa_layout)
    assert torch.equal(shards[0], fused[:12]) and torch.equal(convert.merge_tp(name, shards), fused)

    gate, up = torch.randn(8, hidden, generator=g), torch.randn(8, hidden, generator=g)
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    full = convert.to_megatron(fc1, [gate, up], gqa_layout)
    shards = convert.split_tp(fc1, full, 2, gqa_layout)
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))  # each rank: its gate rows over its up rows
    assert torch.equal(convert.merge_tp(fc1, shards), full)


def test_vocabulary_padding_and_column_splits_round_trip(gqa_layout):
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(11, 12, generator=g)
    name = "embedding.word_embeddings.weight"
    shards = convert.split_tp(name, embed, 2, gqa_layout)
    assert [s.shape[0] for s in shards] == [6, 6] and torch.equal(shards[1][-1], torch.zeros(12))
    ((hf_name, back),) = convert.to_hf(name, convert.merge_tp(name, shards), gqa_layout)
    assert hf_name == "model.embed_tokens.weight" and torch.equal(back, embed)
    proj = torch.randn(12, 12, generator=g)
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    shards = convert.split_tp(name, proj, 2, gqa_layout)
    assert shards[0].shape == (12, 6) and torch.equal(convert.merge_tp(name, shards), proj)
    assert not convert.is_tensor_parallel("decoder.layers.0.input_layernorm.weight")
    with pytest.raises(KeyError, match="No Hugging Face name"):
        convert.hf_names("decoder.layers.0.self_attention.linear_kv_down_proj.weight")  # MLA (DeepSeek)


def test_unknown_architecture_is_refused(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="converts LlamaForCausalLM.*strategy=fsdp2"):
        convert.Layout.from_hf_config(config)


def test_expert_routings_megatron_cannot_reproduce_are_refused():
    from transformers import MixtralConfig, Qwen3MoeConfig

    top1 = MixtralConfig(architectures=["MixtralForCausalLM"], num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="one expert with weight 1.*strategy=fsdp2"):
        convert.Layout.from_hf_config(top1)
    dense_first = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], mlp_only_layers=[0])
    with pytest.raises(ValueError, match="every layer is a mixture of experts"):
        convert.Layout.from_hf_config(dense_first)
    assert convert.Layout.from_hf_config(MixtralConfig(architectures=["MixtralForCausalLM"])).experts.top_k == 2


def test_rotary_and_attention_settings_the_conversion_cannot_reproduce_are_refused(tiny_model_dir):
    from transformers import AutoConfig, MixtralConfig, Qwen2Config

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert convert.Layout.from_hf_config(config).rope_theta == 1e4
    config.rope_parameters = {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}
    with pytest.raises(ValueError, match="rope type 'linear'.*strategy=fsdp2"):
        convert.Layout.from_hf_config(config)
    qwen = Qwen2Config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64)
    with pytest.raises(ValueError, match="sliding attention window"):
        convert.Layout.from_hf_config(qwen)
    # Qwen2.5's own configs: a window size, switched off (transformers then makes no sliding layers).
    qwen = Qwen2Config(architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=64)
    assert convert.Layout.from_hf_config(qwen).qkv_bias
    mixtral = MixtralConfig(architectures=["MixtralForCausalLM"], sliding_window=64)
    with pytest.raises(ValueError, match="sliding attention window"):
        convert.Layout.from_hf_config(mixtral)


def test_device_layer_restores_torch_and_checks_the_version(monkeypatch):
    from hybrid_rl.engines.megatron import cpu

    before = (torch.cuda.current_device, torch.cuda.get_rng_state)
    with cpu.cpu_device_layer():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
    assert (torch.cuda.current_device, torch.cuda.get_rng_state) == before
    if not torch.cuda.is_available():
        with pytest.raises(AssertionError, match="not compiled with CUDA"):
            torch.zeros(1, device="cuda")  # the rewrite is gone outside the layer
    assert cpu.check_version() in cpu.CHECKED_VERSIONS
    monkeypatch.setattr(cpu, "CHECKED_VERSIONS", ("0.0.1",))
    with pytest.raises(RuntimeError, match="checked only against 0.0.1.*pip install megatron-core==0.0.1"):
        cpu.check_version()


def rollout_micro(vocab: int) -> dict[str, torch.Tensor]:
    """Three [left-padded prompt | right-padded response] rows of different prompt and response
    lengths, laid out as the rollout assembles them."""
    g = torch.Generator().manual_seed(3)
    prompt_lens, response_lens, prompt_len, response_len = [5, 3, 1], [4, 2, 0], 5, 4
    ids = torch.zeros(3, prompt_len + response_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        ids[row, prompt_len - p:prompt_len + r] = torch.randint(5, vocab, (p + r,), generator=g)
        mask[row, prompt_len - p:prompt_len + r] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0),
            "responses": ids[:, prompt_len:], "response_mask": mask[:, prompt_len:]}


def _rank_main(rank: int, world: int, init_file: str, tp: int, pp: int, model_dir: str, out_dir: str) -> None:
    """One rank: build the Megatron model from the HF folder, export it back, run a forward."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from hybrid_rl.engines.megatron import model as mmodel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    hf_config = AutoConfig.from_pretrained(model_dir)
    layout = convert.Layout.from_hf_config(hf_config)
    with mmodel.device_layer(torch.device("cpu")):
        mmodel.initialize_parallel(tp, pp, None, seed=1)
        config = mmodel.transformer_config(hf_config, layout, None, sequence_parallel=False)
        chunks = mmodel.build_model(hf_config, layout, config)
        mmodel.load_hf_weights(chunks, config, model_dir, layout)
        exported = {name: tensor.clone() for name, tensor in mmodel.iter_hf_weights(chunks, config, layout,
                                                                                    torch.float32)}
        outputs = None
        if pp == 1:
            ids = torch.randint(5, layout.vocab, (2, 10), generator=torch.Generator().manual_seed(0))
            chunks[0].eval()
            with torch.no_grad():
                logits = chunks[0](ids, torch.arange(10).expand(2, -1), None)
                log_probs, entropy = mmodel.response_log_probs(chunks[0], rollout_micro(layout.vocab), 0.7,
                                                              layout.vocab)
            outputs = {"logits": logits, "log_probs": log_probs, "entropy": entropy}
    save_file(exported, os.path.join(out_dir, f"export_rank{rank}.safetensors"))
    if outputs is not None:
        torch.save(outputs, os.path.join(out_dir, f"outputs_rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def rope_model_dir(tmp_path_factory, tiny_tokenizer):
    """Not the default rotary base: SmolLM2's is 1e5, and transformers 5 keeps it in rope_parameters."""
    return build_tiny_model(tmp_path_factory.mktemp("rope_1e5"), tiny_tokenizer, rope_theta=1e5)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_megatron_model_from_hf_round_trips_and_matches_transformers(rope_model_dir, tp, pp):
    tiny_model_dir = rope_model_dir
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    world = tp * pp
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world, os.path.join(out_dir, "init"), tp, pp, tiny_model_dir, out_dir),
                           nprocs=world, start_method="spawn")
        original = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
        for rank in range(world):  # every rank receives every full tensor
            exported = load_file(os.path.join(out_dir, f"export_rank{rank}.safetensors"))
            # The tied output layer is named as in transformers' state dict (vLLM needs it).
            assert exported.keys() == original.keys() | {"lm_head.weight"}
            assert torch.equal(exported["lm_head.weight"], original["model.embed_tokens.weight"])
            assert all(torch.equal(exported[k], original[k]) for k in original), "HF -> Megatron -> HF not exact"
        if pp == 1:
            hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            ids = torch.randint(5, hf.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                expected = hf(ids).logits
            # The FSDP engine's response forward (padded layout) on the same rows.
            micro = rollout_micro(hf.config.vocab_size)
            with torch.no_grad():
                fsdp_lp, fsdp_entropy = response_log_probs(hf, micro, 0.7, ForwardOptions(remove_padding=False))
            mask = micro["response_mask"].bool()
            for rank in range(world):
                outputs = torch.load(os.path.join(out_dir, f"outputs_rank{rank}.pt"))
                assert (outputs["logits"][..., :hf.config.vocab_size] - expected).abs().max() <= 1e-5
                assert (outputs["log_probs"] - fsdp_lp)[mask].abs().max() <= 1e-5
                assert (outputs["entropy"] - fsdp_entropy)[mask].abs().max() <= 1e-5
