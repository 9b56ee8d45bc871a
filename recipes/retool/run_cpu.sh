#!/usr/bin/env bash
# ReTool's effect at CPU scale (recipes/retool/README.md): the default model, told about a
# calculator in a system message, on three-digit sums and differences it mostly gets wrong alone.
# Two GRPO runs of 40 steps (8 prompts x 4 trajectories, up to 2 assistant turns and 96 tokens per
# trajectory, same seeds) on a 2-core CPU, validated greedily every 10 steps on 64 held-out
# problems asked with an example call (test) and without one (plain):
#   hinted  every training prompt shows the call that solves it
#   mixed   every other training prompt is asked plainly
#
#   bash recipes/retool/run_cpu.sh [extra overrides for every run]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/recipes/lib.sh"
data=${DATA_DIR:-$HOME/data/tool_calculator}
require_data "$python tools/data/tool_calculator.py --out-dir $data" "$data"/{train,train_mixed,test,plain}.parquet
out=${OUT_DIR:-$repo/runs/recipes/retool}
plot=${PLOT:-$here/cpu_run.png}

run() {
  local name=$1 train=$2; shift 2
  echo "== $name"
  (cd "$repo" && "$python" -m hybrid_rl.main \
      data.train_files="$train" data.val_files="[$data/test.parquet,$data/plain.parquet]" \
      data.val_max_samples=-1 data.max_prompt_length=384 data.max_response_length=96 \
      actor_rollout_ref.rollout.multi_turn.enable=true \
      actor_rollout_ref.rollout.multi_turn.tool_config_path="$here/calculator_tools.yaml" \
      actor_rollout_ref.rollout.multi_turn.describe_tools=system \
      actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2 \
      actor_rollout_ref.rollout.temperature=0.7 \
      custom_reward_function.path="$here/final_answer.py" custom_reward_function.name=compute_score \
      trainer.total_training_steps=40 trainer.test_freq=10 trainer.validation_data_dir="$out/$name/validation" \
      trainer.logger='[console,jsonl]' trainer.progress_bar=false trainer.final_model_dir=null \
      trainer.project_name=retool_cpu trainer.experiment_name="$name" trainer.default_local_dir="$out/$name" "$@")
}
run hinted "$data/train.parquet" "$@"
run mixed "$data/train_mixed.parquet" "$@"
"$python" "$repo/tools/plot_metrics.py" "$out/hinted/metrics.jsonl:hinted" "$out/mixed/metrics.jsonl:mixed" \
    -o "$plot" --metrics critic/score/mean multi_turn/tool_call_share multi_turn/tool_errors/mean 'val-core/*' \
    response_length/mean actor/entropy
