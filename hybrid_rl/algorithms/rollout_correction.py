"""Rollout correction: importance weights and rejection for the rollout engine ≠ trainer mismatch.

The rollout engine (vLLM, bf16, its own kernels) samples from π_rollout, while the loss treats the data as
coming from π_old, the trainer's recomputation of the same policy. With log ρ = log π_old − log π_rollout per
sampled token this module gives truncated importance-sampling (TIS) weights, a rejection mask for outlier
tokens / sequences, and mismatch diagnostics. Config: ``algorithm.rollout_correction``.

In bypass mode (the engine's log-probs are the old ones) the same weights and masks compare the policy
being trained, π_θ, with π_rollout, in each micro-batch's loss (``loss_type``: ppo_clip applies the masks
only, reinforce the weights too: L = −A·log π_θ·w).

Rejection statistics per token (ρ = π_old / π_rollout; expectations under π_rollout):
k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ (≥ 0); E[k1] = E[k3] = KL(π_rollout ‖ π_old).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .functional import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # |log ρ| bound before every exp, so weights stay finite
BATCH_NORM_MIN_MEAN = 1e-8  # batch-normalisation is skipped below this mean weight

ROLLOUT_IS_MODES = ("token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")

_TOKEN_STATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda log_ratio: -log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio.square(),
    # expm1: eˣ − 1 − x cancels badly for the tiny |log ρ| of a well-matched rollout engine
    "k3": lambda log_ratio: torch.expm1(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - log_ratio,
}
# mode -> (how token stats are reduced: token | sum | mean | max, stat)
ROLLOUT_RS_MODES: dict[str, tuple[str, str]] = {
    **{f"token_{k}": ("token", k) for k in ("k1", "k2", "k3")},
    **{f"seq_sum_{k}": ("sum", k) for k in ("k1", "k2", "k3")},
    **{f"seq_mean_{k}": ("mean", k) for k in ("k1", "k2", "k3")},
    **{f"seq_max_{k}": ("max", k) for k in ("k2", "k3")},
}


def _masked_log_ratio(old_log_prob, rollout_log_prob, response_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(log ρ with padding set to 0, boolean validity mask): padding log-probs may be arbitrary (−inf, NaN)."""
    valid = response_mask > 0
    zero = torch.zeros((), dtype=old_log_prob.dtype, device=old_log_prob.device)
    return torch.where(valid, old_log_prob - rollout_log_prob, zero), valid


@torch.no_grad()
def mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Trainer-vs-rollout mismatch over valid tokens: mean / max |log ρ| and the k1, k3 estimates of
    KL(π_rollout ‖ π_old). All keys are always present (0 on an empty mask)."""
    log_ratio, valid = _masked_log_ratio(old_log_prob, rollout_log_prob, mask)
    abs_diff = log_ratio.abs()
    return {
        "rollout_corr/abs_logp_diff_mean": masked_mean(abs_diff, mask).item(),
        "rollout_corr/abs_logp_diff_max": abs_diff.max().item() if abs_diff.numel() else 0.0,
        "rollout_corr/k3_mean": masked_mean(_TOKEN_STATS["k3"](log_ratio), mask).item(),
        "rollout_corr/k1_mean": masked_mean(_TOKEN_STATS["k1"](log_ratio), mask).item(),
    }


def _parse_modes(rollout_rs: str) -> list[str]:
    modes = [m.strip() for m in str(rollout_rs).split(",") if m.strip()]
    unknown = [m for m in modes if m not in ROLLOUT_RS_MODES]
    if unknown or not modes:
        raise ValueError(f"Unknown rollout_rs mode(s) {unknown or [rollout_rs]!r}. Valid: {', '.join(ROLLOUT_RS_MODES)}")
    return modes


def _parse_thresholds(modes: list[str], threshold: str | float | None) -> list[tuple[float, float]]:
    """One (low, high) bound on the statistic per mode; a single threshold entry is shared by all modes.

    k1 modes take ratio bounds "lower_upper" (a single u means [1/u, u]) checked in log space; the other
    modes take an upper bound on the (non-negative) statistic.
    """
    if threshold is None:
        raise ValueError(f"rollout_rs={','.join(modes)!r} needs rollout_rs_threshold")
    entries = [e.strip() for e in threshold.split(",")] if isinstance(threshold, str) else [threshold]
    if len(entries) == 1:
        entries = entries * len(modes)
    if len(entries) != len(modes):
        raise ValueError(f"rollout_rs_threshold has {len(entries)} entries for {len(modes)} rollout_rs modes")
    bounds = []
    for mode, entry in zip(modes, entries):
        try:
            if ROLLOUT_RS_MODES[mode][1] == "k1":
                parts = [float(p) for p in str(entry).split("_")]
                lower, upper = (1.0 / parts[0], parts[0]) if len(parts) == 1 else parts
                if len(parts) > 2 or not 0 < lower <= upper:
                    raise ValueError
                bounds.append((math.log(lower), math.log(upper)))
            else:
                upper = float(entry)
                if not upper >= 0:
                    raise ValueError
                bounds.append((-math.inf, upper))
        except (ValueError, ZeroDivisionError):
            if ROLLOUT_RS_MODES[mode][1] == "k1":
                expected = "'lower_upper' ratio bounds with 0 < lower <= upper, or one ratio u > 0"
            else:
                expected = "a non-negative upper bound"
            raise ValueError(f"bad rollout_rs_threshold {entry!r} for {mode}: expected {expected}") from None
    return bounds


def _rejection_keep(mode: str, low: float, high: float, log_ratio, valid, response_mask) -> torch.Tensor:
    """Boolean (B, T): tokens this criterion keeps (padding always 'kept'; the caller multiplies by the mask)."""
    reduce, stat_name = ROLLOUT_RS_MODES[mode]
    stat = _TOKEN_STATS[stat_name](log_ratio)
    if reduce == "token":
        return ((stat >= low) & (stat <= high)) | ~valid
    if reduce == "sum":
        seq_stat = masked_sum(stat, response_mask, dim=-1)
    elif reduce == "mean":
        seq_stat = masked_sum(stat, response_mask, dim=-1) / response_mask.sum(-1).clamp_min(1)
    else:
        seq_stat = stat.masked_fill(~valid, -math.inf).amax(-1)
    keep_seq = (seq_stat >= low) & (seq_stat <= high)
    return keep_seq.unsqueeze(-1) | ~valid


@torch.no_grad()
def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
    token_veto_threshold: float | None = None,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """TIS weights and rejection mask from log ρ = old − rollout, (B, T) inputs. Returns (is_weights or None,
    new_response_mask, metrics); everything detached.

    Rejection (``rollout_rs``, comma-separated modes, all must pass; see ``ROLLOUT_RS_MODES``): token modes
    zero the failing tokens, seq_{sum,mean,max} modes whole sequences. ``rollout_rs_threshold`` gives one
    entry per mode (comma-separated) or one shared entry; k1 modes: "lower_upper" ratio bounds or u for [1/u, u],
    checked as log lower ≤ stat ≤ log upper; k2/k3 modes: stat ≤ threshold.

    Veto (``token_veto_threshold`` v > 0, verl 0.7's ``rollout_token_veto_threshold``): a sequence with any
    valid token whose log ρ < log v is rejected whole, on top of (and independently of) ``rollout_rs``.

    IS (``rollout_is``): token w = exp(clamp(log ρ, ±20)); sequence w_i = exp(clamp(Σ_t log ρ·m, ±20)) on every
    token of i (over the original mask: it is the ratio of the whole sequence's probabilities). Then
    w ← min(w·m', rollout_is_threshold) with m' the mask after rejection (truncated from above only), and with
    ``batch_normalize`` w ← w / mean(w) if mean > 1e-8, mean over kept tokens (token) or kept sequences
    (sequence), so the weights average to 1 over what is trained.

    Metrics (``rollout_corr/``): ``mismatch_metrics``, rollout_rs_masked_fraction (tokens rejected by either)
    and rollout_rs_seq_masked_fraction (non-empty sequences losing a token) always, per-mode
    rollout_rs_<mode>_masked_fraction with rejection, rollout_is_veto_fraction (sequences) and
    rollout_is_catastrophic_token_fraction (valid tokens) with the veto (verl 0.7's names), and with IS
    rollout_is_{mean,max,min,eff_sample_size}
    (final weights, per token or per sequence; ESS = mean(w)²/mean(w²) ∈ (0, 1]) and rollout_is_truncated_fraction.
    """
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_MODES:
        raise ValueError(f"Unknown rollout_is {rollout_is!r}. Valid: {', '.join(ROLLOUT_IS_MODES)} (or null)")
    log_ratio, valid = _masked_log_ratio(old_log_prob, rollout_log_prob, response_mask)
    metrics = mismatch_metrics(old_log_prob, rollout_log_prob, response_mask)

    keep = valid.clone()
    if rollout_rs is not None:
        modes = _parse_modes(rollout_rs)
        for mode, (low, high) in zip(modes, _parse_thresholds(modes, rollout_rs_threshold)):
            mode_keep = _rejection_keep(mode, low, high, log_ratio, valid, response_mask)
            rejected_here = (~mode_keep).to(log_ratio.dtype)
            metrics[f"rollout_corr/rollout_rs_{mode}_masked_fraction"] = masked_mean(rejected_here, response_mask).item()
            keep &= mode_keep
    if token_veto_threshold is not None:
        if not token_veto_threshold > 0:
            raise ValueError(f"token_veto_threshold must be positive, got {token_veto_threshold!r}")
        catastrophic = (log_ratio < math.log(token_veto_threshold)) & valid
        vetoed = catastrophic.any(-1, keepdim=True)
        metrics["rollout_corr/rollout_is_veto_fraction"] = vetoed.to(log_ratio.dtype).mean().item()
        metrics["rollout_corr/rollout_is_catastrophic_token_fraction"] = masked_mean(
            catastrophic.to(log_ratio.dtype), response_mask).item()
        keep &= ~vetoed
    new_mask = response_mask * keep.to(response_mask.dtype)
    rejected = (valid & ~keep).to(log_ratio.dtype)
    metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(rejected, response_mask).item()
    nonempty = valid.any(-1)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = (
        (rejected.sum(-1) > 0)[nonempty].to(log_ratio.dtype).mean().item() if nonempty.any() else 0.0
    )

    if rollout_is is None:
        return None, new_mask, metrics

    # Weights per unit (token, or sequence) and the units that survived rejection.
    if rollout_is == "token":
        raw, units = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)), keep
    else:
        raw = torch.exp(masked_sum(log_ratio, response_mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND))
        units = keep.any(-1)
    unit_weights = raw.clamp(max=float(rollout_is_threshold))
    values = unit_weights[units]
    if batch_normalize and values.numel() and values.mean() > BATCH_NORM_MIN_MEAN:
        unit_weights = unit_weights / values.mean()
        values = unit_weights[units]
    if rollout_is == "sequence":
        unit_weights = unit_weights.unsqueeze(-1).expand_as(log_ratio)
    weights = (unit_weights * keep.to(log_ratio.dtype)).detach()

    stats = {"mean": 0.0, "max": 0.0, "min": 0.0, "eff_sample_size": 0.0, "truncated_fraction": 0.0}
    if values.numel():
        stats = {
            "mean": values.mean().item(),
            "max": values.max().item(),
            "min": values.min().item(),
            "eff_sample_size": (values.mean().square() / values.square().mean()).item(),
            "truncated_fraction": (raw[units] > rollout_is_threshold).to(values.dtype).mean().item(),
        }
    metrics.update({f"rollout_corr/rollout_is_{k}": v for k, v in stats.items()})
    return weights, new_mask, metrics


def correction_settings(rollout_correction) -> dict | None:
    """`compute_rollout_correction`'s keyword arguments from ``algorithm.rollout_correction``, or
    None when it asks for neither weights, rejection nor the veto."""
    rc = rollout_correction
    veto = rc.get("rollout_token_veto_threshold")  # verl 0.7's key
    if not (rc.rollout_is or rc.rollout_rs or veto is not None):
        return None
    return dict(rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold, rollout_rs=rc.rollout_rs,
                rollout_rs_threshold=rc.rollout_rs_threshold, token_veto_threshold=veto,
                batch_normalize=rc.rollout_is_batch_normalize)
