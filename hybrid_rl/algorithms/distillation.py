"""On-policy distillation (verl 0.9's `distillation.*`): per-token losses between the policy being
trained (the student, π_S) and a frozen teacher (π_T), on the student's own samples.

Two kinds, by `distillation_loss.loss_mode`:
- a KL estimator on the sampled token (k1/kl, abs, k2/mse, k3/low_var_kl): the reverse
  KL(π_S ‖ π_T) estimated from the two log-probs of the token the student drew;
- `forward_kl_topk`: KL(π_T ‖ π_S) over the teacher's k most likely tokens at each position,
  which needs the student's whole next-token distribution (its logits).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kl import kl_penalty

# verl's names; the straight-through "+" spellings and the full KL are the KL loss's, not distillation's.
ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOP_K_MODE = "forward_kl_topk"
LOSS_MODES = (*ESTIMATOR_MODES, TOP_K_MODE)


def sampled_token_losses(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token reverse-KL estimate (B, T) with d = log π_S(y) − log π_T(y) of the sampled y:
    k1 = d, abs = |d|, k2 = ½d², k3 = e^(−d) + d − 1 (the KL estimators of `kl.py`)."""
    if mode not in ESTIMATOR_MODES:
        raise ValueError(f"{mode!r} is not a sampled-token distillation loss; valid: {', '.join(ESTIMATOR_MODES)}")
    return kl_penalty(student_log_prob, teacher_log_prob, mode)


class TopKDistillation(NamedTuple):
    losses: torch.Tensor  # (B, T) forward KL over the teacher's top k, floored at 0
    student_mass: torch.Tensor  # (B, T) Σ π_S over the teacher's top k
    teacher_mass: torch.Tensor  # (B, T) Σ π_T over its top k
    overlap_count: torch.Tensor  # (B, T) how many of the teacher's top k are also the student's


def forward_kl_top_k(student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, teacher_ids: torch.Tensor,
                     log_prob_min_clamp: float | None = None) -> TopKDistillation:
    """L_t = max(0, Σ_{i ∈ K_t} π_T(i) · (log π_T(i) − log π_S(i))), K_t the teacher's top k ids at t.

    `student_logits` (B, T, V) give log π_S = log_softmax (already divided by the temperature);
    `teacher_log_probs` / `teacher_ids` (B, T, k) are the teacher's top k. The sum over a truncated
    support can fall below 0, hence the floor. With `log_prob_min_clamp` both sides' log-probs are
    floored at it inside the sum (the masses are taken before). The overlap count (verl's
    diagnostic) compares K_t with the student's own top k.
    """
    log_probs = torch.log_softmax(student_logits.float(), dim=-1)
    teacher_log_probs = teacher_log_probs.float()
    student_at_teacher = log_probs.gather(-1, teacher_ids)
    student_mass = student_at_teacher.exp().sum(-1)
    teacher_mass = teacher_log_probs.exp().sum(-1)
    student_side, teacher_side = student_at_teacher, teacher_log_probs
    if log_prob_min_clamp is not None:
        student_side = student_side.clamp_min(log_prob_min_clamp)
        teacher_side = teacher_side.clamp_min(log_prob_min_clamp)
    per_token = teacher_side.exp() * (teacher_side - student_side)
    losses = per_token.sum(-1).clamp_min(0.0)
    with torch.no_grad():
        student_top = log_probs.topk(teacher_ids.shape[-1], dim=-1).indices
        shared = (teacher_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)
    return TopKDistillation(losses, student_mass.detach(), teacher_mass, shared.sum(-1))
