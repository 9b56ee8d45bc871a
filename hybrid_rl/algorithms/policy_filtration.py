"""PF-PPO (policy filtration for PPO, Zhang et al. 2024, "Policy Filtration in RLHF to Fine-Tune
LLM for Code Generation"): after GAE, the batch is drawn again with replacement, each response
with probability proportional to a weight of its score, so that the responses whose rewards the
reward model gets right more often (the best and, with `max_min`, the worst) are trained on more.
verl's `algorithm.use_pf_ppo` with `algorithm.pf_ppo.reweight_method` and `weight_pow`.
"""

from __future__ import annotations

import torch

from .registry import Registry

PF_PPO_WEIGHTS = Registry("PF-PPO reweight method")
FLOOR = 1e-8  # every response keeps a (tiny) chance of being drawn


@PF_PPO_WEIGHTS.register("pow")
def pow_weights(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    """w_i = |s_i|^p, with p = `weight_pow`."""
    return scores.abs().pow(weight_pow)


@PF_PPO_WEIGHTS.register("max_min")
def max_min_weights(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    """w_i = 1 where s_i is the batch's highest or lowest score, else 0."""
    return ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)


@PF_PPO_WEIGHTS.register("max_random")
def max_random_weights(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    """w_i = 0.4 where s_i is the batch's highest score, else 0.1."""
    return torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)


@torch.no_grad()
def pf_ppo_resample(scores: torch.Tensor, reweight_method: str, weight_pow: float,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Row indices of the filtered batch: B draws, with replacement, from the B responses with
    P(i) ∝ max(w_i + 1e-8, 1e-8), w from `reweight_method` on the responses' scores s (B,)."""
    weights = PF_PPO_WEIGHTS.get(reweight_method)(scores.float(), weight_pow)
    weights = (weights + FLOOR).clamp_min(FLOOR)
    return torch.multinomial(weights, len(scores), replacement=True, generator=generator)
