"""Every algorithm name is selectable by a dotted override and runs one real step.

Each case is one short training run of the tiny model through the CLI's config composition and
the real worker group; together the cases cover every advantage estimator, policy loss, KL type,
loss aggregation mode, KL-in-reward controller, reward/advantage shaping option and rollout
correction mode.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from hybrid_rl.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from hybrid_rl.main import REPO_ROOT, build_trainer, compose_config
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

A = "actor_rollout_ref.actor."
# Two mini-batches: old log-probs are recomputed, so ratios differ from 1 and the driver-side
# rollout correction and KL-in-reward paths run.
TWO_MINI = [f"{A}ppo_mini_batch_size=2"]

STEP_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Process supervision: one reward per half of the response."""
    if not solution_str:
        return 0.0
    half = max(1, len(solution_str) // 2)
    return {"step_rewards": [float("7" in solution_str[:half]), float(len(solution_str) % 2)],
            "step_ends": [half, len(solution_str)]}
'''

GDPO_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Two components for GDPO: the answer and a bonus for brevity; verl's gdpo manager names the run."""
    assert extra_info["experiment_name"] == "catalogue"
    answer = float(str(ground_truth) in solution_str)
    brevity = 1.0 / (1 + len(solution_str))
    return {"score": answer + brevity, "answer": answer, "brevity": brevity}
'''

CASES = {
    "gae": ["algorithm.adv_estimator=gae", f"{A}policy_loss.loss_mode=vanilla", f"{A}kl_loss_type=k1",
            f"{A}loss_agg_mode=token-mean", "algorithm.whiten_advantages=true", "algorithm.use_pf_ppo=true",
            *TWO_MINI],
    "grpo": ["algorithm.adv_estimator=grpo", f"{A}policy_loss.loss_mode=gspo", f"{A}kl_loss_type=kl",
             f"{A}loss_agg_mode=seq-mean-token-mean", "algorithm.rollout_correction.rollout_is=token", *TWO_MINI],
    "dr_grpo": ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false",
                f"{A}policy_loss.loss_mode=sapo", f"{A}kl_loss_type=abs", f"{A}loss_agg_mode=seq-mean-token-sum-norm"],
    "grpo_passk": ["algorithm.adv_estimator=grpo_passk", f"{A}policy_loss.loss_mode=geo_mean", f"{A}kl_loss_type=k2",
                   f"{A}loss_agg_mode=seq-mean-token-sum", "algorithm.rollout_correction.rollout_is=sequence",
                   "algorithm.rollout_correction.rollout_rs='token_k1,seq_mean_k3'",
                   "algorithm.rollout_correction.rollout_rs_threshold=2.0",
                   "algorithm.rollout_correction.rollout_token_veto_threshold=1e-4", *TWO_MINI],
    "rloo": ["algorithm.adv_estimator=rloo", f"{A}policy_loss.loss_mode=cispo", f"{A}kl_loss_type=mse",
             "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.reward_clip=0.5"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus", f"{A}policy_loss.loss_mode=clip_cov",
                            f"{A}kl_loss_type=k3", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3",
                            "algorithm.reward_norm.mean=batch", "algorithm.reward_norm.std=batch"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline",
                                     f"{A}policy_loss.loss_mode=kl_cov", f"{A}kl_loss_type=low_var_kl",
                                     "algorithm.reward_norm.mean=running", "algorithm.reward_norm.std=running"],
    "remax": ["algorithm.adv_estimator=remax", f"{A}policy_loss.loss_mode=gpg", f"{A}kl_loss_type=k1+",
              "algorithm.advantage_clip=1.0"],
    "opo": ["algorithm.adv_estimator=opo", f"{A}policy_loss.loss_mode=reinforce", f"{A}kl_loss_type=k3+",
            "algorithm.reward_norm.mean=group", "algorithm.reward_norm.std=group"],
    "gpg": ["algorithm.adv_estimator=gpg", f"{A}policy_loss.loss_mode=gpg", f"{A}kl_loss_type=full",
            f"{A}full_kl_chunk_size=7"],
    "grpo_process": ["algorithm.adv_estimator=grpo_process", f"{A}kl_loss_type=low_var_kl+",
                     f"{A}policy_loss.loss_mode=dro", f"{A}policy_loss.dro_beta=0.1"],
    "optimal_token_baseline": ["algorithm.adv_estimator=optimal_token_baseline", f"{A}calculate_sum_pi_squared=true",
                               "algorithm.rollout_correction.rollout_is=token", f"{A}policy_loss.loss_mode=dppo_tv"],
    "tir_optimal_token_baseline": ["algorithm.adv_estimator=tir_optimal_token_baseline",
                                   f"{A}calculate_sum_pi_squared=true", f"{A}policy_loss.loss_mode=dppo_kl"],
    # Bypass mode with verl 0.6's policy-gradient switch: REINFORCE weighted by the truncated ratio of
    # the trained policy to the engine's, rejection masks from the same ratio.
    "grpo_bypass_reinforce": ["algorithm.adv_estimator=grpo", "algorithm.rollout_correction.bypass_mode=true",
                              "algorithm.rollout_correction.use_policy_gradient=true",
                              "algorithm.rollout_correction.rollout_is=sequence",
                              "algorithm.rollout_correction.rollout_rs=token_k1",
                              "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"],
    # verl 0.9's form: the keys added with +, the reward manager in its newest place.
    "gdpo": ["algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[answer,brevity]",
             "+algorithm.gdpo_reward_weights=[1.0,0.5]", "reward.reward_manager.name=gdpo",
             "trainer.experiment_name=catalogue"],
}

# One training step of 4 prompts x 3 responses, no validation, the hf rollout.
ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "data.val_files=null", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=3",
            f"{A}ppo_mini_batch_size=4", f"{A}ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.name=hf"]

EXPECTED_METRICS = {
    "gae": ["critic/vf_loss", "critic/vf_clipfrac", "rollout_corr/abs_logp_diff_max", "pf_ppo/distinct_responses"],
    "grpo": ["rollout_corr/abs_logp_diff_mean", "rollout_corr/k3_mean"],
    "grpo_passk": ["rollout_corr/rollout_is_veto_fraction", "rollout_corr/rollout_is_catastrophic_token_fraction"],
    "rloo": ["actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"],
    "reinforce_plus_plus": ["actor/reward_kl_penalty"],
    "remax": ["timing_s/gen_max"],
    "gpg": ["actor/kl_loss"],
    "grpo_bypass_reinforce": ["rollout_corr/rollout_is_min", "rollout_corr/rollout_is_mean",
                              "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/abs_logp_diff_max"],
    "gdpo": ["gdpo/answer/mean", "gdpo/answer/std", "gdpo/brevity/max", "gdpo/brevity/min"],
}


def train(overrides: list[str], out) -> list[dict]:
    """Train with these overrides; the metrics of each step."""
    trainer = build_trainer(compose_config(overrides))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def overridden_values(key: str) -> set[str]:
    return {item.split("=", 1)[1] for case in CASES.values() for item in case if item.split("=", 1)[0].endswith(key)}


@pytest.mark.parametrize("registry, key", [(ADV_ESTIMATORS, "adv_estimator"), (POLICY_LOSSES, "loss_mode"),
                                           (KL_ESTIMATORS, "kl_loss_type"), (LOSS_AGG_MODES, "loss_agg_mode")])
def test_every_registered_function_runs_in_a_case(registry, key):
    run = {registry.get(name) for name in overridden_values(key)}
    missing = [name for name in registry.names() if registry.get(name) not in run]
    assert not missing, f"{key} values never exercised: {missing}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_step(case, ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path, response=12) + [
        *ONE_STEP, f"{A}use_kl_loss=true", "critic.ppo_micro_batch_size_per_gpu=2", *CASES[case]]
    if case in ("grpo_process", "gdpo"):
        reward_file = tmp_path / "reward.py"
        reward_file.write_text(STEP_REWARD if case == "grpo_process" else GDPO_REWARD)
        overrides.append(f"custom_reward_function.path={reward_file}")
    (metrics,) = train(overrides, tmp_path)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/advantages/mean",
                *EXPECTED_METRICS.get(case, [])):
        assert key in metrics and math.isfinite(metrics[key]), (case, key, metrics.get(key))


def test_cli_runs_ppo_with_critic_and_verl_trainer_keys(tiny_model_dir, arithmetic_files, tmp_path):
    """The real command line: PPO (GAE + critic) on the tiny model, two steps, vLLM rollout, with
    verl's trainer keys that change what a run does: the critic warm-up skips the actor's first
    update, generations are dumped, the checkpoint holds a Hugging Face copy, only the newest
    checkpoint keeps the critic's part, Ray's timeline is written and the engine gets
    max_model_len and chunked prefill as given."""
    out = tmp_path / "out"
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path, response=12) + [
        "algorithm.adv_estimator=gae", "trainer.total_training_steps=2", "trainer.val_before_train=false",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", f"{A}ppo_mini_batch_size=4",
        f"{A}ppo_micro_batch_size_per_gpu=4", "trainer.cpus_per_worker=1", "trainer.critic_warmup=2",
        f"trainer.rollout_data_dir={out}/rollouts", f"trainer.validation_data_dir={out}/val",
        "trainer.save_freq=1", "trainer.max_critic_ckpt_to_keep=1",
        f"{A}checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "ray_kwargs.ray_init.num_cpus=2", f"ray_kwargs.timeline_json_file={out}/timeline.json",
        "actor_rollout_ref.rollout.max_model_len=300", "actor_rollout_ref.rollout.enable_chunked_prefill=false"]
    done = subprocess.run([sys.executable, "-m", "hybrid_rl.main", *overrides], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max_model_len 300, chunked_prefill False" in done.stdout, done.stdout[-3000:]
    first, second = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert math.isfinite(first["critic/vf_loss"]) and "actor/pg_loss" not in first  # warm-up: critic only
    assert math.isfinite(second["actor/pg_loss"]) and "val/score/mean" in second

    rollouts = [json.loads(line) for line in open(out / "rollouts" / "1.jsonl")]
    assert len(rollouts) == 8 and {"input", "output", "gts", "score", "step"} <= set(rollouts[0])
    assert rollouts[0]["step"] == 1 and any(c.isdigit() for c in rollouts[0]["input"]) and rollouts[0]["gts"] is not None
    assert (out / "rollouts" / "2.jsonl").is_file()
    validation = [json.loads(line) for line in open(out / "val" / "2.jsonl")]
    assert len(validation) == 6 and validation[0]["step"] == 2

    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    assert [(tmp_path / f"global_step_{step}" / part).is_dir() for step in (1, 2) for part in ("actor", "critic")] \
        == [True, False, True, True]
    hf_copy = tmp_path / "global_step_2" / "huggingface"
    assert AutoModelForCausalLM.from_pretrained(hf_copy).num_parameters() > 0
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "global_step_2" / "critic" / "huggingface")
    assert critic.config.num_labels == 1 and critic.score.weight.abs().sum() > 0
    assert isinstance(json.loads((out / "timeline.json").read_text()), list)

    # A third step resumed with the weights and the critic's schedule but fresh optimizers
    # (verl's checkpoint.load_contents), each said.
    done = subprocess.run([sys.executable, "-m", "hybrid_rl.main", *overrides, "trainer.total_training_steps=3",
                           f"{A}checkpoint.load_contents=[model]", "critic.checkpoint.load_contents=[model,extra]"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "model of actor_rollout_ref.actor's checkpoint only" in said and "model and extra of critic's" in said
    assert [json.loads(line)["step"] for line in open(os.path.join(tmp_path, "metrics.jsonl"))] == [1, 2, 3]


BATCH_REWARD = '''
def score_batch(data_sources, solution_strs, ground_truths, extra_infos, bonus):
    """verl's batch reward manager: every response of the step at once, with the manager's kwargs."""
    assert len(solution_strs) == len(ground_truths) == len(extra_infos) == 12 and bonus == 0.25
    return [{"score": float(str(t) in s) + bonus, "acc": float(str(t) in s)} for s, t in zip(solution_strs, ground_truths)]
'''


def test_batch_reward_manager_in_verl_09_form(ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    """verl 0.9's keys for its batch manager: the function gets the step's lists and the manager's
    reward_kwargs; its per-sample dicts become the scores and logged values."""
    (tmp_path / "batch.py").write_text(BATCH_REWARD)
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path, response=12) + [
        *ONE_STEP, "reward.reward_manager.name=batch", "+reward.reward_kwargs.bonus=0.25",
        f"reward.custom_reward_function.path={tmp_path / 'batch.py'}", "reward.custom_reward_function.name=score_batch"]
    (metrics,) = train(overrides, tmp_path)
    assert metrics["critic/score/mean"] == pytest.approx(metrics["critic/acc/mean"] + 0.25)


LAST_FIRST = '''
from verl.experimental.dataset.sampler import AbstractCurriculumSampler

UPDATES = []


class LastFirst(AbstractCurriculumSampler):
    """The rows in reverse order; records each trained batch's row indices and scores."""

    def __init__(self, data_source, data_config):
        self.size = len(data_source)

    def __iter__(self):
        return iter(range(self.size - 1, -1, -1))

    def __len__(self):
        return self.size

    def update(self, batch):
        UPDATES.append((list(batch.non_tensor_batch["index"]), batch.batch["token_level_scores"].sum(-1).tolist()))
'''


def test_verl_curriculum_sampler_picks_the_prompts(ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    """verl's data.sampler.class_path / class_name: the sampler's indices are the step's prompts,
    and its update sees the trained batch (each prompt's n responses, with their scores)."""
    (tmp_path / "curriculum.py").write_text(LAST_FIRST)
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path, response=12) + [
        *ONE_STEP, f"data.sampler.class_path={tmp_path / 'curriculum.py'}", "data.sampler.class_name=LastFirst"]
    trainer = build_trainer(compose_config(overrides))
    try:
        trainer.fit()
        dataset, module = trainer.train_dataset, trainer.sampler.sampler
    finally:
        trainer.shutdown()
    ((indices, scores),) = sys.modules[type(module).__module__].UPDATES
    last_four = [dataset[i]["index"] for i in range(len(dataset) - 1, len(dataset) - 5, -1)]
    assert sorted(set(indices)) == sorted(last_four) and len(indices) == len(scores) == 12


@pytest.mark.parametrize("form", ["0.9", "0.7-0.8"])
def test_reward_manager_of_ones_own(form, ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    """verl's source=importlib: a RewardManagerBase (0.9's keys) or an AbstractRewardManager with
    the manager's reward_kwargs (0.7-0.8's keys) scores the step."""
    from tests.rewards.test_custom_reward_manager import RUN_SINGLE, WHOLE_BATCH

    (tmp_path / "manager.py").write_text(RUN_SINGLE if form == "0.9" else WHOLE_BATCH)
    keys = (["reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={tmp_path}/manager.py",
             "reward.reward_manager.name=LengthAware"] if form == "0.9" else
            ["reward_manager.source=importlib", f"reward_manager.module.path={tmp_path}/manager.py",
             "reward_manager.name=Scaled", "+reward_model.reward_kwargs.scale=2.0"])
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path, response=12) + [*ONE_STEP, *keys]
    (metrics,) = train(overrides, tmp_path)
    if form == "0.9":
        assert metrics["critic/score/mean"] < metrics["critic/acc/mean"] + 1e-9  # a cost per token
    else:
        assert metrics["critic/score/mean"] == pytest.approx(2.0 * metrics["critic/acc/mean"])


@pytest.mark.parametrize("keys", [["reward_model.reward_manager=prime"],
                                  ["reward.reward_manager.name=remote", "reward.num_workers=2"]])
def test_reward_managers_that_score_in_processes(keys, ray_session, tiny_model_dir, arithmetic_files, tmp_path):
    """verl's prime (0.7-0.8's key) and remote (0.9's) managers: the built-in scorer in worker
    processes score the step, none failing."""
    overrides = run_overrides(tiny_model_dir, arithmetic_files, tmp_path, response=12) + [*ONE_STEP, *keys]
    (metrics,) = train(overrides, tmp_path)
    assert metrics["reward/failed_samples"] == 0 and 0 <= metrics["critic/score/mean"] <= 1
