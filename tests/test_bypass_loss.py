"""Bypass mode's loss (the engine's log-probs are the old ones): verl 0.9's rollout correction
inside the loss, comparing the policy being trained with the engine's, checked by hand."""

from __future__ import annotations

import math
import types

import pytest
import torch

from hybrid_rl.algorithms import correction_settings, get_policy_loss
from hybrid_rl.config import validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

BYPASS = ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.actor.use_kl_loss=false",
          "actor_rollout_ref.actor.entropy_coeff=0", "algorithm.rollout_correction.rollout_rs=token_k1",
          "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]


def micro_batch():
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 2
    log_ratio = torch.randn(3, 4, generator=g, dtype=torch.float64)
    log_prob = (rollout + log_ratio).requires_grad_()
    advantages = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 4).contiguous()
    mask = torch.tensor(MASK, dtype=torch.float64)
    t = {"response_mask": mask, "advantages": advantages, "old_log_probs": rollout, "rollout_log_probs": rollout}
    return log_prob, t


def bypass_loss(overrides):
    cfg = validate_config(compose_config([*BYPASS, *overrides]))
    correction = cfg.algorithm.rollout_correction
    actor = cfg.actor_rollout_ref.actor
    log_prob, t = micro_batch()
    out = {"log_probs": log_prob, "entropy": torch.zeros_like(log_prob)}
    agg_kwargs = {"global_num_tokens": float(t["response_mask"].sum()), "global_num_seqs": 3.0, "dp_size": 1,
                  "loss_scale_factor": None}
    reinforce = correction.loss_type == "reinforce"
    policy_loss = get_policy_loss("reinforce" if reinforce else actor.policy_loss.loss_mode)
    loss, terms = ActorRolloutRefWorker._actor_loss(
        types.SimpleNamespace(), out, t, agg_kwargs, actor, policy_loss, 1.0, False, True,
        correction_settings(correction), reinforce)
    loss.backward()
    return loss, terms, log_prob, t


def kept(log_prob, t) -> list[list[bool]]:
    """token_k1 with ratio bounds [0.5, 2]: a token is kept when 0.5 <= pi_theta / pi_rollout <= 2."""
    ratio = torch.exp(log_prob.detach() - t["rollout_log_probs"])
    return [[bool(MASK[i][j]) and 0.5 <= float(ratio[i, j]) <= 2.0 for j in range(4)] for i in range(3)]


def test_reinforce_weighs_each_kept_token_by_its_sequences_truncated_ratio():
    loss, terms, log_prob, t = bypass_loss(["algorithm.rollout_correction.loss_type=reinforce",
                                            "algorithm.rollout_correction.rollout_is=sequence",
                                            "algorithm.rollout_correction.rollout_is_threshold=1.5"])
    keep = kept(log_prob, t)
    assert any(not k for i, row in enumerate(keep) for j, k in enumerate(row) if MASK[i][j]), "nothing rejected"
    lp, rollout, adv = log_prob.detach().tolist(), t["rollout_log_probs"].tolist(), t["advantages"].tolist()
    tokens = sum(map(sum, MASK))
    expected, grad = 0.0, [[0.0] * 4 for _ in range(3)]
    for i in range(3):
        # The whole sequence's ratio (over all its tokens), truncated at 1.5 from above.
        w = min(math.exp(sum(lp[i][j] - rollout[i][j] for j in range(4) if MASK[i][j])), 1.5)
        for j in range(4):
            if keep[i][j]:
                expected += -adv[i][j] * lp[i][j] * w / tokens
                grad[i][j] = -adv[i][j] * w / tokens
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(log_prob.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert terms["rollout_corr/rollout_is_max"] <= 1.5
    assert 0 < terms["rollout_corr/rollout_rs_masked_fraction"] < 1


def test_ppo_clip_takes_the_masks_and_leaves_the_weights_to_the_metrics():
    loss, terms, log_prob, t = bypass_loss(["algorithm.rollout_correction.rollout_is=token"])
    keep = torch.tensor(kept(log_prob, t), dtype=torch.float64)
    fresh = log_prob.detach().clone().requires_grad_()
    cfg = validate_config(compose_config(BYPASS)).actor_rollout_ref.actor
    expected, _ = get_policy_loss("vanilla")(t["rollout_log_probs"], fresh, t["advantages"], keep, config=cfg,
                                             agg_kwargs={"global_num_tokens": float(sum(map(sum, MASK)))})
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    torch.testing.assert_close(log_prob.grad, fresh.grad, rtol=1e-12, atol=1e-15)
    assert "rollout_corr/rollout_is_mean" in terms and "rollout_corr/k3_mean" in terms
