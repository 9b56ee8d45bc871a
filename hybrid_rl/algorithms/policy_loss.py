"""Policy-gradient losses.

Every registered loss has the signature
``fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", config=None,
agg_kwargs=None, rollout_is_weights=None) -> (loss, metrics)`` with (batch, response_len) tensors.
``config`` is the ``actor_rollout_ref.actor`` mapping, ``agg_kwargs`` is forwarded to ``aggregate_loss``
(global_num_tokens, global_num_seqs, dp_size, loss_scale_factor) and ``rollout_is_weights`` are detached
per-token importance weights. Metrics are detached 0-dim tensors (no host sync inside the step).

Registered: vanilla, reinforce (= gpg), gspo, sapo, geo_mean, cispo, clip_cov, kl_cov, dro, dppo_tv, dppo_kl.
Clip ratios and tau_pos / tau_neg are read from the actor config itself; loss-mode specific keys (clip_cov_*,
kl_cov_ratio, ppo_kl_coef, dro_beta) from its ``policy_loss`` section, as in verl's config tree.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .aggregation import aggregate_loss
from .functional import cfg_get, masked_mean, masked_sum
from .registry import Registry

POLICY_LOSSES = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0  # keeps exp(logp − old) finite
GSPO_LOG_RATIO_CAP = 10.0  # GSPO's sequence log-ratio is only capped from above (as in verl)


def _clip_range(config: Mapping[str, Any] | None) -> tuple[float, float]:
    """(ε_low, ε_high) from clip_ratio_low / clip_ratio_high, each defaulting to clip_ratio (0.2)."""
    clip_ratio = cfg_get(config, "clip_ratio", 0.2)
    return cfg_get(config, "clip_ratio_low", clip_ratio), cfg_get(config, "clip_ratio_high", clip_ratio)


def _loss_cfg(config: Mapping[str, Any] | None, key: str, default: Any) -> Any:
    """A loss-mode specific key: they live under ``actor.policy_loss``, not directly under ``actor``."""
    return cfg_get(cfg_get(config, "policy_loss", None), key, default)


def _ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """r = exp(logp − old), the log-ratio clamped to ±20 unless ``clamp`` is False."""
    log_ratio = log_prob - old_log_prob
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else log_ratio)


def _clipped_surrogate(advantages, ratio, eps_low, eps_high):
    """PPO's pessimistic surrogate: (L1 = −A·r, L2 = −A·clip(r, 1−ε_low, 1+ε_high), max(L1, L2))."""
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return loss_unclipped, loss_clipped, torch.maximum(loss_unclipped, loss_clipped)


def _aggregate(loss_mat, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights):
    """Per-token loss × IS weight (if any), then ``aggregate_loss``."""
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    return aggregate_loss(loss_mat, response_mask, loss_agg_mode, **(agg_kwargs or {}))


def _fraction(flags: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Masked fraction of True flags."""
    dtype = response_mask.dtype if response_mask.is_floating_point() else torch.float32
    return masked_mean(flags.to(dtype), response_mask)


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO.

    r = exp(clamp(logp − old, −20, 20)); L1 = −A·r; L2 = −A·clip(r, 1−ε_low, 1+ε_high); Lc = max(L1, L2);
    L3 = −A·c; per token L = min(L3, Lc) if A < 0 else Lc; L ×= IS weight; then aggregated.
    Config: clip_ratio (0.2), clip_ratio_low / clip_ratio_high (default clip_ratio), clip_ratio_c (3.0, > 1).
    Metrics: pg_clipfrac = mean[L2 > L1], pg_clipfrac_lower = mean[(Lc > L3) ∧ (A < 0)], ppo_kl = mean(old − logp).
    """
    eps_low, eps_high = _clip_range(config)
    clip_c = cfg_get(config, "clip_ratio_c", 3.0)
    if not clip_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO (it bounds the loss at −A·c for A < 0), got {clip_c}")

    ratio = _ratio(old_log_prob, log_prob)
    loss_unclipped, loss_clipped, loss_ppo = _clipped_surrogate(advantages, ratio, eps_low, eps_high)
    # Dual clip: for A < 0 a huge ratio would otherwise give an unbounded loss.
    loss_dual = -advantages * clip_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(loss_dual, loss_ppo), loss_ppo)

    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _fraction(loss_clipped > loss_unclipped, response_mask),
            "pg_clipfrac_lower": _fraction((loss_ppo > loss_dual) & negative, response_mask),
            "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def reinforce_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Unclipped REINFORCE: L = −A·logp·w (w = IS weight, 1 if absent), aggregated. Metric: ppo_kl = mean(old − logp)."""
    loss = _aggregate(-advantages * log_prob, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask)}
    return loss, metrics


# GPG (arXiv 2504.02546) is exactly the unclipped REINFORCE loss L = −A·logp (IS-weighted), aggregated per config.
POLICY_LOSSES.register("gpg")(reinforce_policy_loss)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (arXiv 2507.18071), token form: one clipped ratio per sequence, the length-normalised sequence ratio.

    ℓ_i = Σ_t (logp − old)·m / max(Σ_t m, 1) (no ±20 clamp); s = exp(min(logp − sg(logp) + sg(ℓ_i), 10)), whose
    value is exp(ℓ_i) and whose gradient is s·∇logp_t; L = max(−A·s, −A·clip(s, 1−ε_low, 1+ε_high)); L ×= IS weight.
    ``loss_agg_mode`` is honoured (verl forces seq-mean-token-mean); the paper's setting is
    ``loss_agg_mode=seq-mean-token-mean``. Metrics: pg_clipfrac = mean[L2 > L1], ppo_kl = mean(old − logp).
    """
    eps_low, eps_high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / response_mask.sum(-1).clamp_min(1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=GSPO_LOG_RATIO_CAP))
    loss_unclipped, loss_clipped, loss_mat = _clipped_surrogate(advantages, ratio, eps_low, eps_high)
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _fraction(loss_clipped > loss_unclipped, response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("sapo")
def sapo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (arXiv 2511.20347): a smooth sigmoid gate instead of a hard clip.

    r = exp(clamp(logp − old, ±20)); f(r; τ) = sigmoid(τ·(r − 1))·4/τ (f'(1) = 1, like PPO on-policy), τ = tau_pos
    (1.0) if A > 0 else tau_neg (1.05), both read from the actor config; L = −f·A; L ×= IS weight.
    ``loss_agg_mode`` is honoured (verl forces seq-mean-token-mean; set it to get the paper's setting).
    Metric: ppo_kl = mean(old − logp).
    """
    ratio = _ratio(old_log_prob, log_prob)
    tau = torch.full_like(ratio, cfg_get(config, "tau_neg", 1.05)).masked_fill(advantages > 0, cfg_get(config, "tau_pos", 1.0))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _aggregate(-gate * advantages, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask)}
    return loss, metrics


@POLICY_LOSSES.register("geo_mean")
def geo_mean_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (arXiv 2507.20673): PPO on the geometric mean of the token ratios, clipped per token in log space.

    d = logp − old (no clamp); d̂ = sgn(A)·min(sgn(A)·d, sgn(A)·clamp(d, −ε_low, ε_high));
    R_i = exp(Σ_t d̂·m / Σ_t m); Ā_i = Σ_t A·m / Σ_t m; L_i = −Ā_i·R_i, × the IS weights' per-sequence geometric
    mean exp(Σ_t log(w + 1e-10)·m / Σ_t m). The objective is per sequence, so ``loss_agg_mode`` is not used:
    loss = Σ_i L_i / N_seq over non-empty sequences, N_seq = global_num_seqs (× dp_size) when given, so it is
    exact across micro-batches and ranks (verl takes a plain local mean, empty sequences included).
    Metrics: pg_clipfrac = mean[d̂ ≠ d ∧ A ≠ 0], pg_clipfrac_lower = mean[d̂ ≠ d ∧ A < 0], ppo_kl = mean(old − logp).
    """
    eps_low, eps_high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-eps_low, eps_high))
    length = response_mask.sum(-1).clamp_min(1)
    seq_ratio = torch.exp(masked_sum(clipped_log_ratio, response_mask, dim=-1) / length)
    seq_loss = -masked_sum(advantages, response_mask, dim=-1) / length * seq_ratio
    if rollout_is_weights is not None:
        seq_loss = seq_loss * torch.exp(masked_sum(torch.log(rollout_is_weights + 1e-10), response_mask, dim=-1) / length)
    # Spread L_i over its tokens: seq-mean-token-mean then averages exactly the L_i of non-empty sequences.
    loss = aggregate_loss(seq_loss.unsqueeze(-1).expand_as(log_ratio), response_mask, "seq-mean-token-mean", **(agg_kwargs or {}))
    with torch.no_grad():
        # d̂ ≠ d, except where A = 0 (d̂ = 0 there, but nothing is clipped)
        clipped = ((advantages > 0) & (log_ratio > eps_high)) | ((advantages < 0) & (log_ratio < -eps_low))
        metrics = {
            "pg_clipfrac": _fraction(clipped, response_mask),
            "pg_clipfrac_lower": _fraction(clipped & (advantages < 0), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (arXiv 2506.13585): clip the IS weight, not the update, so every token keeps a gradient.

    r = exp(clamp(logp − old, ±20)); w = sg(clip(r, 1−ε_low, 1+ε_high)); L = −w·A·logp; L ×= IS weight.
    Metrics: pg_clipfrac = mean[r ≠ clip(r)], ppo_kl = mean(old − logp).
    """
    eps_low, eps_high = _clip_range(config)
    ratio = _ratio(old_log_prob, log_prob)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_mat = -clipped_ratio.detach() * advantages * log_prob
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _fraction(ratio != clipped_ratio, response_mask),
            "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask),
        }
    return loss, metrics


def _centered_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token (A − mean A)·(logp − mean logp), means over valid tokens, detached."""
    with torch.no_grad():
        log_prob = log_prob.detach()
        return (advantages - masked_mean(advantages, response_mask)) * (log_prob - masked_mean(log_prob, response_mask))


@POLICY_LOSSES.register("clip_cov")
def clip_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Entropy-Mechanism paper, arXiv 2505.22617): drop the gradient of a few high-covariance tokens.

    r = exp(logp − old) (unclamped); L1, L2 as PPO; cov = (A − mean A)·(logp − mean sg(logp)) over valid tokens.
    Candidates: valid, not PPO-clipped (L2 ≤ L1), clip_cov_lb < cov < clip_cov_ub. A random subset of
    min(max(int(clip_cov_ratio·N_valid), 1), #candidates) candidates gets corr = 0 (else 1); L = max(L1, L2)·corr;
    L ×= IS weight. Keys under ``policy_loss``: clip_cov_ratio (2e-4), clip_cov_lb (1.0), clip_cov_ub (5.0), seed
    (falls back to ``seed`` in the actor config, then 0). The subset is drawn from a generator seeded afresh every
    call, so it is a reproducible function of the inputs (verl draws it unseeded).
    Metrics: pg_clipfrac = fraction of valid tokens zeroed, ppo_kl = mean(old − logp).
    """
    eps_low, eps_high = _clip_range(config)
    ratio = _ratio(old_log_prob, log_prob, clamp=False)
    loss_unclipped, loss_clipped, loss_ppo = _clipped_surrogate(advantages, ratio, eps_low, eps_high)
    with torch.no_grad():
        cov = _centered_covariance(advantages, log_prob, response_mask)
        valid = response_mask > 0
        candidates = valid & (loss_clipped <= loss_unclipped)
        candidates &= (cov > _loss_cfg(config, "clip_cov_lb", 1.0)) & (cov < _loss_cfg(config, "clip_cov_ub", 5.0))
        candidate_idx = candidates.flatten().nonzero().squeeze(-1)
        n_valid = int(valid.sum())
        n_drop = min(max(int(_loss_cfg(config, "clip_cov_ratio", 2e-4) * n_valid), 1), candidate_idx.numel())
        generator = torch.Generator().manual_seed(int(_loss_cfg(config, "seed", cfg_get(config, "seed", 0))))
        chosen = torch.randperm(candidate_idx.numel(), generator=generator)[:n_drop].to(candidate_idx.device)
        corr = torch.ones_like(loss_ppo)
        corr.view(-1)[candidate_idx[chosen]] = 0.0
    loss = _aggregate(loss_ppo * corr, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _fraction(corr == 0, response_mask),
            "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Entropy-Mechanism paper): a KL penalty on the highest-covariance tokens, no clipping elsewhere.

    r = exp(logp − old) (unclamped); L = −A·r for every token (no PPO clip, as in verl), plus
    ppo_kl_coef·|logp − old| on the top-k valid tokens by cov = (A − mean A)·(logp − mean logp),
    k = max(1, int(N_valid·kl_cov_ratio)) (none if kl_cov_ratio = 0); L ×= IS weight.
    Keys under ``policy_loss``: kl_cov_ratio (2e-4), ppo_kl_coef (0.1). Metric: ppo_kl = mean|logp − old|.
    """
    kl_cov_ratio = _loss_cfg(config, "kl_cov_ratio", 2e-4)
    log_ratio = log_prob - old_log_prob
    abs_log_ratio = log_ratio.abs()
    loss_mat = -advantages * _ratio(old_log_prob, log_prob, clamp=False)
    with torch.no_grad():
        valid_idx = (response_mask > 0).flatten().nonzero().squeeze(-1)
        penalised = torch.zeros_like(loss_mat)
        if kl_cov_ratio > 0 and valid_idx.numel() > 0:
            cov = _centered_covariance(advantages, log_prob, response_mask).flatten()[valid_idx]
            top = torch.topk(cov, max(1, int(valid_idx.numel() * kl_cov_ratio))).indices
            penalised.view(-1)[valid_idx[top]] = 1.0
    loss_mat = loss_mat + _loss_cfg(config, "ppo_kl_coef", 0.1) * abs_log_ratio * penalised
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(abs_log_ratio, response_mask)}
    return loss, metrics


@POLICY_LOSSES.register("dro")
def dro_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct reward optimisation with a quadratic log-ratio penalty (verl's `dro`).

    L = −(A·logp − ½·β·(logp − old)²), β = policy_loss.dro_beta (> 0); L ×= IS weight; aggregated.
    Metric: ppo_kl = mean(old − logp).
    """
    beta = _loss_cfg(config, "dro_beta", None)
    if beta is None or not beta > 0:
        raise ValueError(f"policy_loss.dro_beta must be positive for loss_mode=dro, got {beta}")
    log_ratio = log_prob - old_log_prob
    loss_mat = -(advantages * log_prob - 0.5 * beta * log_ratio.square())
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(-log_ratio, response_mask)}
    return loss, metrics


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, inside, loss_agg_mode, config, agg_kwargs,
               rollout_is_weights):
    """DPPO's update (arXiv 2602.04879): L = −A·sg(min(r, c))·logp on the tokens `inside` the
    divergence bound for their advantage's sign (the others get no gradient), c = clip_ratio_c."""
    clip_c = cfg_get(config, "clip_ratio_c", 20.0)
    ratio = _ratio(old_log_prob, log_prob)
    inside = inside.detach().to(log_prob.dtype)
    loss_mat = -advantages * ratio.clamp(max=clip_c).detach() * log_prob * inside
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, agg_kwargs, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(1.0 - inside, response_mask),
            "pg_clipfrac_lower": masked_mean((ratio > clip_c).to(inside.dtype) * inside, response_mask),
            "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV: the sampled token's probability may move by at most δ in total variation.

    p = exp(logp), p_old = exp(old); inside = (p − p_old ≤ δ_high) where A > 0, (p − p_old ≥ −δ_low)
    elsewhere, δ_low / δ_high = clip_ratio_low / clip_ratio_high (default clip_ratio);
    L = −A·sg(min(r, c))·logp·inside, c = clip_ratio_c; L ×= IS weight; aggregated.
    Metrics: pg_clipfrac = mean(1 − inside), pg_clipfrac_lower = mean[(r > c) ∧ inside], ppo_kl.
    """
    low, high = _clip_range(config)
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    inside = torch.where(advantages > 0, change <= high, change >= -low)
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, inside, loss_agg_mode, config, agg_kwargs,
                      rollout_is_weights)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    agg_kwargs: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL: the KL between the old and new Bernoulli of the sampled token is bounded.

    D = p_old·(old − logp) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8));
    inside = (D ≤ δ_high ∨ p ≤ p_old) where A > 0, (D ≤ δ_low ∨ p ≥ p_old) elsewhere;
    L = −A·sg(min(r, c))·logp·inside; L ×= IS weight; aggregated. Metrics as dppo_tv's.
    """
    low, high = _clip_range(config)
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    divergence = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    inside = torch.where(advantages > 0, (divergence <= high) | (prob <= old_prob),
                         (divergence <= low) | (prob >= old_prob))
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, inside, loss_agg_mode, config, agg_kwargs,
                      rollout_is_weights)


def get_policy_loss(name: str):
    """The registered policy loss ``name`` (``actor.policy_loss.loss_mode``)."""
    return POLICY_LOSSES.get(name)
