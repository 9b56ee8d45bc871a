"""Iterative RL (trainer.iterative): the samples and replay buffer, the reference reset on the
engines, and runs through the trainer: the reward model's loss falls on its replayed data, the
reference equals the actor right after a reset, and a resumed run repeats the uninterrupted one."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from hybrid_rl.config import ConfigError
from hybrid_rl.engines import ModelSpec, Output, build_engine
from hybrid_rl.iterative import IterationSamples
from hybrid_rl.main import build_trainer, compose_config, prepare
from hybrid_rl.protocol import BatchMeta
from tests.conftest import run_overrides
from tests.rewards.test_reward_model import build_reward_model, rollouts

CHATS = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 9)]]
ANSWERS = ["3", "8", "11", "nope", "18"]
TRUTHS = ["3", "7", "11", "15", "18"]


def step_batch(tokenizer):
    batch = rollouts(tokenizer, CHATS, ANSWERS)
    batch["data_source"] = ["arithmetic"] * len(CHATS)
    batch["reward_model"] = [{"ground_truth": truth} for truth in TRUTHS]
    return batch


def test_samples_replay_and_state(tiny_tokenizer, tmp_path):
    cfg = OmegaConf.create({"freq": 2, "replay_ratio": 0.4})
    samples = IterationSamples(cfg, tiny_tokenizer, tiny_tokenizer.pad_token_id, seed=0)
    batch = step_batch(tiny_tokenizer)
    samples.collect(batch)
    assert [e["label"] for e in samples.pending] == [1.0, 0.0, 1.0, 0.0, 1.0]  # the rule against the truths
    first = samples.pending[0]
    assert tiny_tokenizer.decode(first["response_ids"], skip_special_tokens=True) == "3"
    assert first["raw_prompt"] == CHATS[0]
    assert not samples.due(1) and samples.due(2)

    rows = samples.training_batch(step=2, dp_size=2)
    assert len(rows) == 4 and not rows["replayed"].any()  # five rows, cut to a multiple of two ranks
    assert len(samples.replay) == 2 and samples.pending == []  # ceil(0.4 x 5) kept for later
    for i in range(len(rows)):  # each row is one sample's own tokens with its label
        mask = rows["attention_mask"][i].bool()
        text = tiny_tokenizer.decode(rows["input_ids"][i][mask].tolist(), skip_special_tokens=True)
        j = next(k for k, chat in enumerate(CHATS) if chat[0]["content"] in text)
        assert text.endswith(ANSWERS[j]) and rows["labels"][i] == (1.0 if ANSWERS[j] == TRUTHS[j] else 0.0)

    samples.collect(batch)
    samples.save(str(tmp_path))
    restored = IterationSamples(cfg, tiny_tokenizer, tiny_tokenizer.pad_token_id, seed=0)
    restored.load(str(tmp_path))
    assert restored.pending == samples.pending and restored.replay == samples.replay
    rows = samples.training_batch(step=4, dp_size=1)
    again = restored.training_batch(step=4, dp_size=1)
    assert len(rows) == 7 and int(rows["replayed"].sum()) == 2  # the iteration's five and the buffer's two
    assert torch.equal(rows["input_ids"], again["input_ids"]) and torch.equal(rows["labels"], again["labels"])


def test_a_reset_reference_computes_the_actors_log_probs(tiny_model_dir, tiny_tokenizer):
    cfg = compose_config(["actor_rollout_ref.actor.fsdp_config.dtype=fp32", "actor_rollout_ref.ref.fsdp_config.dtype=fp32"])
    model_cfg = cfg.actor_rollout_ref.model
    actor = build_engine(ModelSpec("actor", tiny_model_dir, model_cfg, optim_cfg=cfg.actor_rollout_ref.actor.optim),
                         cfg.actor_rollout_ref.actor, torch.device("cpu"))
    ref = build_engine(ModelSpec("ref", tiny_model_dir, model_cfg), cfg.actor_rollout_ref.ref, torch.device("cpu"))
    with torch.no_grad():  # the actor after some training
        for _, shard in actor.local_parameters():
            shard.add_(0.01 * torch.randn_like(shard))
    batch = rollouts(tiny_tokenizer, CHATS, ANSWERS)

    def log_probs(engine):
        return engine.infer(batch, Output.LOG_PROBS, 1.0, 2, None)["log_probs"]

    assert not torch.allclose(log_probs(ref), log_probs(actor), atol=1e-3)
    ref.load_weights_from(actor)
    assert torch.equal(log_probs(ref), log_probs(actor))


def iterative_overrides(model_dir, files, run_dir, reward_model, steps) -> list[str]:
    return run_overrides(model_dir, files, run_dir, response=12) + [
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=1", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.fsdp_config.dtype=fp32",
        "reward_model.enable=true", f"reward_model.model.path={reward_model}",
        "reward_model.model.fsdp_config.dtype=fp32", "reward.funcs=[reward_model,rule]", "reward.weights=[1.0,0.0]",
        "trainer.iterative.enable=true", "trainer.iterative.freq=1", "trainer.iterative.replay_ratio=0.5",
        "trainer.iterative.reward_model.epochs=4", "trainer.iterative.reward_model.mini_batch_size=4",
        "trainer.iterative.reward_model.lr=1e-3"]


def fit(overrides):
    trainer = build_trainer(compose_config(overrides))
    try:
        trainer.fit()
        return trainer, [json.loads(line) for line in open(trainer.cfg.trainer.default_local_dir + "/metrics.jsonl")]
    except BaseException:
        trainer.shutdown()
        raise


@pytest.mark.slow
def test_an_iterative_run(ray_session, tiny_model_dir, tiny_tokenizer, arithmetic_files, tmp_path):
    rm = build_reward_model(tmp_path / "rm", tiny_tokenizer)
    straight = iterative_overrides(tiny_model_dir, arithmetic_files, tmp_path / "straight", rm, steps=3)
    trainer, metrics = fit(straight)
    try:
        for step in metrics:
            assert step["iterative/reference_reset"] == 1.0 and step["iterative/reward_model_rows"] > 0
        assert "iterative/replay_loss_before" not in metrics[0]  # nothing replayed in the first iteration
        for step in metrics[1:]:  # the reward model's loss falls on the samples it replays
            assert step["iterative/replayed_rows"] > 0
            assert step["iterative/replay_loss_after"] < step["iterative/replay_loss_before"]
        # right after the last reset the reference computes the actor's log-probs
        prompts = trainer.prompt_batch(list(range(4)))
        prompts.meta = BatchMeta(step=99, temperature=1.0)
        batch = trainer.workers.generate_sequences(prompts)
        actor = trainer.workers.compute_log_prob(batch)["old_log_probs"]
        ref = trainer.workers.compute_ref_log_prob(batch)["ref_log_prob"]
        assert torch.equal(actor, ref)
    finally:
        trainer.shutdown()

    # resumed from the step-2 checkpoint (actor, moved reference, trained reward model, samples),
    # with the reward model now in a process of its own: where it runs changes no result
    resumed = iterative_overrides(tiny_model_dir, arithmetic_files, tmp_path / "resumed", rm, steps=3) + [
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/straight/global_step_2",
        "reward_model.enable_resource_pool=true", "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1"]
    trainer, again = fit(resumed)
    trainer.shutdown()
    assert [m["step"] for m in again] == [3]
    for key, value in metrics[2].items():
        if not key.startswith(("timing_s/", "perf/")) and key != "time":
            assert again[0][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def test_iterative_settings_that_cannot_work_are_refused(tmp_path, tiny_model_dir, arithmetic_files, tiny_tokenizer):
    def cfg(*extra):
        return compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run")
                              + ["trainer.iterative.enable=true", *extra])

    with pytest.raises(ConfigError, match="replay_ratio=1.5 must be a share"):
        prepare(cfg("trainer.iterative.replay_ratio=1.5"))
    with pytest.raises(ConfigError, match="trainer.iterative.freq=0 must be a positive integer"):
        prepare(cfg("trainer.iterative.freq=0"))
    with pytest.raises(ConfigError, match="actor_rollout_ref.ref.strategy=megatron is not supported yet"):
        prepare(cfg("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.strategy=megatron"))
    from tests.rewards.test_process_reward_model import build_prm

    prm = build_prm(tmp_path / "prm", tiny_tokenizer)
    process = ("reward_model.enable=true", f"reward_model.model.path={prm}", "reward_model.process.enable=true")
    with pytest.raises(ConfigError, match="set trainer.iterative.reward_model.step_scorer=file.py:function"):
        prepare(cfg(*process))
    with pytest.raises(FileNotFoundError, match="missing.py"):
        prepare(cfg(*process, f"trainer.iterative.reward_model.step_scorer={tmp_path}/missing.py:fn"))
    with pytest.raises(ConfigError, match="with a step-tag scorer"):
        prepare(cfg("reward_model.enable=true", f"reward_model.model.path={tiny_model_dir}",
                    "reward_model.process.enable=true", "reward_model.process.step_tag=' ки'",
                    "trainer.iterative.reward_model.step_scorer=recipes/deepseekmath_grpo/step_reward.py"))


STEP_SCORER = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # a step is good when its text has an even number of characters
    steps = [step for step in solution_str.split(" ") if step]
    return {"score": 0.0, "step_rewards": [float(len(step) % 2 == 0) for step in steps], "step_ends": []}
"""


@pytest.mark.slow
def test_an_iterative_run_trains_a_process_reward_model_on_step_labels(ray_session, tiny_model_dir, tiny_tokenizer,
                                                                       arithmetic_files, tmp_path):
    from tests.rewards.test_process_reward_model import build_prm

    prm = build_prm(tmp_path / "prm", tiny_tokenizer, num_labels=2)
    (tmp_path / "steps.py").write_text(STEP_SCORER)
    overrides = iterative_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run", prm, steps=2) + [
        "reward_model.process.enable=true", "reward_model.process.step_separator=' '",
        "algorithm.adv_estimator=grpo_process", f"trainer.iterative.reward_model.step_scorer={tmp_path}/steps.py",
        "trainer.save_freq=-1"]
    trainer, metrics = fit(overrides)
    trainer.shutdown()
    for step in metrics:
        assert step["iterative/reward_model_rows"] > 0 and step["iterative/unlabelled_samples"] >= 0
    # the second iteration replays steps of the first, and the PRM's loss on them falls
    assert metrics[1]["iterative/replayed_rows"] > 0
    assert metrics[1]["iterative/replay_loss_after"] < metrics[1]["iterative/replay_loss_before"]
    assert metrics[1]["reward_model/accuracy"] > 0.5
