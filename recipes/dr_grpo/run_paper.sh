#!/usr/bin/env bash
# Dr. GRPO at the paper's scale (Liu et al. 2025, arXiv 2503.20783, and the authors' script
# examples/qwen2.5-math-7b.sh in sail-sg/understand-r1-zero): Qwen2.5-Math-7B (base) on MATH
# levels 3-5 with the Qwen-Math template, one node of 8 GPUs.
#
#   bash recipes/dr_grpo/run_paper.sh --cfg job      # print the composed config, start nothing
#   sbatch --nodes=1 --gpus-per-node=8 recipes/dr_grpo/run_paper.sh
#
# Data: python tools/data/hendrycks_math.py --out-dir ~/data/math_lvl3to5 --levels 3 4 5 --template qwen-math
# (MATH levels 3-5 to train on, MATH-500 to evaluate on, scored by math-verify as the authors do).
# Model: MODEL_PATH (default: the Qwen/Qwen2.5-Math-7B hub id). Submit from the repository's root.
set -euo pipefail
repo=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
data=${DATA_DIR:-$HOME/data/math_lvl3to5}
model=${MODEL_PATH:-Qwen/Qwen2.5-Math-7B}

overrides=(
  data.train_files="$data/train.parquet" data.val_files="$data/test.parquet" data.val_max_samples=-1
  data.max_prompt_length=1024 data.max_response_length=3000
  data.train_batch_size=128 actor_rollout_ref.rollout.n=8                  # 128 prompts x 8 responses
  actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_epochs=1   # 128 responses an update
  algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=false     # Dr. GRPO: no std division
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm            # token sums over a constant:
  actor_rollout_ref.actor.loss_scale_factor=3000                           #   the generation budget
  actor_rollout_ref.actor.use_kl_loss=false algorithm.use_kl_in_reward=false   # beta 0
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=0   # constant
  actor_rollout_ref.actor.optim.lr_scheduler_type=constant
  actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0
  actor_rollout_ref.rollout.val_kwargs.do_sample=false                     # greedy evaluation
  actor_rollout_ref.model.path="$model" actor_rollout_ref.model.enable_gradient_checkpointing=true
  actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.35
  trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=1
  trainer.total_epochs=20 trainer.test_freq=16 trainer.save_freq=16 trainer.val_before_train=true
  trainer.logger='[console,jsonl,wandb]' trainer.project_name=dr_grpo trainer.experiment_name=qwen2.5_math_7b_qwen_math
)

data_prep="python tools/data/hendrycks_math.py --out-dir $data --levels 3 4 5 --template qwen-math"
data_files=("$data/train.parquet" "$data/test.parquet")
source "$repo/recipes/lib.sh"
start_paper_run "$@"
