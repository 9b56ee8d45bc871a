#!/usr/bin/env bash
# DeepSeekMath's three ways of scoring GRPO's samples, at CPU scale (recipes/deepseekmath_grpo/
# README.md): the default model on the built-in arithmetic task, 60 steps each, with the paper's
# KL coefficient (0.04, k3) and one policy update per step:
#   outcome_rule  outcome supervision by the rule (the answer checked): the reference point
#   outcome_rm    outcome supervision by a reward model trained here on the policy's own
#                 responses (tools/train_reward_model.py), the rule only logged
#   iterative     the same, with iterative RL: every 10 steps the reward model trains on the new
#                 responses (labelled by the rule) with a 10 % replay, and the reference resets
#   process       process supervision (grpo_process) by step_reward.py, which checks each
#                 step's equations and the final answer
#   process_prm   process supervision by a process reward model trained here on the policy's
#                 own responses, their steps labelled by step_reward.py (the rule only logged)
# The reward models are built once (sampling and training, about a quarter of an hour each) and reused.
#
#   bash recipes/deepseekmath_grpo/run_cpu.sh [extra overrides for every run]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/recipes/lib.sh"
use_arithmetic_data
out=${OUT_DIR:-$repo/runs/recipes/deepseekmath_grpo}
rm_dir=$out/reward_model
if [[ ! -f $rm_dir/rm/reward_model_training.json ]]; then
  echo "== reward model"
  (cd "$repo" && "$python" tools/train_reward_model.py sample --prompts "$data/train.parquet" \
      --out "$rm_dir/samples.parquet" --n 4 --max-response-length 24 --temperature 0.8 --seed 0 &&
   "$python" tools/train_reward_model.py train --data "$rm_dir/samples.parquet" --out "$rm_dir/rm" \
      --loss pointwise --epochs 2 --lr 5e-5 --seed 0)
fi
prm_dir=$out/process_reward_model
if [[ ! -f $prm_dir/prm/reward_model_training.json ]]; then
  echo "== process reward model"
  (cd "$repo" && "$python" tools/train_reward_model.py sample --prompts "$data/train.parquet" \
      --out "$prm_dir/steps.parquet" --n 4 --max-response-length 24 --temperature 0.8 --seed 0 \
      --step-scorer "$here/step_reward.py" &&
   "$python" tools/train_reward_model.py train --data "$prm_dir/steps.parquet" --out "$prm_dir/prm" \
      --epochs 2 --lr 5e-5 --seed 0)
fi
common=(actor_rollout_ref.actor.kl_loss_coef=0.04 actor_rollout_ref.actor.kl_loss_type=low_var_kl
        trainer.project_name=deepseekmath_grpo_cpu)
with_rm=(reward_model.enable=true reward_model.model.path="$rm_dir/rm"
         'reward.funcs=[reward_model,rule]' 'reward.weights=[1.0,0.0]')
cpu_run outcome_rule 'reward.funcs=[rule]' "$@"
cpu_run outcome_rm "${with_rm[@]}" "$@"
cpu_run iterative "${with_rm[@]}" trainer.iterative.enable=true trainer.iterative.freq=10 "$@"
cpu_run process algorithm.adv_estimator=grpo_process custom_reward_function.path="$here/step_reward.py" "$@"
cpu_run process_prm algorithm.adv_estimator=grpo_process reward_model.enable=true reward_model.model.path="$prm_dir/prm" \
    reward_model.process.enable=true 'reward.funcs=[reward_model,rule]' 'reward.weights=[1.0,0.0]' "$@"
"$python" "$repo/tools/plot_metrics.py" "$out/outcome_rule/metrics.jsonl:outcome (rule)" \
    "$out/outcome_rm/metrics.jsonl:outcome (reward model)" "$out/iterative/metrics.jsonl:iterative RL" \
    "$out/process/metrics.jsonl:process (step rule)" "$out/process_prm/metrics.jsonl:process (PRM)" -o "$here/cpu_run.png" \
    --metrics 'val-core/arithmetic/reward/rule/*' 'val-core/arithmetic/acc/*' reward/rule/mean critic/acc/mean \
    critic/score/mean actor/kl_loss response_length/mean
