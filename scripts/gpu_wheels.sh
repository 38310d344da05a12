#!/usr/bin/env bash
# Carry plait's Python dependencies to a GPU machine that reaches no package registry, then install them there.
#
#   bash scripts/gpu_wheels.sh download   # here, with pip and a registry: wheels into .whl/ (git-ignored)
#   bash scripts/gpu_wheels.sh install    # there, from the repository root: .whl/ and plait, no network
#
# The GPU machine keeps its own torch (a CUDA build); everything else plait needs at the versions the suite was
# proven with (constraints/tested.txt) comes as wheels for CPython 3.12 on x86-64 Linux: transformers, peft and
# regex (the versions there are older), torchao for --float8 and bench/gpu.py's float8 rows, and torchtitan with
# the packages its trainer imports (bench/titan.py) in .whl/titan/, installed into their own folder so that
# nothing of theirs shadows plait's.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { sed -n "s/^$1==//p" constraints/tested.txt; }

case "${1:-}" in
  download)
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
             manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
    fetch() {
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$@"
    }
    fetch .whl "transformers==$(pin transformers)" "peft==$(pin peft)" "regex==$(pin regex)" \
      "torchao==$(pin torchao)"
    # torchtitan 0.2.2: the last release that runs on the GPU machine's torch 2.11 (0.3.0 needs newer torch)
    fetch .whl/titan torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
      typing_extensions==4.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
    du -sh .whl
    ;;
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e adapters/llama -e adapters/gpt2 \
      -e adapters/mistral -e adapters/transformers
    if compgen -G ".whl/titan/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/titan .whl/titan/*.whl
    fi
    python3 -c "import torch, transformers, plait; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'device', torch.accelerator.current_accelerator())"
    ;;
  *)
    echo "usage: bash scripts/gpu_wheels.sh download|install" >&2
    exit 2
    ;;
esac
