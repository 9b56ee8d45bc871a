"""tools/verl_examples.py reads a verl-style launch script as bash expands it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import verl_examples  # noqa: E402

SCRIPT = """set -xeuo pipefail
eval "$(conda shell.bash hook)"
source /opt/cluster/set_env.sh
NNODES=${SLURM_JOB_NUM_NODES}
train_files="['$HOME/data/gsm8k/train.parquet']"
python3 -c "import ray; print(ray.cluster_resources())"
srun --nodes=${NNODES} python3 -m verl.trainer.main_ppo --config-path=config \\
    --config-name='ppo_megatron_trainer' \\
    data.train_files="$train_files" \\
    trainer.logger='["console","wandb"]' \\
    trainer.nnodes=$NNODES $@
"""


def test_the_launch_line_is_recorded_as_bash_expands_it(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(SCRIPT)
    argv = verl_examples.recorded_command(script, tmp_path)
    from hybrid_rl.main import split_command_line

    config_path, config_name, overrides = split_command_line(argv)
    assert (config_path, config_name) == ("config", "ppo_megatron_trainer")
    assert overrides == [f"data.train_files=['{tmp_path}/home/data/gsm8k/train.parquet']",
                         'trainer.logger=["console","wandb"]', "trainer.nnodes=1"]


def test_cluster_sizes_models_and_data_are_substituted_for_the_one_step_run(tmp_path):
    kept = verl_examples.substituted(["actor_rollout_ref.model.path=Qwen/Qwen2-7B", "data.train_batch_size=1024",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
                                      "algorithm.adv_estimator=rloo", "+x.y=1", "trainer.logger=[console,wandb]"],
                                     tmp_path, ["console", "wandb"])
    assert kept[:2] == ["algorithm.adv_estimator=rloo", "+x.y=1"]
    assert kept[-1] == "trainer.logger=[console,wandb,jsonl]"  # the step is read from metrics.jsonl
    assert "trainer.total_training_steps=1" in kept and f"trainer.default_local_dir={tmp_path}" in kept
    assert not any(o.startswith(("actor_rollout_ref.model.path", "data.train_batch_size")) for o in kept)


def test_a_scripts_reward_model_becomes_a_classifier_built_from_the_default_model(tmp_path):
    """The hub classifier's folder is not here; an untrained one-label classifier is, and the
    reward model loader takes it."""
    import torch

    from hybrid_rl.engines.hf_model import load_score_model
    from hybrid_rl.main import compose_config

    kept = verl_examples.substituted(["reward_model.enable=True", "reward_model.model.path=Skywork/Skywork-Reward"],
                                     tmp_path, ["console"])
    folder = verl_examples.reward_model_folder()
    assert [o for o in kept if o.startswith("reward_model.")] == [
        "reward_model.enable=True", f"reward_model.model.path={folder}"]
    model = load_score_model(folder, compose_config([]).reward_model.model, torch.device("cpu"), False)
    assert model.score.out_features == 1
    assert not any(o.startswith("reward_model.model.path") for o in verl_examples.substituted(
        ["algorithm.adv_estimator=grpo"], tmp_path, ["console"]))


def test_a_deepseek_v3_shaped_scripts_model_becomes_a_small_one_of_that_kind(tmp_path):
    """Moonlight's and DeepSeek-V3's scripts train a random DeepSeek-V3-shaped model (and its
    converted dist-checkpoint), which the Megatron engine's converter knows; others keep theirs."""
    from transformers import AutoConfig

    kept = verl_examples.substituted(["actor_rollout_ref.model.path=moonshotai/Moonlight-16B-A3B",
                                      "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True",
                                      "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/cluster/ckpt"],
                                     tmp_path, ["console"])
    model = verl_examples.moe_model_folder(latent=True)
    assert f"actor_rollout_ref.model.path={model}" in kept
    assert AutoConfig.from_pretrained(model).model_type == "deepseek_v3"
    mcore = [o.partition("=")[2] for o in kept
             if o.startswith("actor_rollout_ref.actor.megatron.dist_checkpointing_path")]
    assert mcore == [verl_examples.dist_checkpoint_folder(model, "random-deepseek-v3-mcore")]
    assert f"actor_rollout_ref.model.path={model}" not in verl_examples.substituted(
        ["actor_rollout_ref.model.path=Qwen/Qwen2-7B"], tmp_path, ["console"])


def test_compose_errors_that_verls_own_config_gives_too_are_marked(tmp_path):
    """A script that overrides a key verl's composed config lacks, or adds (`+`) one it has, fails
    in verl as well; an error only ours gives is not marked."""
    folder = tmp_path / verl_examples.VERL_CONFIG_DIR
    folder.mkdir(parents=True)
    (folder / "_generated_ppo_trainer.yaml").write_text("actor_rollout_ref:\n  model:\n    path: m\n")

    def marked(error: str, config_name=None) -> bool:
        return verl_examples.same_in_verl({"compose": error, "config_name": config_name}, tmp_path)

    assert marked("Could not override 'actor_rollout_ref.model.torch_dtype'.")
    assert not marked("Could not override 'actor_rollout_ref.model.path'.")
    assert marked("Could not append to config. An item is already at 'actor_rollout_ref.model.path'.")
    assert not marked("Could not append to config. An item is already at 'actor_rollout_ref.model.dtype'.")
    assert not marked("Could not override 'x'.", config_name="ppo_megatron_trainer")  # no such config here
    assert not marked("Key 'x' is not in struct")
