#!/usr/bin/env bash
# GSPO (Zheng et al. 2025, arXiv 2507.18071, section 5.1) with the paper's clipping ranges and
# mini-batching, at the scale of verl's GSPO recipe (recipe/gspo/test_gspo_3b_math.sh): the paper
# trains a cold-started Qwen3-30B-A3B-Base that is not public, verl's recipe Qwen2.5-3B-Instruct
# on GSM8K; one node of 8 GPUs.
#
#   bash recipes/gspo/run_paper.sh --cfg job      # print the composed config, start nothing
#   sbatch --nodes=1 --gpus-per-node=8 recipes/gspo/run_paper.sh
#
# Data: python tools/data/gsm8k.py --out-dir ~/data/gsm8k. Model: MODEL_PATH (default: the
# Qwen/Qwen2.5-3B-Instruct hub id). Submit from the repository's root.
set -euo pipefail
repo=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
data=${DATA_DIR:-$HOME/data/gsm8k}
model=${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}

overrides=(
  data.train_files="$data/train.parquet" data.val_files="$data/test.parquet" data.val_max_samples=-1
  data.max_prompt_length=2048 data.max_response_length=8192 data.filter_overlong_prompts=true
  data.train_batch_size=512 actor_rollout_ref.rollout.n=16                 # 512 prompts x 16 responses
  actor_rollout_ref.actor.ppo_mini_batch_size=128                          # 4 mini-batches (paper, 5.1)
  algorithm.adv_estimator=grpo actor_rollout_ref.actor.policy_loss.loss_mode=gspo
  actor_rollout_ref.actor.clip_ratio_low=0.0003 actor_rollout_ref.actor.clip_ratio_high=0.0004   # paper, 5.1
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean
  actor_rollout_ref.actor.use_kl_loss=false algorithm.use_kl_in_reward=false actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05
  actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.grad_clip=1.0
  actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0
  actor_rollout_ref.rollout.val_kwargs.do_sample=true actor_rollout_ref.rollout.val_kwargs.temperature=1.0
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7
  actor_rollout_ref.model.path="$model" actor_rollout_ref.model.enable_gradient_checkpointing=true
  actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.8
  trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=1
  trainer.total_epochs=10 trainer.total_training_steps=500 trainer.test_freq=10 trainer.save_freq=10
  trainer.val_before_train=false
  trainer.logger='[console,jsonl,wandb]' trainer.project_name=RL-GSPO trainer.experiment_name=gspo_qwen2.5_3b_gsm8k
)

data_prep="python tools/data/gsm8k.py --out-dir $data"
data_files=("$data/train.parquet" "$data/test.parquet")
source "$repo/recipes/lib.sh"
start_paper_run "$@"
