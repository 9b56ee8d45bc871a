#!/usr/bin/env bash
# R1-Zero's rule rewards at CPU scale (recipes/r1_zero_countdown/README.md): the default model on
# the built-in arithmetic task asked in R1-Zero's format (reason inside <think>, answer inside
# <answer>; the answer counts only inside the tags), responses up to 64 tokens, 60 steps each:
#   r1_rewards   R1-Zero's two rewards: the answer (rule, 1) plus the format (think_format, 1)
#   soft_format  the same plus partial credit per tag written once (think_tags, 0.25 a tag),
#                the usual help for models too small to write the whole format unprompted
# Validated every 10 steps on held-out problems like the training ones and on wider operands and
# other phrasings (the shifted sets), all asked in the same format.
#
#   bash recipes/r1_zero_countdown/run_cpu.sh [extra overrides for every run]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$repo/recipes/lib.sh"
use_arithmetic_data arithmetic_tags --answer-format tags
out=${OUT_DIR:-$repo/runs/recipes/r1_zero_countdown}
common=(data.max_response_length=64 trainer.project_name=r1_zero_cpu)
cpu_run r1_rewards 'reward.funcs=[rule,think_format]' 'reward.weights=[1.0,1.0]' "$@"
# lenient.py (weight 0: logged, not rewarded) reads the last integer anywhere, tags or not, to tell
# the format's share of a gain from the arithmetic's.
cpu_run soft_format "reward.funcs=[rule,think_format,think_tags,$here/lenient.py:last_integer]" \
    'reward.weights=[1.0,1.0,1.0,0.0]' "$@"
"$python" "$repo/tools/plot_metrics.py" "$out/r1_rewards/metrics.jsonl:R1-Zero rewards" \
    "$out/soft_format/metrics.jsonl:+ soft format" -o "$here/cpu_run.png" \
    --metrics 'val-core/arithmetic/reward/rule/*' 'val-core/arithmetic/reward/think_format/*' \
    'val-core/arithmetic/reward/think_tags/*' 'val-core/*/reward/last_integer/*' reward/think_tags/mean \
    actor/entropy response_length/mean
