"""Losses for training a reward model r(x, y) (a sequence classifier's scalar score)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import Registry

RM_LOSSES = Registry("reward-model loss")


@RM_LOSSES.register("pointwise")
def pointwise_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of σ(r) against a label y ∈ [0, 1] (1: a good response), per response:

    ℓ = −[y log σ(r) + (1 − y) log(1 − σ(r))]
    """
    return F.binary_cross_entropy_with_logits(scores.float(), labels.float(), reduction="none")


@RM_LOSSES.register("pointwise_probability")
def probability_loss(probabilities: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of a probability p of "good" (a two-label head's softmax, a step-tag
    scorer's P(good)) against a label y ∈ [0, 1], per example:

    ℓ = −[y log p + (1 − y) log(1 − p)],  p clamped to [1e-7, 1 − 1e-7]

    (computed in float64, where 1 − 1e-7 is not rounded to 1)
    """
    p = probabilities.double().clamp(1e-7, 1 - 1e-7)
    labels = labels.double()
    return (-(labels * p.log() + (1 - labels) * (1 - p).log())).float()


@RM_LOSSES.register("pairwise", "bradley_terry")
def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry: the negative log-likelihood that the chosen response wins, per pair:

    ℓ = −log σ(r_chosen − r_rejected)
    """
    return -F.logsigmoid(chosen.float() - rejected.float())
