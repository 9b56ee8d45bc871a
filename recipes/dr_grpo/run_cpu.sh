#!/usr/bin/env bash
# Dr. GRPO's CPU-scale effect (recipes/dr_grpo/README.md): the default model on the built-in
# arithmetic task with room to ramble (responses up to 64 tokens), two runs with the same seeds,
# 60 steps each, on a 2-core CPU, no KL (as in the paper):
#   grpo     GRPO as the paper analyses it: each response's loss averaged over its own tokens
#            (seq-mean-token-mean) and advantages divided by the group's standard deviation
#   dr_grpo  Dr. GRPO: token sums divided by one constant (the 64-token budget), no std division
#
#   bash recipes/dr_grpo/run_cpu.sh [extra overrides for every run]
#   OUT_DIR=runs/recipes/dr_grpo_seed2 PLOT=/tmp/seed2.png bash recipes/dr_grpo/run_cpu.sh \
#       data.seed=2 actor_rollout_ref.rollout.seed=1 trainer.seed=2     # the README's second seeds
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/recipes/lib.sh"
use_arithmetic_data
out=${OUT_DIR:-$repo/runs/recipes/dr_grpo}
plot=${PLOT:-$here/cpu_run.png}
common=(data.max_response_length=64 actor_rollout_ref.actor.use_kl_loss=false trainer.project_name=dr_grpo_cpu)
cpu_run grpo actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean algorithm.norm_adv_by_std_in_grpo=true "$@"
cpu_run dr_grpo actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm \
    actor_rollout_ref.actor.loss_scale_factor=64 algorithm.norm_adv_by_std_in_grpo=false "$@"
"$python" "$repo/tools/plot_metrics.py" "$out/grpo/metrics.jsonl:GRPO" "$out/dr_grpo/metrics.jsonl:Dr. GRPO" \
    -o "$plot" --metrics response_length/incorrect_mean response_length/correct_mean \
    response_length/clip_ratio critic/score/mean 'val-core/*' critic/score/zero_variance_groups
