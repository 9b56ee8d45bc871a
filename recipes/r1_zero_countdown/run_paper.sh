#!/usr/bin/env bash
# R1-Zero-style RL on countdown at TinyZero's scale (Pan et al. 2025, github.com/Jiayi-Pan/TinyZero,
# scripts/train_tiny_zero.sh): Qwen2.5-3B (base) with PPO on one node of 2 GPUs; 256 prompts a
# step, mini-batches of 64, actor lr 1e-6, critic lr 1e-5, KL in the reward at 0.001, prompts up
# to 256 and responses up to 1024 tokens, 15 epochs. Rewards: the equation checked (1.0) plus
# R1-Zero's format reward (0.1; TinyZero gives 0.1 to a wrong answer in <answer> tags instead).
# ALGO=grpo trains the same with GRPO (8 responses a prompt, KL as a loss) instead of PPO.
#
#   bash recipes/r1_zero_countdown/run_paper.sh --cfg job              # print the composed config
#   sbatch --nodes=1 --gpus-per-node=2 recipes/r1_zero_countdown/run_paper.sh
#
# Data: python tools/data/countdown.py --out-dir ~/data/countdown (3-4 numbers from 1-100, every
# problem solvable; TinyZero draws its problems from the hub set Countdown-Tasks-3to4, whose rows
# score here unchanged). Model: MODEL_PATH (default: the Qwen/Qwen2.5-3B hub id). Submit from the
# repository's root.
set -euo pipefail
repo=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
data=${DATA_DIR:-$HOME/data/countdown}
model=${MODEL_PATH:-Qwen/Qwen2.5-3B}

case ${ALGO:-ppo} in
  ppo) algo=(algorithm.adv_estimator=gae actor_rollout_ref.rollout.n=1 critic.optim.lr=1e-5 critic.model.path="$model"
             critic.model.use_remove_padding=true critic.use_dynamic_bsz=true
             algorithm.use_kl_in_reward=true algorithm.kl_ctrl.kl_coef=0.001 actor_rollout_ref.actor.use_kl_loss=false) ;;
  grpo) algo=(algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=8 algorithm.use_kl_in_reward=false
              actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001) ;;
  *) echo "error: ALGO must be ppo or grpo, got '$ALGO'" >&2; exit 1 ;;
esac
overrides=(
  "${algo[@]}"
  data.train_files="$data/train.parquet" data.val_files="$data/test.parquet" data.val_max_samples=-1
  data.train_batch_size=256 data.max_prompt_length=256 data.max_response_length=1024
  actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.optim.lr=1e-6
  'reward.funcs=[rule,think_format]' 'reward.weights=[1.0,0.1]'
  actor_rollout_ref.model.path="$model" actor_rollout_ref.model.use_remove_padding=true
  actor_rollout_ref.actor.use_dynamic_bsz=true
  actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
  trainer.device=cuda trainer.n_gpus_per_node=2 trainer.nnodes=1
  trainer.total_epochs=15 trainer.save_freq=100 trainer.test_freq=100 trainer.val_before_train=false
  trainer.logger='[console,jsonl,wandb]' trainer.project_name=TinyZero trainer.experiment_name="countdown-qwen2.5-3b-${ALGO:-ppo}"
)

data_prep="python tools/data/countdown.py --out-dir $data"
data_files=("$data/train.parquet" "$data/test.parquet")
source "$repo/recipes/lib.sh"
start_paper_run "$@"
