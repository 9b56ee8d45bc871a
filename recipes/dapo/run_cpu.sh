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
data=${DATA_DIR:-$HOME/data/arithmetic}
out=${OUT_DIR:-$repo/runs/recipes/dapo}
python=${PYTHON:-$repo/.venv/bin/python}
for file in train test shifted; do
  [[ -f $data/$file.parquet ]] || {
    echo "error: $data/$file.parquet is missing; run: $python tools/data/arithmetic.py --out-dir $data" >&2; exit 1; }
done

common=(
  data.train_files="$data/train.parquet" data.val_files="[$data/test.parquet,$data/shifted.parquet]"
  data.val_max_samples=-1 data.max_prompt_length=128
  actor_rollout_ref.actor.ppo_mini_batch_size=2
  trainer.total_training_steps=60 trainer.test_freq=10 trainer.logger='[console,jsonl]' trainer.progress_bar=false
  trainer.final_model_dir=null trainer.project_name=dapo_cpu
)
dapo=(
  actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.use_kl_loss=false
  algorithm.filter_groups.enable=true algorithm.filter_groups.metric=score algorithm.filter_groups.max_num_gen_batches=0
  reward_model.reward_manager=dapo reward_model.overlong_buffer.enable=true
  reward_model.overlong_buffer.len=8 reward_model.overlong_buffer.penalty_factor=1.0
)
run() {
  local name=$1; shift
  echo "== $name"
  (cd "$repo" && "$python" -m hybrid_rl.main "${common[@]}" trainer.experiment_name="$name" \
      trainer.default_local_dir="$out/$name" "$@")
}
run grpo "$@"
run clip_higher actor_rollout_ref.actor.clip_ratio_high=0.28 "$@"
run dapo "${dapo[@]}" "$@"
"$python" "$repo/tools/plot_metrics.py" "$out/grpo/metrics.jsonl:GRPO" "$out/clip_higher/metrics.jsonl:clip-higher" \
    "$out/dapo/metrics.jsonl:DAPO" -o "$here/cpu_run.png" \
    --metrics actor/entropy critic/score/zero_variance_groups dynamic_sampling/zero_variance_groups \
    actor/pg_clipfrac critic/score/mean 'val-core/*' response_length/mean
