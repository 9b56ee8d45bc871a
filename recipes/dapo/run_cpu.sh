#!/usr/bin/env bash
# DAPO's CPU-scale effects (recipes/dapo/README.md): the default model on the built-in arithmetic
# task, three runs with the same seeds, 60 steps each, on a 2-core CPU:
#   grpo         symmetric clip 0.2, KL loss: verl's GRPO
#   clip_higher  the same with clip_ratio_high=0.28
#   dapo         clip-higher, no KL, dynamic sampling and the overlong buffer
# Each step's 8 prompts x 4 responses are trained on in 4 mini-batches of 2 prompts, so the ratio
# (and with it the clip) acts from the second mini-batch on, as in the paper (16 updates a step).
#
#   bash recipes/dapo/run_cpu.sh [extra overrides for every run]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/recipes/lib.sh"
use_arithmetic_data
out=${OUT_DIR:-$repo/runs/recipes/dapo}
common=(actor_rollout_ref.actor.ppo_mini_batch_size=2 trainer.project_name=dapo_cpu)
dapo=(
  actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.use_kl_loss=false
  algorithm.filter_groups.enable=true algorithm.filter_groups.metric=score algorithm.filter_groups.max_num_gen_batches=0
  reward_model.reward_manager=dapo reward_model.overlong_buffer.enable=true
  reward_model.overlong_buffer.len=8 reward_model.overlong_buffer.penalty_factor=1.0
)
cpu_run grpo "$@"
cpu_run clip_higher actor_rollout_ref.actor.clip_ratio_high=0.28 "$@"
cpu_run dapo "${dapo[@]}" "$@"
"$python" "$repo/tools/plot_metrics.py" "$out/grpo/metrics.jsonl:GRPO" "$out/clip_higher/metrics.jsonl:clip-higher" \
    "$out/dapo/metrics.jsonl:DAPO" -o "$here/cpu_run.png" \
    --metrics actor/entropy critic/score/zero_variance_groups dynamic_sampling/zero_variance_groups \
    actor/pg_clipfrac critic/score/mean 'val-core/*' response_length/mean
