"""Asynchronous training (actor_rollout_ref.hybrid_engine=false): the weight channel between the
trainer and a rollout pool of its own, on-policy equality with the colocated trainer at
rollout.max_staleness=0, and the behaviour policy's log-probs in the ratio at staleness 1."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from hybrid_rl.controller.worker import get_free_port
from hybrid_rl.workers.weight_sync import WeightChannel
from tests.conftest import run_overrides


def test_weight_channel_carries_named_tensors_of_any_dtype_to_every_receiver():
    port = get_free_port()
    weights = [("model.embed_tokens.weight", torch.randn(7, 3)), ("model.norm.weight", torch.ones(3, dtype=torch.bfloat16)),
               ("lm_head.bias", torch.arange(4, dtype=torch.int64)), ("scalar", torch.tensor(2.5))]
    received: dict[int, list] = {}
    sent: list[int] = []

    def member(rank: int) -> None:
        channel = WeightChannel("127.0.0.1", port, rank, 3, torch.device("cpu"), timeout_s=30)
        for _ in range(2):  # two pushes through one channel
            if rank == 0:
                sent.append(channel.send(iter(weights)))
            else:
                received.setdefault(rank, []).append([(name, t.clone()) for name, t in channel.receive()])

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sent == [sum(t.numel() * t.element_size() for _, t in weights)] * 2
    for rank in (1, 2):
        for push in received[rank]:
            assert [name for name, _ in push] == [name for name, _ in weights]
            for (_, got), (_, want) in zip(push, weights):
                assert got.dtype == want.dtype and torch.equal(got, want)


def async_overrides(model_dir, files, run_dir, *extra) -> list[str]:
    return run_overrides(model_dir, files, run_dir, 200, 16) + [
        "trainer.total_training_steps=3", "trainer.test_freq=3", "trainer.cpus_per_worker=1",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        *extra]


def run(cfg) -> list[dict]:
    from hybrid_rl.main import build_trainer

    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    with open(f"{cfg.trainer.default_local_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "val-core/arithmetic/reward/mean@1")


@pytest.mark.slow
@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_a_rollout_pool_at_staleness_0_trains_exactly_as_the_colocated_trainer(
        multi_turn, ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    from hybrid_rl.config_keys import compose_config

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: [{class_name: calculator}]")
    # The tool loop (here: stop texts, loss masks; the random model calls no tool) runs in the pool too.
    extra = ["actor_rollout_ref.rollout.multi_turn.enable=true",
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
             "actor_rollout_ref.rollout.multi_turn.describe_tools=none"] if multi_turn else []
    colocated = run(compose_config(async_overrides(tiny_model_dir, arithmetic_files, tmp_path / "sync", *extra)))
    pooled = run(compose_config(async_overrides(
        tiny_model_dir, arithmetic_files, tmp_path / "async", "actor_rollout_ref.hybrid_engine=false",
        "rollout.max_staleness=0", "algorithm.rollout_correction.bypass_mode=false", *extra)))
    assert ("multi_turn/tool_call_share" in pooled[1]) == multi_turn
    assert len(colocated) == len(pooled) == 4  # validation at step 0, steps 1-3
    for a, b in zip(colocated, pooled):
        for key in COMPARED:
            if key in a:
                assert b[key] == a[key], (a["step"], key, a[key], b[key])
    assert [line.get("async/staleness") for line in pooled[1:]] == [0.0, 0.0, 0.0]
    # The pool received every weight, in float32, at each launch.
    assert pooled[2]["perf/sync_gb_per_rank"] > 0


LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) % 7) / 7
"""


@pytest.mark.slow
def test_at_staleness_1_the_ratio_uses_the_engines_log_probs_and_resume_is_exact(
        ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    """Each batch after the first was sampled by the weights one update old, and the PPO ratio of
    the update is pi_theta / pi_behaviour: its KL to the old log-probs (actor/ppo_kl) is the
    drift between the two weights, which an on-policy ratio (exactly 1) never shows. A run
    resumed from a checkpoint taken with a batch in flight continues exactly."""
    from hybrid_rl.config_keys import compose_config

    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)  # scores that differ within groups: gradients from the start
    overrides = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.actor.optim.lr=1e-3",
                 f"custom_reward_function.path={reward}", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    lines = run(compose_config(async_overrides(tiny_model_dir, arithmetic_files, tmp_path / "full", *overrides,
                                               "trainer.total_training_steps=4", "trainer.save_freq=2")))
    steps = {line["step"]: line for line in lines}
    assert [steps[k]["async/staleness"] for k in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert abs(steps[1]["actor/ppo_kl"]) < 1e-6  # sampled by the weights it updates
    assert all(abs(steps[k]["actor/ppo_kl"]) > 1e-4 for k in (2, 3, 4))
    # The update's forward measures the same drift against the engine's log-probs (float32 here:
    # at staleness 0 they agree to rounding).
    assert steps[1]["rollout_corr/abs_logp_diff_max"] < 1e-4
    assert all(steps[k]["rollout_corr/abs_logp_diff_mean"] > 100 * steps[1]["rollout_corr/abs_logp_diff_mean"]
               for k in (2, 3, 4))
    on_policy = run(compose_config(async_overrides(tiny_model_dir, arithmetic_files, tmp_path / "on", *overrides,
                                                   "trainer.total_training_steps=2",
                                                   "algorithm.rollout_correction.bypass_mode=false")))
    # Step 2 trains on a batch sampled one update ago, against the actor's own old log-probs.
    assert [line["async/staleness"] for line in on_policy] == [0.0, 1.0]
    assert all(line["actor/ppo_kl"] == 0.0 for line in on_policy)

    resumed = run(compose_config(async_overrides(
        tiny_model_dir, arithmetic_files, tmp_path / "resumed", *overrides, "trainer.total_training_steps=4",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={tmp_path / 'full' / 'global_step_2'}")))
    for line in resumed:
        for key in COMPARED + ("actor/ppo_kl", "async/staleness"):
            if key in line:
                assert line[key] == steps[line["step"]][key], (line["step"], key)
    assert [line["step"] for line in resumed] == [3, 4]


def test_config_refuses_what_a_rollout_pool_cannot_do_yet():
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.config_keys import compose_config

    pool = ["actor_rollout_ref.hybrid_engine=false"]
    for extra, message in [(["actor_rollout_ref.rollout.name=hf"], "rollout.name=vllm"),
                           (["rollout.max_staleness=-1"], "integer >= 0"),
                           (["rollout.n_gpus_per_node=0"], "positive integer"),
                           (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "must divide"),
                           (["algorithm.filter_groups.enable=true"], "dynamic sampling"),
                           (["algorithm.adv_estimator=remax"], "greedy baseline")]:
        with pytest.raises(ConfigError, match=message):
            validate_config(compose_config(pool + extra))
    assert validate_config(compose_config(pool)).algorithm.rollout_correction.bypass_mode is True
    # Bypass mode's weights compare the trained policy with the engine's, in the loss.
    validate_config(compose_config(pool + ["algorithm.rollout_correction.rollout_is=token"]))
    assert validate_config(compose_config([])).algorithm.rollout_correction.bypass_mode is False
