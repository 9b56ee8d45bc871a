#!/usr/bin/env bash
# DAPO at the paper's scale (Yu et al. 2025, arXiv 2503.14476, section 4.1 and verl's
# recipe/dapo/run_dapo_qwen2.5_32b.sh): Qwen2.5-32B base on DAPO-Math-17k, 16 nodes x 8 GPUs.
#
#   bash recipes/dapo/run_paper.sh --cfg job      # print the composed config, start nothing
#   sbatch --nodes=16 --gpus-per-node=8 recipes/dapo/run_paper.sh
#
# Data: python tools/data/dapo_math.py --out-dir ~/data/dapo (DAPO-Math-17k to train on, AIME 2024
# to evaluate, scored by the built-in math_dapo scorer). Model: MODEL_PATH (default: the
# Qwen/Qwen2.5-32B hub id). Submit from the repository's root (sbatch runs a copy of the script).
set -euo pipefail
repo=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
data=${DATA_DIR:-$HOME/data/dapo}
model=${MODEL_PATH:-Qwen/Qwen2.5-32B}

overrides=(
  data.train_files="$data/dapo-math-17k.parquet" data.val_files="$data/aime-2024.parquet"
  data.prompt_key=prompt data.truncation=left data.val_max_samples=-1
  data.max_prompt_length=2048 data.max_response_length=20480              # 16384 expected + 4096 buffer
  data.train_batch_size=512 data.gen_batch_size=1536                      # 512 prompts x 16 responses
  actor_rollout_ref.rollout.n=16
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false algorithm.kl_ctrl.kl_coef=0.0
  actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.kl_loss_coef=0.0
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28   # clip-higher
  actor_rollout_ref.actor.clip_ratio_c=10.0
  actor_rollout_ref.actor.loss_agg_mode=token-mean                         # token-level loss
  algorithm.filter_groups.enable=true algorithm.filter_groups.metric=acc  # dynamic sampling
  algorithm.filter_groups.max_num_gen_batches=10
  reward_model.reward_manager=dapo reward_model.overlong_buffer.enable=true  # overlong reward shaping
  reward_model.overlong_buffer.len=4096 reward_model.overlong_buffer.penalty_factor=1.0
  actor_rollout_ref.actor.ppo_mini_batch_size=32                           # 512 responses: 16 updates a step
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=20
  actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.grad_clip=1.0
  actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0
  actor_rollout_ref.rollout.val_kwargs.do_sample=true actor_rollout_ref.rollout.val_kwargs.temperature=1.0
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7 actor_rollout_ref.rollout.val_kwargs.n=32   # avg@32
  actor_rollout_ref.model.path="$model" actor_rollout_ref.model.enable_gradient_checkpointing=true
  actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22528
  actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.gpu_memory_utilization=0.80
  trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=16
  trainer.total_epochs=1 trainer.total_training_steps=null trainer.test_freq=5 trainer.save_freq=5
  trainer.val_before_train=true trainer.logger='[console,jsonl,wandb]'
  trainer.project_name=DAPO trainer.experiment_name=dapo_qwen2.5_32b
)

data_prep="python tools/data/dapo_math.py --out-dir $data"
data_files=("$data/dapo-math-17k.parquet" "$data/aime-2024.parquet")
source "$repo/recipes/lib.sh"
start_paper_run "$@"
