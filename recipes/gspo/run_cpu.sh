#!/usr/bin/env bash
# GSPO's CPU-scale effect (recipes/gspo/README.md): the default model on the built-in arithmetic
# task at 5x the default learning rate (5e-5) and at the default (1e-5), two runs each with the
# same seeds, 60 steps each, on a 2-core CPU, no KL, each response's loss averaged over its
# tokens (seq-mean-token-mean):
#   grpo  token-level ratio, clipped per token at 0.2 / 0.27 (the paper's GRPO baseline)
#   gspo  one length-normalised ratio per response, clipped at 3e-4 / 4e-4 (the paper's ranges)
# Each step's 8 prompts x 4 responses are trained on in 4 mini-batches of 2 prompts (the paper
# splits each rollout batch into 4), so the ratio departs from 1 from the second update on.
#
#   bash recipes/gspo/run_cpu.sh [extra overrides for every run]
#   LRS=1e-5 bash recipes/gspo/run_cpu.sh     # one learning rate only
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/recipes/lib.sh"
use_arithmetic_data
out=${OUT_DIR:-$repo/runs/recipes/gspo}
common=(
  actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.actor.use_kl_loss=false
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean trainer.project_name=gspo_cpu
)
for lr in ${LRS:-5e-5 1e-5}; do
  cpu_run "grpo_lr$lr" actor_rollout_ref.actor.optim.lr="$lr" \
      actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.27 "$@"
  cpu_run "gspo_lr$lr" actor_rollout_ref.actor.optim.lr="$lr" actor_rollout_ref.actor.policy_loss.loss_mode=gspo \
      actor_rollout_ref.actor.clip_ratio_low=0.0003 actor_rollout_ref.actor.clip_ratio_high=0.0004 "$@"
done
"$python" "$repo/tools/plot_metrics.py" "$out/grpo_lr5e-5/metrics.jsonl:GRPO, lr 5e-5" \
    "$out/gspo_lr5e-5/metrics.jsonl:GSPO, lr 5e-5" "$out/grpo_lr1e-5/metrics.jsonl:GRPO, lr 1e-5" \
    "$out/gspo_lr1e-5/metrics.jsonl:GSPO, lr 1e-5" -o "$here/cpu_run.png" \
    --metrics actor/pg_clipfrac actor/ppo_kl actor/grad_norm critic/score/mean 'val-core/*' response_length/mean
