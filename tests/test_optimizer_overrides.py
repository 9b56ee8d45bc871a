"""verl's `optim.override_optimizer_config` (torch AdamW's arguments on the FSDP engine, megatron
`OptimizerConfig` fields on the Megatron engine; tests/test_megatron_experts.py runs verl's set)
and `megatron.override_transformer_config`'s kernel switches."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf


def test_fsdp_overrides_reach_adamw():
    from hybrid_rl.engines.fsdp import build_optimizer

    optim = OmegaConf.create({"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.0, "warmup_style": "constant",
                              "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "lr_scheduler_type": "constant",
                              "min_lr_ratio": 0.0, "num_cycles": 0.5,
                              "override_optimizer_config": {"eps": 1e-6, "amsgrad": True, "foreach": True}})
    optimizer, _ = build_optimizer(torch.nn.Linear(4, 4), optim, total_steps=4)
    group = optimizer.param_groups[0]
    assert (group["eps"], group["amsgrad"], group["foreach"]) == (1e-6, True, True) and not group["fused"]
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.99)


def test_megatron_overrides_keep_its_fields_and_drop_the_gpu_only_ones_on_cpu(caplog):
    from hybrid_rl.engines.megatron.engine import optimizer_overrides

    key = "actor_rollout_ref.actor.optim.override_optimizer_config"
    verl = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True,
            "use_precision_aware_optimizer": True, "adam_eps": 1e-7}
    assert optimizer_overrides(key, verl, torch.device("cpu")) == {"adam_eps": 1e-7}
    assert "optimizer_cpu_offload, optimizer_offload_fraction, overlap_cpu_optimizer_d2h_h2d" in caplog.text
    assert optimizer_overrides(key, verl, torch.device("cuda")) == verl
    with pytest.raises(ValueError, match="sets adam_epsilon, which megatron-core's OptimizerConfig does not have"):
        optimizer_overrides(key, {"adam_epsilon": 1e-6}, torch.device("cpu"))


def test_megatron_cuda_kernel_switches_give_way_on_cpu(caplog):
    """verl's Qwen3-MoE scripts switch on Transformer Engine / DeepEP kernels; on CPU megatron's
    torch code runs instead, and experts stay one module each everywhere."""
    from hybrid_rl.engines.megatron.engine import transformer_overrides

    verl = {"apply_rope_fusion": True, "gradient_accumulation_fusion": True, "moe_permute_fusion": True,
            "moe_enable_deepep": True, "moe_token_dispatcher_type": "flex", "moe_grouped_gemm": True,
            "moe_router_dtype": "fp32", "masked_softmax_fusion": False}
    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    assert transformer_overrides(key, verl, torch.device("cpu")) == {"moe_router_dtype": "fp32"}
    assert "apply_rope_fusion, gradient_accumulation_fusion, moe_permute_fusion, moe_enable_deepep, " \
           "moe_token_dispatcher_type=flex not applied" in caplog.text
    on_gpu = transformer_overrides(key, verl, torch.device("cuda"))
    assert "moe_grouped_gemm" not in on_gpu and on_gpu["moe_enable_deepep"] is True


def test_megatron_unbatched_pipeline_messages_give_way_on_cpu(caplog):
    """The CPU device layer tags megatron's batched pipeline messages; its unbatched ones hang on
    gloo, so asking for them is dropped there (and kept on GPU)."""
    from hybrid_rl.engines.megatron.engine import transformer_overrides

    asked = {"batch_p2p_comm": False, "overlap_p2p_comm": True, "deallocate_pipeline_outputs": True}
    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    assert transformer_overrides(key, asked, torch.device("cpu")) == {"deallocate_pipeline_outputs": True}
    assert "batch_p2p_comm=False, overlap_p2p_comm=True not applied on CPU" in caplog.text
    assert transformer_overrides(key, {"batch_p2p_comm": True}, torch.device("cpu")) == {"batch_p2p_comm": True}
    assert transformer_overrides(key, asked, torch.device("cuda")) == asked
