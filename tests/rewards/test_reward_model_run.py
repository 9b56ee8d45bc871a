"""Training runs scored by a reward model mixed with the rule (weight 0: logged, not rewarded), and
by a process reward model under the grpo_process advantage."""

import json

import pytest

from hybrid_rl.main import build_trainer, compose_config
from tests.conftest import run_overrides
from tests.rewards.test_process_reward_model import build_prm
from tests.rewards.test_reward_model import build_reward_model

pytestmark = pytest.mark.slow


def run_one_step(tmp_path, tiny_model_dir, arithmetic_files, reward_model: str, *extra, processes=None) -> dict:
    """Metrics of a one-step run (validated after it) with `reward_model` enabled; `processes`
    gets the (actor's, reward model's) worker pids."""
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run", response=12) + [
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=1",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "reward_model.enable=true", f"reward_model.model.path={reward_model}",
        "reward_model.model.fsdp_config.dtype=fp32", "reward_model.micro_batch_size_per_gpu=3",
        f"trainer.rollout_data_dir={tmp_path}/rollouts", *extra]
    trainer = build_trainer(compose_config(overrides))
    try:
        trainer.fit()
        if processes is not None:
            processes.extend([{info["pid"] for info in group.get_node_info()}
                              for group in (trainer.workers, trainer.reward_model)])
    finally:
        trainer.shutdown()
    return next(json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
                if "reward/reward_model/mean" in line)


def test_a_run_scored_by_a_reward_model(ray_session, tiny_model_dir, tiny_tokenizer, arithmetic_files, tmp_path):
    rm = build_reward_model(tmp_path / "rm", tiny_tokenizer)
    step = run_one_step(tmp_path, tiny_model_dir, arithmetic_files, rm,
                        "reward.funcs=[reward_model,rule]", "reward.weights=[1.0,0.0]")
    assert step["critic/score/mean"] == pytest.approx(step["reward/reward_model/mean"], abs=1e-6)
    assert "reward/rule/mean" in step and step["timing_s/reward_model"] > 0
    assert step["reward_model/truncated"] == 0.0 and "val/reward/reward_model/mean" in step
    rows = [json.loads(line) for line in open(tmp_path / "rollouts" / "1.jsonl")]
    assert len(rows) == 8 and all(row["score"] == pytest.approx(row["reward/reward_model"]) for row in rows)
    assert len({row["reward/reward_model"] for row in rows}) > 1  # one score per response, not a constant


def test_a_reward_model_in_processes_of_its_own_scores_as_a_colocated_one(ray_session, tiny_model_dir, tiny_tokenizer,
                                                                        arithmetic_files, tmp_path):
    rm = build_reward_model(tmp_path / "rm", tiny_tokenizer)
    mixture = ["reward.funcs=[reward_model,rule]", "reward.weights=[1.0,0.0]"]
    colocated = run_one_step(tmp_path / "colocated", tiny_model_dir, arithmetic_files, rm, *mixture)
    processes = []
    pooled = run_one_step(tmp_path / "pooled", tiny_model_dir, arithmetic_files, rm, *mixture,
                          "reward_model.enable_resource_pool=true", "reward_model.nnodes=1",
                          "reward_model.n_gpus_per_node=2", processes=processes)
    actor, scoring = processes  # two scoring processes beside the trainer's one
    assert len(actor) == 1 and len(scoring) == 2 and not actor & scoring

    def scores(run):
        return [json.loads(line)["reward/reward_model"] for line in open(tmp_path / run / "rollouts" / "1.jsonl")]

    assert scores("pooled") == pytest.approx(scores("colocated"), abs=1e-6)
    for key in ("critic/score/mean", "val/reward/reward_model/mean", "actor/pg_loss"):
        assert pooled[key] == pytest.approx(colocated[key], abs=1e-6), key


@pytest.mark.parametrize("scorer", ["token_classifier", "step_tag"])
def test_a_process_supervised_run(ray_session, tiny_model_dir, tiny_tokenizer, arithmetic_files, tmp_path, scorer):
    if scorer == "token_classifier":
        prm, extra = build_prm(tmp_path / "prm", tiny_tokenizer, num_labels=2), []
    else:  # a causal LM read at a tag after each step
        prm, extra = tiny_model_dir, ["reward_model.process.step_tag=' ки'"]
    step = run_one_step(tmp_path, tiny_model_dir, arithmetic_files, prm, "reward_model.process.enable=true",
                        "algorithm.adv_estimator=grpo_process", "reward_model.process.step_separator=' '",
                        "reward.funcs=[reward_model,rule]", "reward.weights=[1.0,0.0]", *extra)
    # the step rewards alone count; the rule, at weight 0, is logged beside them
    assert step["critic/score/mean"] == pytest.approx(step["reward/reward_model/mean"], abs=1e-6)
    assert "reward/rule/mean" in step and "val/reward/rule/mean" in step
    assert step["reward_model/steps_per_response"] > 1  # steps at the spaces of the policy's responses
    assert "val/reward/reward_model/mean" in step and step["actor/pg_loss"] != 0.0
