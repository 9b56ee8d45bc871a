"""PF-PPO's weights against their formulas, its draws against torch's multinomial on those
weights, and the trainer's filtered batch keeping each row's reward values with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms import PF_PPO_WEIGHTS, pf_ppo_resample
from hybrid_rl.protocol import Batch

SCORES = torch.tensor([1.0, -2.0, 0.5, 1.0, -2.0, 0.0])


@pytest.mark.parametrize("method, power, expected", [
    ("pow", 2.0, [1.0, 4.0, 0.25, 1.0, 4.0, 0.0]),
    ("pow", 1.0, [1.0, 2.0, 0.5, 1.0, 2.0, 0.0]),
    ("max_min", 2.0, [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]),
    ("max_random", 2.0, [0.4, 0.1, 0.1, 0.4, 0.1, 0.1]),
])
def test_pf_ppo_weights_follow_their_formulas(method, power, expected):
    assert PF_PPO_WEIGHTS.get(method)(SCORES, power).tolist() == pytest.approx(expected)


@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
def test_pf_ppo_draws_as_many_rows_as_torch_multinomial_on_the_floored_weights(method):
    weights = {"pow": SCORES.abs() ** 2, "max_min": torch.tensor([1.0, 1, 0, 1, 1, 0]),
               "max_random": torch.tensor([0.4, 0.1, 0.1, 0.4, 0.1, 0.1])}[method]
    expected = torch.multinomial(weights + 1e-8, 6, replacement=True, generator=torch.Generator().manual_seed(5))
    rows = pf_ppo_resample(SCORES, method, 2.0, torch.Generator().manual_seed(5))
    assert rows.tolist() == expected.tolist()


def test_max_min_draws_only_the_best_and_worst_responses_about_equally():
    scores = torch.tensor([0.2, 1.0, 0.5, -1.0] * 500)
    rows = pf_ppo_resample(scores, "max_min", 2.0, torch.Generator().manual_seed(0))
    drawn = scores[rows]
    assert set(drawn.tolist()) == {1.0, -1.0}
    assert abs(float((drawn == 1.0).float().mean()) - 0.5) < 0.05


def test_the_filtered_batch_keeps_each_rows_reward_values():
    from hybrid_rl.trainer import Trainer

    batch = Batch(tensors={"token_level_scores": torch.diag(SCORES), "row": torch.arange(6)},
                  non_tensors={"uid": [f"u{i}" for i in range(6)]})
    extra = {"acc": [f"acc{i}" for i in range(6)], "summary": ["one value for the batch"]}
    trainer = SimpleNamespace(cfg=OmegaConf.create({"algorithm": {"pf_ppo": {"reweight_method": "pow",
                                                                             "weight_pow": 2.0}},
                                                    "trainer": {"seed": 1}}), global_step=3)
    metrics = {}
    filtered, filtered_extra = Trainer.policy_filtration(trainer, batch, extra, metrics)
    rows = filtered["row"].tolist()
    assert len(rows) == 6 and 5 not in rows  # the zero score's weight is 1e-8
    assert list(filtered["uid"]) == [f"u{i}" for i in rows]
    assert filtered_extra == {"acc": [f"acc{i}" for i in rows], "summary": ["one value for the batch"]}
    assert metrics["pf_ppo/distinct_responses"] == len(set(rows)) / 6
    again, _ = Trainer.policy_filtration(trainer, batch, extra, {})
    assert again["row"].tolist() == rows  # seeded by the step: a resumed run draws the same


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.use_pf_ppo=true"], "resamples the batch after GAE"),
    (["algorithm.use_pf_ppo=true", "algorithm.adv_estimator=gae", "algorithm.pf_ppo.reweight_method=best"],
     "reweight_method=.best. is not valid"),
])
def test_pf_ppo_settings_that_cannot_work_are_refused_at_start(overrides, message):
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.config_keys import compose_config

    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(overrides))
