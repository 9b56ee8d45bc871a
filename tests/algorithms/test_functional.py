import math

import torch

from hybrid_rl.algorithms import entropy_from_logits, masked_mean, masked_sum, masked_whiten, token_log_probs


def _random(seed, shape=(5, 7)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(shape, generator=g) < 0.6).double()
    mask[0] = 0  # one empty row
    return x, mask


def test_masked_sum_and_mean_match_loops():
    x, mask = _random(0)
    rows = [[(v, m) for v, m in zip(xr.tolist(), mr.tolist())] for xr, mr in zip(x, mask)]
    flat = [v for row in rows for v, m in row if m]
    torch.testing.assert_close(masked_sum(x, mask), torch.tensor(math.fsum(flat), dtype=torch.float64))
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(sum(flat) / len(flat), dtype=torch.float64))
    row_means = [sum(v for v, m in row if m) / max(sum(m for _, m in row), 1e-8) for row in rows]
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor(row_means, dtype=torch.float64))
    assert masked_mean(x, mask, dim=-1)[0] == 0  # empty row: 0, not NaN


def test_masked_sum_ignores_nan_outside_mask():
    x, mask = _random(1)
    x_nan = x.masked_fill(mask == 0, float("nan"))
    torch.testing.assert_close(masked_sum(x_nan, mask), masked_sum(x, mask))
    assert torch.isfinite(masked_mean(x_nan, mask, dim=0)).all()


def test_masked_whiten_matches_statistics():
    import statistics

    x, mask = _random(2)
    vals = x[mask.bool()].tolist()
    mu, sd = statistics.fmean(vals), statistics.stdev(vals)
    expected = (x - mu) / math.sqrt(sd**2 + 1e-8)
    torch.testing.assert_close(masked_whiten(x, mask), expected)
    white = masked_whiten(x, mask)
    assert abs(masked_mean(white, mask).item()) < 1e-8  # masked_mean has a 1e-8 denominator epsilon


def test_entropy_matches_minus_sum_p_log_p():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 11, generator=g) * 5
    out = entropy_from_logits(logits)
    assert out.shape == (4, 3)
    for idx in [(0, 0), (1, 2), (3, 1)]:
        z = logits[idx].double().tolist()
        zmax = max(z)
        norm = sum(math.exp(v - zmax) for v in z)
        probs = [math.exp(v - zmax) / norm for v in z]
        expected = -sum(p * math.log(p) for p in probs if p > 0)
        assert math.isclose(out[idx].item(), expected, rel_tol=1e-4, abs_tol=1e-5)


def test_token_log_probs_match_a_softmax_by_hand():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 7, generator=g) * 3
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    out = token_log_probs(logits, tokens)
    for i in range(2):
        for t in range(3):
            z = logits[i, t].double().tolist()
            expected = z[tokens[i, t]] - math.log(sum(math.exp(v) for v in z))
            assert math.isclose(out[i, t].item(), expected, rel_tol=1e-5, abs_tol=1e-5)
