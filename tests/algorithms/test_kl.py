import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_rl.algorithms import kl_penalty


def _k3(logp, ref):
    x = min(max(ref - logp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


REFERENCE = {
    "k1": lambda lp, rf: lp - rf,
    "kl": lambda lp, rf: lp - rf,
    "abs": lambda lp, rf: abs(lp - rf),
    "k2": lambda lp, rf: 0.5 * (lp - rf) ** 2,
    "mse": lambda lp, rf: 0.5 * (lp - rf) ** 2,
    "k3": _k3,
    "low_var_kl": _k3,
}


def _logprobs(seed, shape=(4, 9)):
    g = torch.Generator().manual_seed(seed)
    # wide spread to reach both k3 clamps
    return -torch.rand(shape, generator=g, dtype=torch.float64) * 30, -torch.rand(shape, generator=g, dtype=torch.float64) * 30


@pytest.mark.parametrize("kind", sorted(REFERENCE))
def test_estimators_match_elementwise_formula(kind):
    logp, ref = _logprobs(0)
    out = kl_penalty(logp, ref, kind)
    expected = torch.tensor([[REFERENCE[kind](a, b) for a, b in zip(ra, rb)] for ra, rb in zip(logp.tolist(), ref.tolist())], dtype=torch.float64)
    assert out.shape == logp.shape
    torch.testing.assert_close(out, expected)


def test_k3_hits_upper_clamp():
    out = kl_penalty(torch.tensor([[-30.0]]), torch.tensor([[-1.0]]), "k3")
    assert out.item() == 10.0


@settings(max_examples=100, deadline=None)
@given(st.floats(-50, 0, allow_nan=False), st.floats(-50, 0, allow_nan=False))
def test_k3_nonnegative(logp, ref):
    for kind in ("k3", "k3+"):
        assert kl_penalty(torch.tensor([[logp]]), torch.tensor([[ref]]), kind).item() >= 0.0


@pytest.mark.parametrize("plus, base", [("k3+", "k3"), ("low_var_kl+", "k3"), ("k1+", "k1"), ("kl+", "k1")])
def test_straight_through_value_of_base_gradient_of_k2(plus, base):
    logp, ref = _logprobs(1, shape=(3, 5))
    logp = (logp / 10).requires_grad_()  # stay inside k3's clamps, where its gradient differs from k2's
    ref = (ref / 10).requires_grad_()
    value = kl_penalty(logp, ref, plus)
    torch.testing.assert_close(value, kl_penalty(logp, ref, base))
    weights = torch.rand(logp.shape, dtype=torch.float64)
    grads = torch.autograd.grad((value * weights).sum(), (logp, ref))
    k2_grads = torch.autograd.grad((kl_penalty(logp, ref, "k2") * weights).sum(), (logp, ref))
    base_grads = torch.autograd.grad((kl_penalty(logp, ref, base) * weights).sum(), (logp, ref))
    for got, want, other in zip(grads, k2_grads, base_grads):
        torch.testing.assert_close(got, want)
        assert not torch.allclose(got, other)
    # explicit: d/dlogp ½(logp − ref)² = logp − ref
    torch.testing.assert_close(grads[0], (logp - ref).detach() * weights)


def test_k2_plus_is_k2():
    logp, ref = _logprobs(2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2+"), kl_penalty(logp, ref, "k2"))
