#!/usr/bin/env bash
# GRPO as DeepSeekMath trained it (Shao et al. 2024, arXiv 2402.03300, section 4.2): from
# DeepSeekMath-Instruct 7B on GSM8K and MATH chain-of-thought questions, scored by a reward
# model; policy lr 1e-6, KL coefficient 0.04 (the k3 estimator: verl's low_var_kl), 64 outputs
# per question, responses up to 1024 tokens, 1024 responses a step (16 questions x 64), one
# policy update per exploration stage; iterative RL replays 10 % of earlier data.
#
#   bash recipes/deepseekmath_grpo/run_paper.sh --cfg job              # print the composed config
#   REWARD_MODEL=/models/rm sbatch --nodes=4 --gpus-per-node=8 recipes/deepseekmath_grpo/run_paper.sh
#   SUPERVISION=process REWARD_MODEL=/models/prm sbatch ... run_paper.sh   # GRPO+PS (a token-classifier PRM)
#   ITERATIVE=1 REWARD_MODEL=/models/rm sbatch ... run_paper.sh            # iterative RL on top of GRPO+OS
#   ITERATIVE=1 SUPERVISION=process STEP_SCORER=my_steps.py:fn ...         # ... on top of GRPO+PS: your
#                                      # grpo_process function labels each step for the PRM's training
#
# Data (under DATA_DIR, default ~/data): python tools/data/gsm8k.py --out-dir ~/data/gsm8k and
# python tools/data/hendrycks_math.py --out-dir ~/data/math (the paper trains on 144K GSM8K/MATH questions from its SFT data, which is
# not public; these are the two benchmarks' own training sets; MATH is evaluated on MATH-500, the
# paper on all 5000 test problems). Reward model: REWARD_MODEL, a sequence classifier (outcome) or
# token classifier (process) folder, e.g. trained with tools/train_reward_model.py (the paper's is
# DeepSeekMath-Base 7B trained at lr 2e-5). Model: MODEL_PATH. Submit from the repository's root.
set -euo pipefail
repo=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
data=${DATA_DIR:-$HOME/data}
gsm8k=$data/gsm8k math=$data/math
model=${MODEL_PATH:-deepseek-ai/deepseek-math-7b-instruct}
reward_model=${REWARD_MODEL:-}

case ${SUPERVISION:-outcome} in
  # The rule is logged beside the reward model at weight 0.
  outcome) supervision=(algorithm.adv_estimator=grpo 'reward.funcs=[reward_model,rule]' 'reward.weights=[1.0,0.0]') ;;
  process) supervision=(algorithm.adv_estimator=grpo_process reward_model.process.enable=true
                        'reward.funcs=[reward_model,rule]' 'reward.weights=[1.0,0.0]') ;;
  *) echo "error: SUPERVISION must be outcome or process, got '$SUPERVISION'" >&2; exit 1 ;;
esac
iterative=() name=deepseekmath_7b_${SUPERVISION:-outcome}
if [[ ${ITERATIVE:-0} == 1 ]]; then
  name+=_iterative
  # Every ITERATION_STEPS steps the reward model trains on the policy's new samples (labelled by
  # the rule) plus a 10 % replay of earlier ones, and the reference becomes the current policy.
  iterative=(trainer.iterative.enable=true trainer.iterative.freq="${ITERATION_STEPS:-100}"
             trainer.iterative.replay_ratio=0.1 trainer.iterative.reward_model.lr=2e-5)
  # A PRM trains on step labels, from a function of yours (none here checks GSM8K or MATH steps).
  if [[ ${SUPERVISION:-outcome} == process ]]; then
    iterative+=(trainer.iterative.reward_model.step_scorer="${STEP_SCORER:-}")
  fi
fi
overrides=(
  "${supervision[@]}" "${iterative[@]}"
  data.train_files="[$gsm8k/train.parquet,$math/train.parquet]"
  data.val_files="[$gsm8k/test.parquet,$math/test.parquet]" data.val_max_samples=-1
  data.max_prompt_length=1024 data.max_response_length=1024
  data.train_batch_size=16 actor_rollout_ref.rollout.n=64                 # 16 questions x 64 outputs
  actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_epochs=1   # one update
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.04
  actor_rollout_ref.actor.kl_loss_type=low_var_kl algorithm.use_kl_in_reward=false
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean               # the paper's 1/|o_i| sum
  reward_model.enable=true reward_model.model.path="${reward_model:-REWARD_MODEL}"
  actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.do_sample=false
  actor_rollout_ref.model.path="$model" actor_rollout_ref.model.enable_gradient_checkpointing=true
  actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
  actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
  trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=4
  trainer.total_epochs=1 trainer.test_freq=50 trainer.save_freq=50 trainer.val_before_train=true
  trainer.logger='[console,jsonl,wandb]' trainer.project_name=deepseekmath_grpo
  trainer.experiment_name="$name"
)

data_prep="python tools/data/gsm8k.py --out-dir $gsm8k && python tools/data/hendrycks_math.py --out-dir $math"
data_files=("$gsm8k/train.parquet" "$gsm8k/test.parquet" "$math/train.parquet" "$math/test.parquet")
source "$repo/recipes/lib.sh"
if [[ ${1:-} != --cfg ]]; then
  require_data "$data_prep" "${data_files[@]}"
  [[ -n $reward_model ]] || { echo "error: set REWARD_MODEL to the reward model's folder (tools/train_reward_model.py trains one)" >&2; exit 1; }
fi
start_paper_run "$@"
