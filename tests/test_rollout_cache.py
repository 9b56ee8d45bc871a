"""The rollout cache (verl's skip.rollout / rollout.skip / rollout.skip_rollout): which dump serves
which step, the dump's round trip, the config's refusals, and a run served from another run's dumps."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_rl.config import ConfigError, rollout_cache_settings, validate_config
from hybrid_rl.main import compose_config
from hybrid_rl.protocol import Batch
from hybrid_rl.rollout_cache import CYCLE, EXACT, LAST, NEAREST, RolloutCache, source_step


@pytest.mark.parametrize("mode, step, dumped, expected", [
    (EXACT, 3, [1, 3], 3), (EXACT, 2, [1, 3], None),
    (NEAREST, 3, [1, 3, 5], 3), (NEAREST, 4, [1, 3, 5], 3), (NEAREST, 2, [5, 7], 5), (NEAREST, 2, [], None),
    # verl 0.7's repeat: step s takes the ((s - 1) mod d)-th of the d dumps
    (CYCLE, 4, [1, 2], 2), (CYCLE, 5, [1, 2], 1), (CYCLE, 3, [1], 1),
    (LAST, 9, [1, 2, 4], 4), (LAST, 9, [], None),
])
def test_which_dump_serves_a_step(mode, step, dumped, expected):
    assert source_step(mode, step, dumped) == expected


@pytest.mark.parametrize("kwargs, modes", [
    # verl 0.9: the listed steps only
    ({"action": "cache", "steps": [2, 3]}, [None, EXACT, EXACT, None]),
    ({"action": "repeat", "steps": [1, 4]}, [NEAREST, None, None, NEAREST]),
    # verl 0.7-0.8: the first max_dump_step steps, then the action's rule
    ({"action": "cache", "max_dump_step": 2}, [EXACT, EXACT, None, None]),
    ({"action": "repeat", "max_dump_step": 2}, [EXACT, EXACT, CYCLE, CYCLE]),
    ({"action": "repeat_last", "max_dump_step": 1}, [EXACT, LAST, LAST, LAST]),
])
def test_the_steps_each_form_serves(kwargs, modes, tmp_path):
    cache = RolloutCache(tmp_path, **kwargs)
    assert [cache.mode(step) for step in (1, 2, 3, 4)] == modes


def _rows(value: float) -> tuple[Batch, Batch]:
    prompts = Batch({"input_ids": torch.tensor([[1, 2], [3, 4]])},
                    {"uid": ["a", "b"], "reward_model": [{"ground_truth": "3"}, {"ground_truth": "7"}]})
    generated = Batch({"responses": torch.full((4, 3), value), "rollout_log_probs": torch.randn(4, 3)},
                      {"uid": ["a", "a", "b", "b"]})
    return prompts, generated


def test_a_dump_round_trips_and_later_steps_repeat_it(tmp_path):
    """verl 0.6's form: step 1 generates and dumps; every later step loads that dump, each
    generation batch of a step (dynamic sampling) its own file."""
    cache = RolloutCache(tmp_path / "run", action="repeat_last", max_dump_step=1)
    first = cache.load(1)
    assert first.loaded is None
    prompts, generated = _rows(1.0)
    cache.save(first, prompts, generated)
    second = cache.load(1)
    assert second.loaded is None  # the step's second generation batch: not dumped yet
    cache.save(second, *_rows(2.0))
    assert cache.dumped_steps() == [1] and not list((tmp_path / "run").rglob("*.partial"))

    loaded_prompts, loaded, source = cache.load(2).loaded
    assert source == 1 and loaded.keys() == generated.keys()
    assert torch.equal(loaded["responses"], generated["responses"])
    assert torch.equal(loaded["rollout_log_probs"], generated["rollout_log_probs"])
    assert list(loaded_prompts["reward_model"]) == list(prompts["reward_model"])
    assert list(loaded["uid"]) == ["a", "a", "b", "b"]
    assert torch.equal(cache.load(2).loaded[1]["responses"], torch.full((4, 3), 2.0))
    third = cache.load(2)
    assert third.loaded is None  # a third batch that step 1 never drew is generated...
    cache.save(third, *_rows(3.0))
    assert cache.dumped_steps() == [1]  # ...and not dumped under another step's name


def test_a_step_the_cache_does_not_serve_is_neither_loaded_nor_dumped(tmp_path):
    cache = RolloutCache(tmp_path, action="cache", steps=[1])
    one = cache.load(1)
    assert one.loaded is None
    cache.save(one, *_rows(1.0))
    two = cache.load(2)
    assert two.loaded is None
    cache.save(two, *_rows(2.0))
    assert cache.dumped_steps() == [1]


def test_lookups_of_steps_generated_ahead_are_saved_later_each_under_its_own_step(tmp_path):
    """A rollout pool launches the next steps before the current one's batch is collected: every
    lookup carries where its batch goes, whatever was looked up since."""
    cache = RolloutCache(tmp_path, action="cache", steps=[1, 2, 3])
    lookups = [cache.load(step) for step in (1, 2, 3)]
    for lookup, value in zip(lookups, (1.0, 2.0, 3.0)):
        cache.save(lookup, *_rows(value))
    assert cache.dumped_steps() == [1, 2, 3]
    assert [float(cache.load(step).loaded[1]["responses"][0, 0]) for step in (1, 2, 3)] == [1.0, 2.0, 3.0]


def test_verls_three_switches_give_one_cache():
    assert rollout_cache_settings(compose_config([])) is None
    assert rollout_cache_settings(compose_config(["skip.rollout.enable=true", "skip.rollout.steps=[1,3]",
                                                  "skip.rollout.action=repeat"])) == {
        "dump_dir": "~/.verl/rollout_dump", "action": "repeat", "steps": [1, 3]}
    assert rollout_cache_settings(compose_config([
        "actor_rollout_ref.rollout.skip.enable=true", "actor_rollout_ref.rollout.skip.max_dump_step=2",
        "actor_rollout_ref.rollout.skip.action=repeat_last"])) == {
        "dump_dir": "~/.verl/rollout_dump", "action": "repeat_last", "max_dump_step": 2}
    assert rollout_cache_settings(compose_config([
        "actor_rollout_ref.rollout.skip_rollout=true", "actor_rollout_ref.rollout.skip_dump_dir=/data/dump"])) == {
        "dump_dir": "/data/dump", "action": "repeat_last", "max_dump_step": 1}


@pytest.mark.parametrize("overrides, fragment", [
    (["skip.rollout.enable=true"], "skip.rollout.steps=[] must list the training steps"),
    (["skip.rollout.enable=true", "skip.rollout.steps=[0]"], "whole numbers from 1"),
    (["skip.rollout.enable=true", "skip.rollout.steps=[1]", "skip.rollout.action=repeat_last"],
     "skip.rollout.action"),
    (["actor_rollout_ref.rollout.skip.enable=true", "actor_rollout_ref.rollout.skip.max_dump_step=0"],
     "max_dump_step=0 must be a whole number >= 1"),
    (["actor_rollout_ref.rollout.skip.enable=true", "actor_rollout_ref.rollout.skip_rollout=true"],
     "in different releases; set one"),
    (["skip.async_rollout.enable=true"], "skip.async_rollout.enable=True is not supported yet"),
])
def test_bad_cache_settings_are_refused(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(overrides))
    assert fragment in str(error.value)


# A rollout pool of its own (asynchronous training): step 2's batch is looked up and launched
# before step 1 trains.
ROLLOUT_POOL = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.name=vllm",
                "trainer.cpus_per_worker=1", "rollout.max_staleness=1"]


@pytest.mark.slow
@pytest.mark.parametrize("pool", [False, True], ids=["colocated", "rollout_pool"])
def test_a_run_trains_on_the_rollouts_another_run_dumped(ray_session, tiny_model_dir, arithmetic_files, tmp_path,
                                                         pool):
    """Run 1 generates and dumps steps 1-2; run 2, from the same weights, loads them: the same
    responses, rewards, losses and gradient norms, step by step."""
    from tests.conftest import run_overrides
    from tests.test_algorithm_catalogue_runs import ONE_STEP, train

    def run(name: str) -> tuple[list[dict], list[list[str]]]:
        out = tmp_path / name
        overrides = run_overrides(tiny_model_dir, arithmetic_files, out, response=12) + [
            *ONE_STEP, "trainer.total_training_steps=2", f"trainer.rollout_data_dir={out / 'generations'}",
            "skip.rollout.enable=true", "skip.rollout.steps=[1,2]", f"skip.rollout.dump_dir={tmp_path / 'dump'}",
            *(ROLLOUT_POOL if pool else [])]
        metrics = train(overrides, out)
        outputs = [[json.loads(line)["output"] for line in open(out / "generations" / f"{step}.jsonl")]
                   for step in (1, 2)]
        return metrics, outputs

    first, first_outputs = run("first")
    second, second_outputs = run("second")
    assert [m.get("rollout_cache/loaded_batches") for m in first] == [None, None]
    assert [m["rollout_cache/source_step"] for m in second] == [1.0, 2.0]
    assert second_outputs == first_outputs
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
        assert [m[key] for m in second] == [m[key] for m in first], key
