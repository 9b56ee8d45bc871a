import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_rl.algorithms import KL_ESTIMATORS, full_kl_from_logits, kl_penalty


def _reference_kl(logits, ref_logits, temperature=1.0):
    """Per-position KL with explicit Python loops over positions and vocabulary, in float64."""
    B, T, V = logits.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            z = [x / temperature for x in logits[b, t].tolist()]
            y = [x / temperature for x in ref_logits[b, t].tolist()]
            lz = max(z) + math.log(sum(math.exp(x - max(z)) for x in z))
            ly = max(y) + math.log(sum(math.exp(x - max(y)) for x in y))
            out[b, t] = sum(math.exp(zi - lz) * ((zi - lz) - (yi - ly)) for zi, yi in zip(z, y))
    return out


def _logits(seed, shape=(3, 5, 11), scale=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=dtype) * scale, torch.randn(shape, generator=g, dtype=dtype) * scale)


def _unchunked(logits, ref_logits, temperature=1.0):
    logp = torch.log_softmax(logits / temperature, -1)
    ref = torch.log_softmax(ref_logits.detach() / temperature, -1)
    return (logp.exp() * (logp - ref)).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 2, 4, 7, 15, 16, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_loop_reference_for_any_chunking(chunk_size, temperature):
    logits, ref = _logits(0)
    out = full_kl_from_logits(logits, ref, temperature=temperature, chunk_size=chunk_size)
    assert out.shape == (3, 5) and out.dtype == torch.float64
    torch.testing.assert_close(out, _reference_kl(logits, ref, temperature))
    torch.testing.assert_close(out, _unchunked(logits, ref, temperature))


def test_bf16_input_computed_in_fp32():
    logits, ref = _logits(1, dtype=torch.float32)
    out = full_kl_from_logits(logits.bfloat16(), ref.bfloat16(), chunk_size=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _unchunked(logits.bfloat16().float(), ref.bfloat16().float()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 100])
def test_gradient_matches_unchunked(chunk_size):
    logits, ref = _logits(2)
    weights = torch.rand(3, 5, dtype=torch.float64)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ref_a = ref.clone().requires_grad_()
    (full_kl_from_logits(a, ref_a, temperature=0.8, chunk_size=chunk_size) * weights).sum().backward()
    (_unchunked(b, ref, temperature=0.8) * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert ref_a.grad is None  # the reference is detached


def test_gradcheck():
    logits, ref = _logits(3, shape=(2, 3, 4))
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: full_kl_from_logits(z, ref, chunk_size=4), (logits,))


def test_checkpointing_keeps_graph_small():
    """With checkpointing the graph saves no (chunk, V) log-softmax; count saved-tensor bytes."""
    logits, ref = _logits(4, shape=(4, 16, 512), dtype=torch.float32)
    logits.requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = full_kl_from_logits(logits, ref, chunk_size=8)
    # Only the chunk inputs (views of logits / ref) and (B, T)-sized results are saved.
    assert max(saved) <= 8 * 512
    assert sum(saved) <= 2 * logits.numel() + 4 * 4 * 16
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _unchunked(logits, ref)
    assert sum(saved) > 2 * logits.numel()  # sanity: the naive graph does save the log-softmaxes
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_equals_expectation_of_sampled_k1():
    """KL = E_{v~π}[log π(v) − log π_ref(v)], i.e. the mean of k1 over tokens sampled from π."""
    logits, ref = _logits(5, shape=(2, 3, 6))
    out = full_kl_from_logits(logits, ref)
    logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
    V = logits.shape[-1]
    for b in range(2):
        for t in range(3):
            # exact expectation over the vocabulary, one token at a time through the k1 estimator
            exact = 0.0
            for v in range(V):
                k1 = kl_penalty(logp[b, t, v].view(1, 1), ref_logp[b, t, v].view(1, 1), "k1").item()
                exact += math.exp(logp[b, t, v].item()) * k1
            assert math.isclose(out[b, t].item(), exact, rel_tol=1e-9, abs_tol=1e-12)
    # Monte Carlo: mean of k1 over many samples from π
    g = torch.Generator().manual_seed(6)
    n = 200_000
    samples = torch.multinomial(logp.exp().reshape(-1, V), n, replacement=True, generator=g)
    k1 = kl_penalty(logp.reshape(-1, V).gather(1, samples), ref_logp.reshape(-1, V).gather(1, samples), "k1")
    mc = k1.mean(-1).reshape(2, 3)
    stderr = k1.std(-1).reshape(2, 3) / math.sqrt(n)
    assert ((mc - out).abs() < 5 * stderr + 1e-3).all()


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3), st.integers(1, 4), st.integers(1, 9), st.integers(1, 5),
    st.floats(0.1, 10.0), st.floats(0.2, 2.0), st.integers(0, 2**31 - 1),
)
def test_nonnegative(B, T, V, chunk, scale, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * scale
    ref = torch.randn(B, T, V, generator=g) * scale
    assert (full_kl_from_logits(logits, ref, temperature=temperature, chunk_size=chunk) >= 0).all()
    assert (full_kl_from_logits(logits, logits.clone(), temperature=temperature, chunk_size=chunk) == 0).all()


def test_kl_penalty_full_raises_clear_error():
    assert "full" in KL_ESTIMATORS
    with pytest.raises(ValueError, match="full KL needs the full logits; the worker computes it with full_kl_from_logits"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "full")


def test_shape_mismatch_and_bad_chunk():
    logits, ref = _logits(7)
    with pytest.raises(ValueError, match="differ in shape"):
        full_kl_from_logits(logits, ref[:, :-1])
    with pytest.raises(ValueError, match="chunk_size"):
        full_kl_from_logits(logits, ref, chunk_size=0)
