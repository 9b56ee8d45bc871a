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


@RM_LOSSES.register("pairwise", "bradley_terry")
def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry: the negative log-likelihood that the chosen response wins, per pair:

    ℓ = −log σ(r_chosen − r_rejected)
    """
    return -F.logsigmoid(chosen.float() - rejected.float())
