"""The rollout engine's KV block size: on CPU under prefix caching, blocks of 32 tokens (prompts
shorter than vLLM-CPU's 128 can then be shared); otherwise vLLM's own choice, and the user's
always wins."""

from __future__ import annotations

import pytest

from hybrid_rl.config_keys import compose_config
from hybrid_rl.workers.rollout import engine_kwargs


@pytest.mark.parametrize("overrides, device, expected", [
    (["actor_rollout_ref.rollout.n=4"], "cpu", 32),
    (["actor_rollout_ref.rollout.n=1"], "cpu", 32),
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.enable_prefix_caching=false"], "cpu", None),
    (["actor_rollout_ref.rollout.n=4"], "cuda", None),
    (["actor_rollout_ref.rollout.n=4", "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=64"], "cpu", 64),
])
def test_block_size(overrides, device, expected):
    rollout = compose_config(overrides).actor_rollout_ref.rollout
    assert engine_kwargs(rollout, device).get("block_size") == expected


def test_latent_attention_keeps_vllm_cpus_blocks_and_takes_torchs_rotary_embedding():
    """DeepSeek's latent attention on CPU: vLLM's own blocks of 16 (its MLA kernel's only size), its
    rotary custom op off, beside what the user set, and the reference MLA backend (vLLM would take
    its AMX one on an AMX CPU) unless the user names one."""
    rollout = compose_config(["+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.custom_ops=[+rms_norm]"]
                             ).actor_rollout_ref.rollout
    kwargs = engine_kwargs(rollout, "cpu", latent_attention=True)
    assert "block_size" not in kwargs
    assert kwargs["compilation_config"]["custom_ops"] == ["+rms_norm", "-rotary_embedding"]
    assert kwargs["attention_backend"] == "CPU_MLA"
    on_gpu = engine_kwargs(rollout, "cuda", latent_attention=True)
    assert on_gpu["compilation_config"] == {"custom_ops": ["+rms_norm"]} and "attention_backend" not in on_gpu
    assert "attention_backend" not in engine_kwargs(rollout, "cpu")
    for chosen, expected in (("attention_backend=AMX_MLA", "AMX_MLA"), ("attention_config.backend=AMX_MLA", None)):
        rollout = compose_config([f"+actor_rollout_ref.rollout.engine_kwargs.vllm.{chosen}"]).actor_rollout_ref.rollout
        assert engine_kwargs(rollout, "cpu", latent_attention=True).get("attention_backend") == expected


def test_cuda_graph_capture_sizes():
    """verl's rollout.cudagraph_capture_sizes: vLLM's compilation_config on GPU with CUDA graphs,
    beside what the user set there; nothing on CPU or in an eager engine."""
    rollout = compose_config(["actor_rollout_ref.rollout.cudagraph_capture_sizes=[1,8,32]",
                              "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.level=3"]
                             ).actor_rollout_ref.rollout
    assert engine_kwargs(rollout, "cuda")["compilation_config"] == {"level": 3, "cudagraph_capture_sizes": [1, 8, 32]}
    assert engine_kwargs(rollout, "cuda", eager=True)["compilation_config"] == {"level": 3}
    assert engine_kwargs(rollout, "cpu", eager=True)["compilation_config"] == {"level": 3}
    from hybrid_rl.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match="cudagraph_capture_sizes=8 must be a list of batch sizes"):
        validate_config(compose_config(["actor_rollout_ref.rollout.cudagraph_capture_sizes=8"]))
