#!/usr/bin/env bash
# Install plait, its adapters (three explicit, one generic) and the test tools into the active Python environment.
# Without a GPU, the CPU build of torch is installed first, so that no multi-GB CUDA build is pulled in.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
"$PY" -m pip install -q -e ".[test,plot]" -e adapters/llama -e adapters/gpt2 -e adapters/mistral -e adapters/transformers
