#!/usr/bin/env bash
# PPO against critic-free estimators at an equal sample budget (recipes/ppo_vs_grpo_gsm8k/README.md):
# the default model on the built-in arithmetic task, 32 sampled responses a step for every run,
# 60 steps each, the same seeds, on a 2-core CPU:
#   ppo    GAE with a learned critic (a value head on the same model), 32 prompts x 1 response
#   grpo   group mean and std baseline, 8 prompts x 4 responses
#   rloo   leave-one-out mean baseline, 8 prompts x 4 responses
#   rfpp   REINFORCE++: discounted returns whitened over the batch, 8 prompts x 4 responses
# Everything else is the default job (lr 1e-5, KL loss 0.001, one mini-batch a step).
#
#   bash recipes/ppo_vs_grpo_gsm8k/run_cpu.sh [extra overrides for every run]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/recipes/lib.sh"
use_arithmetic_data
out=${OUT_DIR:-$repo/runs/recipes/ppo_vs_grpo}
common=(trainer.project_name=ppo_vs_grpo_cpu)
groups=(data.train_batch_size=8 actor_rollout_ref.rollout.n=4)
cpu_run ppo algorithm.adv_estimator=gae data.train_batch_size=32 actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 "$@"                      # one update a step, as the others
cpu_run grpo algorithm.adv_estimator=grpo "${groups[@]}" "$@"
cpu_run rloo algorithm.adv_estimator=rloo "${groups[@]}" "$@"
cpu_run rfpp algorithm.adv_estimator=reinforce_plus_plus "${groups[@]}" "$@"
"$python" "$repo/tools/plot_metrics.py" "$out/ppo/metrics.jsonl:PPO (GAE, critic)" "$out/grpo/metrics.jsonl:GRPO" \
    "$out/rloo/metrics.jsonl:RLOO" "$out/rfpp/metrics.jsonl:REINFORCE++" -o "$here/cpu_run.png" \
    --metrics critic/score/mean 'val-core/*' actor/entropy critic/vf_loss timing_s/step
