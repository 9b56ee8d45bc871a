"""Weighted reward mixtures (reward.funcs / reward.weights), checked against hand-computed sums."""

import math

import pytest
from omegaconf import OmegaConf

from hybrid_rl.config import ConfigError
from hybrid_rl.metrics import reward_source_metrics
from hybrid_rl.rewards import RewardFunctionError, RewardManager
from hybrid_rl.rewards.mixture import combine, sources_from_config
from tests.rewards.test_reward_manager import make_batch

FUNCS = '''
def contains_truth(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if ground_truth in solution_str else 0.0

def even_rows_only(data_source, solution_str, ground_truth, extra_info=None, bonus=2.0):
    return bonus if extra_info["index"] % 2 == 0 else None

def broken(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("no luck")

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")

def text(data_source, solution_str, ground_truth, extra_info=None):
    return "high"
'''


@pytest.fixture
def funcs_file(tmp_path):
    path = tmp_path / "funcs.py"
    path.write_text(FUNCS)
    return str(path)


def reward_cfg(funcs, weights=None):
    return OmegaConf.create({"funcs": funcs, "weights": weights, "sandbox": {}})


def test_combine_is_the_weighted_sum_of_the_sources_that_scored():
    assert combine([1.0, None, 3.0], [2.0, 5.0, 0.5]) == 3.5
    assert combine([None, None], [1.0, 1.0]) == 0.0


def test_two_functions_weighted_one_abstaining(tiny_tokenizer, funcs_file):
    sources = sources_from_config(reward_cfg([f"{funcs_file}:contains_truth", {
        "path": funcs_file, "name": "even_rows_only", "reward_kwargs": {"bonus": 3.0}}], [1.0, 0.5]), ConfigError)
    batch, lengths = make_batch(tiny_tokenizer, ["q"] * 4, ["3", "4", "12", "7"], ["3", "3", "2", "9"])
    reward, extra = RewardManager(tiny_tokenizer, sources=sources)(batch)
    # by hand: contains_truth = 1, 0, 1, 0; even_rows_only = 3, None, 3, None
    expected = [1 + 0.5 * 3, 0.0, 1 + 0.5 * 3, 0.0]
    assert [reward[i, lengths[i] - 1].item() for i in range(4)] == expected
    assert reward.sum().item() == sum(expected)
    assert extra["reward/contains_truth"] == [1.0, 0.0, 1.0, 0.0]
    assert extra["reward/even_rows_only"] == [3.0, None, 3.0, None]
    metrics = reward_source_metrics(extra, {})
    assert metrics == {"reward/contains_truth/mean": 0.5, "reward/even_rows_only/mean": 3.0}


def test_rule_source_and_duplicate_names(tiny_tokenizer, funcs_file):
    sources = sources_from_config(reward_cfg(["rule", "rule", f"{funcs_file}:contains_truth"], [1, 2, 0]),
                                  ConfigError)
    assert [s.name for s in sources] == ["rule", "rule_2", "contains_truth"]
    batch, lengths = make_batch(tiny_tokenizer, ["What is 1 + 2?", "What is 2 + 2?"], ["3", "5"], ["3", "4"])
    reward, _ = RewardManager(tiny_tokenizer, sources=sources)(batch)
    assert reward.sum(-1).tolist() == [3.0, 0.0]


def test_bad_mixtures_are_named(funcs_file):
    with pytest.raises(ConfigError, match=r"reward.weights has 1 entries but reward.funcs has 2"):
        sources_from_config(reward_cfg(["rule", "rule"], [1.0]), ConfigError)
    with pytest.raises(ConfigError, match=r"reward.weights\[1\]=nan is not a finite number"):
        sources_from_config(reward_cfg(["rule", "rule"], [1.0, math.nan]), ConfigError)
    with pytest.raises(ConfigError, match=r"reward.funcs\[0\]='accuracy' is not a reward source"):
        sources_from_config(reward_cfg(["accuracy"]), ConfigError)
    with pytest.raises(ValueError, match=r"has no attribute 'missing'.*reward.funcs\[0\].name"):
        sources_from_config(reward_cfg([{"path": funcs_file, "name": "missing"}]), ConfigError)
    assert sources_from_config(reward_cfg([]), ConfigError) is None


def test_a_failing_source_fails_the_sample_as_configured(tiny_tokenizer, funcs_file):
    batch, lengths = make_batch(tiny_tokenizer, ["q"] * 2, ["3", "4"], ["3", "4"])
    sources = sources_from_config(reward_cfg([f"{funcs_file}:contains_truth", f"{funcs_file}:broken"]), ConfigError)
    manager = RewardManager(tiny_tokenizer, sources=sources, on_error="zero")
    reward, extra = manager(batch)
    assert reward.abs().sum().item() == 0.0 and manager.failures == 2 and extra["reward_failed"] == [True, True]
    with pytest.raises(RewardFunctionError, match="broken raised ValueError: no luck"):
        RewardManager(tiny_tokenizer, sources=sources, on_error="raise")(batch)
    for name, error in (("nan", "returned a non-finite score"), ("text", "returned str")):
        sources = sources_from_config(reward_cfg([f"{funcs_file}:{name}"]), ConfigError)
        with pytest.raises((RewardFunctionError, TypeError), match=f"reward function {name} {error}"):
            RewardManager(tiny_tokenizer, sources=sources, on_error="zero")(batch)
