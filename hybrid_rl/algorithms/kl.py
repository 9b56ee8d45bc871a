"""Per-token KL estimators between the policy and the reference policy (Schulman's k1/k2/k3)."""

from __future__ import annotations

from typing import Callable

import torch

from .registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = d, d = logp − ref (unbiased, high variance, can be negative)."""
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """|d|."""
    return (logprob - ref_logprob).abs()


# The "+" spellings of k2 are k2 itself: its gradient already is the k2 gradient.
@KL_ESTIMATORS.register("k2", "mse", "k2+", "mse+")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = ½d²; ∇k2 = d·∇logp, an unbiased estimate of ∇KL(π‖π_ref) when sampled from π."""
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = eˣ − x − 1 with x = clamp(ref − logp, −20, 20), then clamped to [−10, 10] (≥ 0, low variance)."""
    x = (ref_logprob - logprob).clamp(-20, 20)
    return (x.exp() - x - 1).clamp(-10, 10)


def _straight_through(estimator: Callable) -> Callable:
    def straight_through(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        k2 = kl_k2(logprob, ref_logprob)
        return estimator(logprob, ref_logprob).detach() + (k2 - k2.detach())

    straight_through.__name__ = straight_through.__qualname__ = f"{estimator.__name__}_plus"
    straight_through.__doc__ = (
        f"Straight-through {estimator.__name__}: sg(k) + ½d² − sg(½d²), the value of k with the gradient of k2.\n"
        "(verl documents these names but never strips the '+', so it cannot run them.)"
    )
    return straight_through


kl_k1_plus = KL_ESTIMATORS.register("k1+", "kl+")(_straight_through(kl_k1))
kl_k3_plus = KL_ESTIMATORS.register("k3+", "low_var_kl+")(_straight_through(kl_k3))


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (batch, response_len) by estimator name (see ``KL_ESTIMATORS``)."""
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)
