"""recipes/: every paper-scale script composes with its paper's settings, and every CPU script
started without its data names the command that writes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybrid_rl.main import REPO_ROOT

RECIPES = sorted(p.parent.name for p in Path(REPO_ROOT, "recipes").glob("*/run_paper.sh"))
# Per recipe, settings its paper states (README.md cites them).
PAPER = {
    "dapo": {"actor_rollout_ref.actor.clip_ratio_low": 0.2, "actor_rollout_ref.actor.clip_ratio_high": 0.28,
             "actor_rollout_ref.rollout.n": 16, "data.train_batch_size": 512, "data.max_response_length": 20480,
             "reward_model.overlong_buffer.len": 4096, "actor_rollout_ref.actor.optim.lr": 1e-6,
             "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "algorithm.filter_groups.enable": True,
             "actor_rollout_ref.actor.use_kl_loss": False},
    "deepseekmath_grpo": {"actor_rollout_ref.actor.optim.lr": 1e-6, "actor_rollout_ref.actor.kl_loss_coef": 0.04,
                          "actor_rollout_ref.actor.kl_loss_type": "low_var_kl", "actor_rollout_ref.rollout.n": 64,
                          "data.train_batch_size": 16, "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
                          "data.max_response_length": 1024, "algorithm.adv_estimator": "grpo",
                          "reward_model.enable": True, "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"},
    "dr_grpo": {"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
                "actor_rollout_ref.actor.loss_scale_factor": 3000, "algorithm.norm_adv_by_std_in_grpo": False,
                "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.optim.lr": 1e-6,
                "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant", "actor_rollout_ref.rollout.n": 8,
                "data.train_batch_size": 128, "data.max_response_length": 3000, "data.max_prompt_length": 1024,
                "actor_rollout_ref.rollout.temperature": 1.0},
    "gspo": {"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo", "actor_rollout_ref.actor.clip_ratio_low": 3e-4,
             "actor_rollout_ref.actor.clip_ratio_high": 4e-4, "actor_rollout_ref.actor.ppo_mini_batch_size": 128,
             "data.train_batch_size": 512, "actor_rollout_ref.rollout.n": 16,
             "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean", "actor_rollout_ref.actor.use_kl_loss": False},
    "ppo_vs_grpo_gsm8k": {"algorithm.adv_estimator": "gae", "data.train_batch_size": 256,
                          "actor_rollout_ref.actor.ppo_mini_batch_size": 64, "actor_rollout_ref.actor.optim.lr": 1e-6,
                          "critic.optim.lr": 1e-5, "algorithm.kl_ctrl.kl_coef": 0.001, "data.max_prompt_length": 512,
                          "data.max_response_length": 256, "trainer.total_epochs": 15},
    "retool": {"actor_rollout_ref.rollout.multi_turn.enable": True, "actor_rollout_ref.rollout.multi_turn.format": "hermes",
               "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 16,
               "actor_rollout_ref.rollout.multi_turn.max_user_turns": 16, "actor_rollout_ref.actor.optim.lr": 1e-6,
               "actor_rollout_ref.actor.clip_ratio_low": 0.2, "actor_rollout_ref.actor.clip_ratio_high": 0.28,
               "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.rollout.n": 16,
               "actor_rollout_ref.actor.ppo_mini_batch_size": 16, "data.max_prompt_length": 2048,
               "data.max_response_length": 16384},
    "r1_zero_countdown": {"algorithm.adv_estimator": "gae", "data.train_batch_size": 256,
                          "actor_rollout_ref.actor.ppo_mini_batch_size": 64, "actor_rollout_ref.actor.optim.lr": 1e-6,
                          "critic.optim.lr": 1e-5, "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.use_kl_in_reward": True,
                          "data.max_prompt_length": 256, "data.max_response_length": 1024, "trainer.total_epochs": 15,
                          "reward.funcs": ["rule", "think_format"]},
}


def bash(*args, **env):
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(["bash", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": path, **env})


def test_every_recipe_has_its_files():
    assert RECIPES, "no recipes"
    for name in RECIPES:
        for file in ("README.md", "run_paper.sh", "run_cpu.sh"):
            assert (Path(REPO_ROOT) / "recipes" / name / file).is_file(), (name, file)


@pytest.mark.parametrize("name", RECIPES)
def test_paper_script_composes_with_the_papers_settings(name):
    done = bash(f"recipes/{name}/run_paper.sh", "--cfg", "job")
    assert done.returncode == 0, done.stderr[-2000:]
    cfg = yaml.safe_load(done.stdout)
    for key, value in PAPER[name].items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node == value, (key, node, value)


@pytest.mark.parametrize("name", RECIPES)
def test_scripts_without_their_data_print_the_command_that_writes_it(name, tmp_path):
    for script in ("run_paper.sh", "run_cpu.sh"):
        done = bash(f"recipes/{name}/{script}", DATA_DIR=str(tmp_path / "nothing"), PYTHON=sys.executable)
        assert done.returncode == 1 and "is missing; run: " in done.stderr and "tools/data/" in done.stderr, done.stderr


def recipe_function(recipe: str, module: str, name: str):
    """A function from a recipe's own module (recipes are folders, not packages)."""
    import importlib.util

    path = Path(REPO_ROOT, "recipes", recipe, f"{module}.py")
    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}_{module}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return getattr(loaded, name)


def test_deepseekmath_step_reward_checks_each_step():
    """The CPU recipe's process reward against steps and checks written out by hand."""
    compute_score = recipe_function("deepseekmath_grpo", "step_reward", "compute_score")
    text = "First 12 + 9 = 21\nthen 21 - 5 = 17 and 2 * 3 = 6\nNo numbers here\nSo the answer is 16."
    got = compute_score("arithmetic", text, "16")
    ends = [text.index("\n") + 1, text.index("\nNo") + 1, text.index("\nSo") + 1, len(text)]
    # 12 + 9 = 21 holds; 21 - 5 = 17 does not, 2 * 3 = 6 does; nothing to check; the answer 16 is right.
    assert got == {"score": 1.0, "acc": 1.0, "step_rewards": [1.0, 0.5, 0.0, 1.0], "step_ends": ends}
    assert compute_score("arithmetic", "3 - 5 = -2\n-2", "2")["step_rewards"] == [1.0, 0.0]
    assert compute_score("arithmetic", "", "2") == {"score": 0.0, "acc": 0.0, "step_rewards": [], "step_ends": []}


def test_retool_final_answer_reads_only_the_models_last_turn():
    """The calculator recipe's reward against trajectories written out by hand."""
    compute_score = recipe_function("retool", "final_answer", "compute_score")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 + 288"}}</tool_call>'
    assert compute_score("arithmetic", f"{call}\ntool\n635\nassistant\n635", "635")["score"] == 1.0
    # The calculator's number alone is not the model's answer.
    assert compute_score("arithmetic", f"{call}\ntool\n635\nassistant\n", "635")["score"] == 0.0
    assert compute_score("arithmetic", f"{call}\ntool\n635\nassistant\nIt is 600.", "635")["score"] == 0.0
    # Without a tool turn the whole response is the answer.
    assert compute_score("arithmetic/plain", "347 + 288 = 635", "635") == {"score": 1.0, "acc": 1.0, "called": 0.0}
