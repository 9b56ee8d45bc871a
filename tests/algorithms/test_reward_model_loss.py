"""Reward-model losses against the formulas written out in float64 Python."""

import math

import torch

from hybrid_rl.algorithms.reward_model_loss import RM_LOSSES, pairwise_loss, pointwise_loss, probability_loss


def test_pointwise_loss_is_the_binary_cross_entropy_of_sigmoid_scores():
    scores, labels = [2.0, -1.0, 0.0, 30.0, -3.5], [1.0, 1.0, 0.5, 0.0, 0.25]
    sigmoid = lambda r: 1 / (1 + math.exp(-r))  # noqa: E731
    # log(1 - sigmoid(r)) = -r - log(1 + e^-r), written so for large r, where 1 - sigmoid(r) underflows
    expected = [-(y * math.log(sigmoid(r)) + (1 - y) * (-r - math.log1p(math.exp(-r)))) for r, y in zip(scores, labels)]
    got = pointwise_loss(torch.tensor(scores, dtype=torch.float64), torch.tensor(labels, dtype=torch.float64))
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_pairwise_loss_is_the_bradley_terry_negative_log_likelihood():
    chosen, rejected = [1.0, -2.0, 0.0, 50.0], [0.0, 1.0, 0.0, -50.0]
    expected = [math.log1p(math.exp(-(c - r))) for c, r in zip(chosen, rejected)]
    got = pairwise_loss(torch.tensor(chosen), torch.tensor(rejected))
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    assert RM_LOSSES.get("bradley_terry") is pairwise_loss and RM_LOSSES.get("pointwise") is pointwise_loss


def test_probability_loss_is_the_binary_cross_entropy_of_p_good():
    probabilities, labels = [0.9, 0.2, 0.5, 1.0, 0.0], [1.0, 1.0, 0.5, 0.0, 0.0]
    clamp = lambda p: min(max(p, 1e-7), 1 - 1e-7)  # noqa: E731
    expected = [-(y * math.log(clamp(p)) + (1 - y) * math.log(1 - clamp(p))) for p, y in zip(probabilities, labels)]
    got = probability_loss(torch.tensor(probabilities), torch.tensor(labels))
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5)
    # the same as the pointwise loss of the logit log(p / (1 - p)) of a two-label head
    logits = torch.tensor([1.3, -0.4, 2.2])
    targets = torch.tensor([1.0, 0.0, 0.3])
    assert torch.allclose(probability_loss(logits.sigmoid(), targets), pointwise_loss(logits, targets), atol=1e-6)
