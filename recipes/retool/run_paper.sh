#!/usr/bin/env bash
# ReTool's RL stage at scale (Feng et al. 2025, arXiv 2504.11536; settings of verl's ReTool script,
# verl/experimental/fully_async_policy/shell/dapo_7b_async_retool.sh at verl b178a3cd5): a
# Qwen2.5-7B-Instruct already fine-tuned on code-interleaved reasoning traces (ReTool's cold
# start, not built here) learns to call a Python interpreter while solving DAPO-Math-17k, DAPO's
# algorithm (clip-higher, token-level loss, no KL), up to 16 tool turns, 1 node x 8 GPUs.
# verl runs it fully asynchronously (4 GPUs generate, 4 train); here it runs colocated and
# synchronously, 64 prompts a step for verl's 250 x 64 prompts.
#
#   bash recipes/retool/run_paper.sh --cfg job      # print the composed config, start nothing
#   MODEL_PATH=<cold-start SFT model> sbatch --nodes=1 --gpus-per-node=8 recipes/retool/run_paper.sh
#
# Data: python tools/data/dapo_math.py --out-dir ~/data/dapo. Submit from the repository's root.
set -euo pipefail
repo=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
data=${DATA_DIR:-$HOME/data/dapo}
model=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}

overrides=(
  data.train_files="$data/dapo-math-17k.parquet" data.val_files="$data/aime-2024.parquet"
  data.filter_overlong_prompts=true data.truncation=error data.val_max_samples=-1
  data.max_prompt_length=2048 data.max_response_length=16384
  data.train_batch_size=64 trainer.total_training_steps=250 actor_rollout_ref.rollout.n=16
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false algorithm.kl_ctrl.kl_coef=0.0
  actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.kl_loss_coef=0.0
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
  actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.actor.loss_agg_mode=token-mean
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=16
  actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.multi_turn.format=hermes
  actor_rollout_ref.rollout.multi_turn.max_assistant_turns=16 actor_rollout_ref.rollout.multi_turn.max_user_turns=16
  actor_rollout_ref.rollout.multi_turn.tool_config_path="$repo/recipes/retool/code_interpreter_tools.yaml"
  actor_rollout_ref.rollout.val_kwargs.do_sample=true actor_rollout_ref.rollout.val_kwargs.temperature=1.0
  actor_rollout_ref.rollout.val_kwargs.top_p=0.6 actor_rollout_ref.rollout.val_kwargs.n=30
  actor_rollout_ref.model.path="$model" actor_rollout_ref.model.enable_gradient_checkpointing=true
  actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=18432 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=73728
  actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.gpu_memory_utilization=0.8
  trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.test_freq=10 trainer.save_freq=10
  trainer.val_before_train=true trainer.logger='[console,jsonl,wandb]'
  trainer.project_name=retool trainer.experiment_name=qwen2.5-7b_retool
)

data_prep="python tools/data/dapo_math.py --out-dir $data"
data_files=("$data/dapo-math-17k.parquet" "$data/aime-2024.parquet")
source "$repo/recipes/lib.sh"
start_paper_run "$@"
