"""DAPO's overlong penalty and dynamic-sampling filter against hand computations."""

import numpy as np
import pytest
import torch

from hybrid_rl.algorithms import groups_with_variance, overlong_penalty


@pytest.mark.parametrize("max_length, buffer, factor", [(20, 4, 1.0), (16, 16, 0.5), (10, 1, 2.0)])
def test_overlong_penalty_is_zero_then_falls_linearly_to_minus_the_factor(max_length, buffer, factor):
    lengths = torch.arange(0, max_length + 1)
    expected = []
    for length in range(max_length + 1):  # verl's dapo reward manager, one sample at a time
        exceed = length - (max_length - buffer)
        expected.append(min(-exceed / buffer * factor, 0.0))
    got = overlong_penalty(lengths, max_length, buffer, factor)
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6)
    assert got[max_length - buffer] == 0 and got[-1] == pytest.approx(-factor)


@pytest.mark.parametrize("buffer", [0, 21])
def test_overlong_buffer_outside_the_response_length_is_refused(buffer):
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([3]), 20, buffer, 1.0)


def test_groups_with_variance_keeps_groups_whose_values_differ_and_singletons():
    values = [1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.25, 1e-12, 0.0]
    index = ["a", "a", "a", "b", "b", "c", "c", "d", "e", "e"]
    expected = []
    for uid in index:  # the DAPO recipe: np.std of the group's values > 0, or a group of one
        group = [v for v, g in zip(values, index) if g == uid]
        expected.append(len(group) == 1 or float(np.std(group)) > 0)
    got = groups_with_variance(torch.tensor(values), index)
    assert got.tolist() == expected == [False, False, False, True, True, False, False, True, True, True]
