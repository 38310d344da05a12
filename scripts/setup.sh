#!/usr/bin/env bash
# Install plait, its adapters (three explicit, one generic) and the loss plot's matplotlib into the active Python
# environment, at the versions the suite was proven with (constraints/tested.txt). PLAIT_EXTRAS names the extras
# (default: plot, what the main job uses; scripts/test.sh asks for test,plot: pytest, datasets, the trackers,
# torchao ..., which the main job never imports). PLAIT_DEPS=oldest installs the oldest versions
# pyproject.toml allows (constraints/oldest.txt), PLAIT_DEPS=latest the newest releases (README, "Dependencies").
# Without a GPU, the CPU build of torch is installed first, so that no multi-GB CUDA build is pulled in; a torch
# already installed (a CUDA build, another version) is kept, and PLAIT_DEPS=latest never moves it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEPS=${PLAIT_DEPS:-tested}
EXTRAS=${PLAIT_EXTRAS:-plot}
pinned_torch=$(sed -n 's/^torch==//p' constraints/tested.txt)
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==$pinned_torch"  # without a GPU this machine's CPU build
fi
installed_torch=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null)
constraints="${TMPDIR:-/tmp}/plait-constraints-$$.txt"
trap 'rm -f "$constraints"' EXIT
upgrade=()
if [ "$DEPS" = latest ]; then
  echo "torch==$installed_torch" > "$constraints"
  upgrade=(--upgrade --upgrade-strategy eager)
else
  grep -v '^torch==' "constraints/$DEPS.txt" > "$constraints"
  if [ "$installed_torch" != "$pinned_torch" ]; then
    echo "setup: keeping the installed torch $installed_torch (the suite was proven with $pinned_torch)" >&2
  fi
fi
"$PY" -m pip install -q "${upgrade[@]}" -c "$constraints" -e ".[$EXTRAS]" -e adapters/llama -e adapters/gpt2 \
  -e adapters/mistral -e adapters/transformers
