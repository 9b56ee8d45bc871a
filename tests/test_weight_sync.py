"""`weight_sync.sync_weights` pushes the float32 masters and lets vLLM's loaders cast them into a
bf16 engine: the engine must then hold exactly what casting first would have given it. On CPU a
push of some tensors repacks every layer that uses them, the LM head tied to the embedding too."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
from transformers import AutoConfig

from hybrid_rl.workers.vllm_cpu import in_place_sync

pytestmark = pytest.mark.slow


def bf16_engine_samples(model_dir: str, in_place: bool, lora_adapters: bool) -> dict:
    """In a fresh process, as one worker rank: an FSDP actor and a bf16 vLLM engine. Samples
    after pushing the weights cast to bf16 first, after pushing other weights, and after pushing
    the first weights again as float32 masters (`sync_weights`); then after pushes of a few
    changed tensors."""
    import os

    import torch
    import torch.distributed as dist

    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.controller.worker import get_free_port
    from hybrid_rl.engines import ModelSpec, build_engine
    from hybrid_rl.workers.rollout import VLLMRollout
    from hybrid_rl.workers.weight_sync import sync_weights

    port = get_free_port("127.0.0.1")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VLLM_CPU_KVCACHE_SPACE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = compose_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.dtype=bfloat16",
                          "actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.prompt_length=32",
                          "actor_rollout_ref.rollout.response_length=16",
                          f"actor_rollout_ref.rollout.cpu_in_place_sync={in_place}"]
                         + (["+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_lora=true",
                             "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_lora_rank=8"] if lora_adapters else []))
    actor = cfg.actor_rollout_ref.actor
    engine = build_engine(ModelSpec("actor", model_dir, cfg.actor_rollout_ref.model, optim_cfg=actor.optim),
                          actor, torch.device("cpu"))
    rollout = VLLMRollout(model_dir, cfg.actor_rollout_ref.rollout, torch.device("cpu"), [])
    in_place = rollout.load_in_place
    _, _, sample = seeded_sampler(model_dir, rollout, cfg)
    masters = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    rollout.load_weights(engine.per_tensor_weights(torch.bfloat16))
    pre_cast = sample()
    with torch.no_grad():
        for param in engine.module.parameters():
            param.add_(0.05 * torch.randn_like(param))
    sync_weights(engine, rollout)
    other = sample()
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            param.copy_(masters[name])
    sync_weights(engine, rollout)
    float32_push = sample()
    # Pushes of a few tensors: a scaled embedding (which the tied LM head multiplies by as well)
    # and a scaled MLP weight, with all the others, with the others left out, and with the
    # embedding under its own name only (transformers' state dict names the head too).
    scaled = dict(engine.per_tensor_weights(torch.bfloat16))
    changed = ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight")
    for name in changed:
        scaled[name] = scaled[name] * 1.5
    rollout.load_weights(scaled.items())
    full_scaled = sample()
    sync_weights(engine, rollout)
    rollout.load_weights([(name, scaled[name]) for name in changed])
    only_changed = sample()
    sync_weights(engine, rollout)
    rollout.load_weights([(name, scaled[name]) for name in changed if name != "lm_head.weight"])
    return {"pre_cast": pre_cast, "other": other, "float32_push": float32_push, "full_scaled": full_scaled,
            "only_changed": only_changed, "head_unnamed": sample(),
            # (vLLM's reload frees the weights it packs: nothing to compare with there.)
            "packed_error": max(rollout.llm.apply_model(packed_layer_error)) if in_place else 0.0,
            "in_place": in_place, "kept_bytes": rollout.kept_weight_bytes,
            "logged": rollout.settings()["cpu_in_place_sync"],
            "compiled_frames": torch._dynamo.utils.counters["frames"]["total"]}


def seeded_sampler(model_dir: str, rollout, cfg, copies: int = 1):
    """Three short prompts (`copies` times each), left-padded as the trainer collates them, and a
    function that samples 16 tokens of each at temperature 1 from seed 0: (tokenizer, prompts, sample)."""
    import torch
    from transformers import AutoTokenizer

    from hybrid_rl.protocol import Batch
    from hybrid_rl.workers.rollout import sampling_settings

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenizer(text)["input_ids"] for text in ("1 + 2 =", "What is 7 + 5?", "Count: 3 4 5")] * copies
    width = max(map(len, rows))
    prompts = Batch({"input_ids": torch.tensor([[0] * (width - len(r)) + r for r in rows]),
                     "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])})
    settings = {**sampling_settings(cfg.actor_rollout_ref.rollout, validate=False), "temperature": 1.0}

    def sample():
        torch.manual_seed(0)
        return rollout.generate(prompts, settings, 16)

    return tokenizer, prompts, sample


def packed_layer_error(model) -> float:
    """The largest relative gap, over vLLM-CPU's packed linear layers (the LM head included),
    between a layer's packed matmul and a plain one with the weight it holds."""
    import torch

    from hybrid_rl.workers.vllm_cpu import packed_linear_layers

    worst = 0.0
    for _, module in packed_linear_layers(model):
        x = torch.randn(4, module.weight.shape[1], dtype=module.weight.dtype)
        plain = torch.nn.functional.linear(x, module.weight).float()
        packed = module.cpu_linear(x, module.weight, None).float()
        worst = max(worst, ((packed - plain).abs().max() / plain.abs().max()).item())
    return worst


# (`auto`: the tiny model's kept weights are far below an eighth of any machine's memory.)
@pytest.mark.parametrize("in_place, lora_adapters", [("auto", False), (False, False), (True, True)],
                         ids=["in_place", "vllm_reload", "vllm_lora_adapters"])
def test_float32_pushes_land_as_their_bf16_cast(tiny_model_dir, in_place, lora_adapters):
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = pool.submit(bf16_engine_samples, tiny_model_dir, in_place, lora_adapters).result()
    # An engine with vLLM's LoRA adapters always reloads through vLLM.
    assert runs["in_place"] == runs["logged"] == (bool(in_place) and not lora_adapters)
    in_place = runs["in_place"]
    assert runs["other"] != runs["pre_cast"]  # the push in between took effect
    assert runs["float32_push"] == runs["pre_cast"]  # tokens and log-probs, to the last bit
    assert runs["full_scaled"] != runs["float32_push"]
    assert runs["only_changed"] == runs["full_scaled"]
    if in_place:  # vLLM's reload leaves a tied head that is not named at its old values
        assert runs["head_unnamed"] == runs["full_scaled"]
    assert runs["packed_error"] < 0.02  # bf16 rounding; a layer left with other weights is off by ~1
    assert runs["compiled_frames"] == 0  # an eager engine compiles none of vLLM's sampling helpers
    # What keeping the weights costs, in bf16: each layer's q, k, v, o, gate, up and down
    # projections (the tied LM head is the embedding, kept anyway).
    config = AutoConfig.from_pretrained(tiny_model_dir)
    hidden, inner, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    per_layer = 2 * hidden * hidden + 2 * kv * hidden + 3 * inner * hidden
    assert runs["kept_bytes"] == 2 * config.num_hidden_layers * per_layer


GB = 10**9


@pytest.mark.parametrize("setting, kept_gb, ranks, keep", [
    ("auto", 0.42, 2, True),  # SmolLM2-135M in float32, two ranks
    ("auto", 2.62, 1, True),  # Qwen2.5-1.5B in bf16
    ("auto", 5.24, 1, False),  # Qwen2.5-1.5B in float32
    ("auto", 2.62, 2, False),  # two ranks of it in bf16
    (True, 5.24, 1, True), (False, 0.42, 1, False),
])
def test_auto_keeps_the_linear_weights_when_they_are_small_against_the_node(setting, kept_gb, ranks, keep):
    assert in_place_sync(setting, int(kept_gb * GB), ranks, 24 * 2**30) is keep


def moe_engine_log_prob_gaps(model_dir: str, in_place,
                             one_tensor: str = "model.layers.0.self_attn.q_proj.weight") -> dict:
    """In a fresh process, as one worker rank: an FSDP actor and a float32 vLLM engine of a
    mixture-of-experts model. The largest gap between the engine's prompt log-probs and the
    actor's after pushing its weights; after changing every weight (experts included) and
    pushing; after changing and pushing one attention weight only (the experts layers keep what
    they hold)."""
    import os

    import torch
    import torch.distributed as dist
    from vllm import SamplingParams

    from hybrid_rl.config_keys import compose_config
    from hybrid_rl.controller.worker import get_free_port
    from hybrid_rl.engines import ModelSpec, build_engine
    from hybrid_rl.workers.rollout import VLLMRollout
    from hybrid_rl.workers.weight_sync import sync_weights

    port = get_free_port("127.0.0.1")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VLLM_CPU_KVCACHE_SPACE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = compose_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.dtype=float32",
                          "actor_rollout_ref.actor.fsdp_config.dtype=fp32",
                          "actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.prompt_length=32",
                          "actor_rollout_ref.rollout.response_length=16",
                          f"actor_rollout_ref.rollout.cpu_in_place_sync={in_place}"])
    actor = cfg.actor_rollout_ref.actor
    engine = build_engine(ModelSpec("actor", model_dir, cfg.actor_rollout_ref.model, optim_cfg=actor.optim),
                          actor, torch.device("cpu"))
    try:
        rollout = VLLMRollout(model_dir, cfg.actor_rollout_ref.rollout, torch.device("cpu"), [])
    except ValueError as exc:
        return {"error": str(exc)}
    prompts = [[5, 17, 33, 100, 200, 7, 9, 150, 42, 11], [60, 61, 62, 63, 64, 65, 66, 67, 3, 4, 5, 6]]

    def gap() -> tuple[float, list]:
        """Over the prompts (prefill) and five sampled tokens after the first (decoding)."""
        outputs = rollout.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                       SamplingParams(max_tokens=6, prompt_logprobs=0, logprobs=0, seed=0),
                                       use_tqdm=False)
        worst, engine_log_probs = 0.0, []
        for ids, output in zip(prompts, outputs):
            completion = output.outputs[0]
            full = ids + list(completion.token_ids)
            with torch.no_grad():
                expected = torch.log_softmax(engine.module(torch.tensor([full])).logits[0].float(), -1)
            got = [output.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
            got += [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
            want = [expected[i - 1, full[i]].item() for i in range(1, len(full))]
            worst = max(worst, max(abs(a - b) for a, b in zip(got, want)))
            engine_log_probs += got[:len(ids) - 1]
        return worst, engine_log_probs

    sync_weights(engine, rollout)
    first, before = gap()
    with torch.no_grad():
        for param in engine.module.parameters():
            param.add_(0.05 * torch.randn_like(param))
    sync_weights(engine, rollout)
    changed, after = gap()
    with torch.no_grad():
        weight = engine.module.get_parameter(one_tensor)
        weight.add_(0.05 * torch.randn_like(weight))
    rollout.load_weights([(name, tensor) for name, tensor in engine.per_tensor_weights(None) if name == one_tensor])
    one_tensor, _ = gap()
    return {"first": first, "changed": changed, "one_tensor": one_tensor,
            "moved": max(abs(a - b) for a, b in zip(before, after)),
            "kept_bytes": rollout.kept_weight_bytes}


@pytest.mark.parametrize("family, in_place", [("qwen3_moe", "auto"), ("qwen2_moe", "auto"), ("mixtral", "auto"),
                                              ("qwen3_moe", False), ("deepseek_v3", "auto")])
def test_mixture_of_experts_pushes_reach_the_experts(tiny_moe_model_dirs, tiny_latent_model_dirs, family, in_place):
    """vLLM-CPU packs expert weights for its kernel on the first load only; pushes copy into kept
    weights in the checkpoint's layout and pack again (Qwen3-MoE's expert size is padded when
    packed). transformers holds the experts stacked (`experts.gate_up_proj`) and, for Mixtral,
    under other module names than its files: the engine gets the files' names and layout.
    DeepSeek-V3's latent attention runs on vLLM-CPU's MLA backend, prefill and decoding, and a
    push of its latent up-projection alone (`kv_b_proj`) reaches both."""
    if family == "deepseek_v3":
        model_dir, one_tensor = tiny_latent_model_dirs[family], "model.layers.0.self_attn.kv_b_proj.weight"
    else:
        model_dir, one_tensor = tiny_moe_model_dirs[family], "model.layers.0.self_attn.q_proj.weight"
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = pool.submit(moe_engine_log_prob_gaps, model_dir, in_place, one_tensor).result()
    if not in_place:  # vLLM's own reload leaves the experts unpacked: refused at start
        assert "mixture-of-experts" in runs["error"] and "cpu_in_place_sync=true" in runs["error"]
        return
    assert runs["first"] < 1e-5 and runs["changed"] < 1e-5 and runs["one_tensor"] < 1e-5
    assert runs["moved"] > 1e-3  # the second push changed what the engine computes
    if family == "deepseek_v3":  # (the count below is for the grouped-query attention families)
        return
    # The kept copies: each layer's q, k, v, o projections, its router and its experts' gate, up
    # and down projections in float32 (the tied LM head is the embedding).
    config = AutoConfig.from_pretrained(model_dir)
    hidden, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    per_layer = 2 * hidden * hidden + 2 * kv * hidden + experts * hidden + 3 * experts * inner * hidden
    shared = getattr(config, "shared_expert_intermediate_size", 0)  # Qwen2-MoE's, and its gate
    per_layer += 3 * shared * hidden + hidden if shared else 0
    assert runs["kept_bytes"] == 4 * config.num_hidden_layers * per_layer
