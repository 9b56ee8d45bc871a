"""vLLM-CPU's fused RMSNorm kernels behind vLLM's norm ops (`vllm_cpu.register_norm_kernels`):
the same outputs as vLLM's native implementation, chosen for an eager CPU engine only, and
native wherever the kernels do not apply."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.config_keys import compose_config
from hybrid_rl.workers.rollout import engine_kwargs
from hybrid_rl.workers.vllm_cpu import NORM_PROVIDER, kernels_round_to_bf16, norm_priority, register_norm_kernels


@pytest.fixture(scope="module")
def ops():
    from vllm import ir

    register_norm_kernels()
    register_norm_kernels()  # a second engine in the process registers nothing twice
    return ir.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_give_the_native_norms(ops, dtype):
    torch.manual_seed(0)
    x = (3 * torch.randn(37, 576)).to(dtype)
    residual = torch.randn(37, 576).to(dtype)
    weight = (1 + 0.1 * torch.randn(576)).to(dtype)
    native_norm = ops.rms_norm.impls["native"].impl_fn
    native_add_norm = ops.fused_add_rms_norm.impls["native"].impl_fn
    ours_norm = ops.rms_norm.impls[NORM_PROVIDER].impl_fn
    ours_add_norm = ops.fused_add_rms_norm.impls[NORM_PROVIDER].impl_fn

    expected = native_norm(x, weight, 1e-5)
    expected_out, expected_sum = native_add_norm(x, residual, weight, 1e-5)
    got = ours_norm(x, weight, 1e-5)
    x_in, residual_in = x.clone(), residual.clone()
    got_out, got_sum = ours_add_norm(x_in, residual_in, weight, 1e-5)

    # In place: the normalised sum in x, the sum in the residual.
    assert got_out.data_ptr() == x_in.data_ptr() and got_sum.data_ptr() == residual_in.data_ptr()
    if dtype == torch.bfloat16 and not kernels_round_to_bf16():
        # Without bf16 instructions the kernels truncate to bf16 (the sum: its float32 value with
        # the low 16 bits cleared), so bf16 norms are not handed to them on this CPU.
        float_sum = x.float() + residual.float()
        assert torch.equal(got_sum, (float_sum.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16())
        with ops.fused_add_rms_norm.set_priority(norm_priority()["fused_add_rms_norm"]):
            assert ops.fused_add_rms_norm.dispatch(x, residual.clone(), weight, 1e-5).provider == "native"
        with ops.rms_norm.set_priority(norm_priority()["rms_norm"]):
            assert ops.rms_norm.dispatch(x, weight, 1e-5).provider == "native"
        return
    assert torch.equal(got_sum, expected_sum)
    exact_sum = x.double() + residual.double()
    for ours, native, inputs in ((got, expected, x.double()), (got_out, expected_out, expected_sum.double())):
        if dtype == torch.float32:
            assert float((ours - native).abs().max()) <= 2e-6
        else:
            # Native rounds the normalised row to bf16 before the weight multiplies it, and the
            # fused op normalises the float32 sum; the kernel rounds once, and normalises the sum
            # as rounded into the residual (as transformers' bf16 model does). So within 2 bf16
            # steps of native, and nearer the exact norm of the row it is given.
            assert torch.allclose(ours.float(), native.float(), rtol=2 ** -6, atol=0)
            exact = inputs * torch.rsqrt(inputs.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
            assert (ours.double() - exact).abs().mean() <= (native.double() - exact).abs().mean()
    assert torch.allclose(expected_sum.double(), exact_sum, rtol=2 ** -8, atol=0)


def test_priority_chooses_the_kernels_where_they_apply(ops):
    x = torch.randn(4, 64)
    weight = torch.ones(64)
    with ops.rms_norm.set_priority(norm_priority()["rms_norm"]):
        assert ops.rms_norm.get_priority() == [NORM_PROVIDER, "native"]
        assert ops.rms_norm.dispatch(x, weight, 1e-6).provider == NORM_PROVIDER
        # A strided view, a weight of another dtype, a partial variance, no weight: native.
        assert ops.rms_norm.dispatch(torch.randn(64, 4).t(), weight, 1e-6).provider == "native"
        assert ops.rms_norm.dispatch(x.bfloat16(), weight, 1e-6).provider == "native"
        assert ops.rms_norm.dispatch(x, weight, 1e-6, 32).provider == "native"
        assert ops.rms_norm.dispatch(x, None, 1e-6).provider == "native"
        strided = torch.randn(64, 4).t()
        assert torch.allclose(ops.rms_norm(strided, weight, 1e-6),
                              ops.rms_norm.impls["native"].impl_fn(strided, weight, 1e-6))
    with ops.fused_add_rms_norm.set_priority(norm_priority()["fused_add_rms_norm"]):
        assert ops.fused_add_rms_norm.dispatch(x, x.clone(), weight, 1e-6).provider == NORM_PROVIDER
        assert ops.fused_add_rms_norm.dispatch(x, torch.randn(64, 4).t(), weight, 1e-6).provider == "native"


@pytest.mark.parametrize("device, eager, overrides, expected", [
    ("cpu", True, [], norm_priority()),
    ("cpu", False, [], None),
    ("cuda", True, [], None),
    ("cpu", True, ["+actor_rollout_ref.rollout.engine_kwargs.vllm.ir_op_priority.rms_norm=[native]"],
     {"rms_norm": ["native"]}),
])
def test_eager_cpu_engines_ask_for_the_kernels(device, eager, overrides, expected):
    rollout = compose_config(overrides).actor_rollout_ref.rollout
    assert engine_kwargs(rollout, device, eager=eager).get("ir_op_priority") == expected
