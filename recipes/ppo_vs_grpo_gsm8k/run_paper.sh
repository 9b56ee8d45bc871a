#!/usr/bin/env bash
# verl's GSM8K baseline at its own scale: PPO on Qwen2.5-0.5B-Instruct with verl's quickstart
# settings (docs/start/quickstart.rst: 256 prompts a step, mini-batches of 64, actor lr 1e-6,
# critic lr 1e-5, KL coefficient 0.001, prompts up to 512 and responses up to 256 tokens,
# 15 epochs), one GPU. ALGO=grpo|rloo|reinforce_plus_plus runs the same job with that critic-free
# estimator instead, at the same 256 sampled responses a step (64 prompts x 4).
#
#   bash recipes/ppo_vs_grpo_gsm8k/run_paper.sh --cfg job          # print the composed config
#   sbatch --nodes=1 --gpus-per-node=1 recipes/ppo_vs_grpo_gsm8k/run_paper.sh
#   ALGO=grpo sbatch --nodes=1 --gpus-per-node=1 recipes/ppo_vs_grpo_gsm8k/run_paper.sh
#
# Data: python tools/data/gsm8k.py --out-dir ~/data/gsm8k. Model: MODEL_PATH (default: the
# Qwen/Qwen2.5-0.5B-Instruct hub id). Submit from the repository's root.
set -euo pipefail
repo=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
data=${DATA_DIR:-$HOME/data/gsm8k}
model=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
algo=${ALGO:-ppo}

case $algo in
  ppo) estimator=(algorithm.adv_estimator=gae data.train_batch_size=256 actor_rollout_ref.rollout.n=1
                  actor_rollout_ref.actor.ppo_mini_batch_size=64 critic.optim.lr=1e-5 critic.model.path="$model") ;;
  grpo|rloo|reinforce_plus_plus)
       estimator=(algorithm.adv_estimator="$algo" data.train_batch_size=64 actor_rollout_ref.rollout.n=4
                  actor_rollout_ref.actor.ppo_mini_batch_size=16) ;;
  *) echo "error: ALGO must be ppo, grpo, rloo or reinforce_plus_plus, got '$algo'" >&2; exit 1 ;;
esac
overrides=(
  "${estimator[@]}"
  data.train_files="$data/train.parquet" data.val_files="$data/test.parquet" data.val_max_samples=-1
  data.max_prompt_length=512 data.max_response_length=256
  actor_rollout_ref.model.path="$model" actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.use_kl_loss=false algorithm.kl_ctrl.kl_coef=0.001
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
  trainer.device=cuda trainer.n_gpus_per_node=1 trainer.nnodes=1
  trainer.total_epochs=15 trainer.save_freq=10 trainer.test_freq=10 trainer.val_before_train=false
  trainer.logger='[console,jsonl]' trainer.project_name=verl_example_gsm8k trainer.experiment_name="qwen2.5_0.5b_$algo"
)

data_prep="python tools/data/gsm8k.py --out-dir $data"
data_files=("$data/train.parquet" "$data/test.parquet")
source "$repo/recipes/lib.sh"
start_paper_run "$@"
