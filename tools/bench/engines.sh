#!/usr/bin/env bash
# Both training engines over three model sizes with tools/bench/engine.py: update time and MFU,
# log-prob time, weight gathering for a sync, peak memory. One JSON per run in $OUT.
#
#   OUT=runs/bench/engines bash tools/bench/engines.sh [extra engine.py arguments and overrides]
#
# SHAPES, STRATEGIES and BATCH override the defaults below; PYTHON the interpreter. Micro-batches
# are token budgets (8k tokens per update micro-batch, 16k per log-prob one), as on a GPU job.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/bench/engines}
PYTHON=${PYTHON:-python}
SHAPES=${SHAPES:-smollm2-135m qwen2.5-0.5b qwen2.5-1.5b}
STRATEGIES=${STRATEGIES:-fsdp megatron}
BATCH=${BATCH:---prompts 16 --responses 8 --prompt-len 256 --response-len 768 --steps 4}
TOKEN_BUDGETS=(actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192
               actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true
               actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384)
mkdir -p "$OUT"
status=0
for shape in $SHAPES; do
  for strategy in $STRATEGIES; do
    echo "== $strategy $shape"
    # shellcheck disable=SC2086  # BATCH is a list of arguments
    "$PYTHON" tools/bench/engine.py --strategy "$strategy" --shape "$shape" $BATCH \
      --json "$OUT/$strategy-$shape.json" "${TOKEN_BUDGETS[@]}" "$@" > "$OUT/$strategy-$shape.log" 2>&1 \
      || { status=1; echo "failed: see $OUT/$strategy-$shape.log"; }
    grep -v -i -E "warn|^ *warnings\.|it/s\]|func\(" "$OUT/$strategy-$shape.log" | tail -n 8
  done
done
exit $status
