#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite.
#   bash scripts/test.sh [pytest args]           the versions the suite was proven with (constraints/tested.txt),
#                                                installed into the active Python environment
#   bash scripts/test.sh --latest [pytest args]  the newest releases, in a fresh virtual environment .venv-latest
#   bash scripts/test.sh --oldest [pytest args]  the oldest versions pyproject.toml allows, in .venv-oldest
#   bash scripts/test.sh --torch VERSION [pytest args]  torch VERSION from the registry (the current releases are CUDA
#                                                builds, which run on a CPU) with every other package at the pins,
#                                                in .venv-torchVERSION; constraints/tested-torchVERSION.txt records
#                                                a set the whole suite passed with
# The --latest / --oldest runs write what they installed to .venv-*/tested.txt (setuptools included, which torch and
# tensorboard require and a plain pip freeze leaves out): after a green --latest run, copying it over
# constraints/tested.txt moves the pins forward (README, "Dependencies").
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --torch)
    version=$2
    shift 2
    venv=.venv-torch$version
    "${PYTHON:-python3}" -m venv --clear "$venv"
    "$venv/bin/python" -m pip install -q "torch==$version"
    PYTHON=$venv/bin/python PLAIT_EXTRAS=test,plot bash scripts/setup.sh  # keeps that torch, the rest at the pins
    "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v '^pip==' > "$venv/tested.txt"
    echo "testing with torch $version and the pins (all: $venv/tested.txt)"
    export VIRTUAL_ENV=$PWD/$venv PATH=$PWD/$venv/bin:$PATH
    export PLAIT_DEPS=torch$version  # tests/test_dependencies.py: torch differs from the pins on purpose
    exec "$venv/bin/python" -m pytest -q "$@"
    ;;
  --latest|--oldest)
    deps=${1#--}
    shift
    venv=.venv-$deps
    "${PYTHON:-python3}" -m venv --clear "$venv"
    PYTHON=$venv/bin/python PLAIT_DEPS=$deps PLAIT_EXTRAS=test,plot bash scripts/setup.sh
    "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v '^pip==' |
      sed -E 's/^(torch==[^+]*)\+.*/\1/' > "$venv/tested.txt"
    echo "testing with: $(grep -iE '^(torch|transformers|peft|accelerate|tokenizers|datasets|safetensors|pluggy)==' \
      "$venv/tested.txt" | paste -sd' ') (all: $venv/tested.txt)"
    export VIRTUAL_ENV=$PWD/$venv PATH=$PWD/$venv/bin:$PATH  # what the tests start by name (torchrun, python3)
    export PLAIT_DEPS=$deps  # tests/test_dependencies.py: these versions differ from the pins on purpose
    exec "$venv/bin/python" -m pytest -q "$@"
    ;;
esac
PLAIT_EXTRAS=test,plot bash scripts/setup.sh  # the main job's set-up and the test tools
exec "${PYTHON:-python3}" -m pytest -q "$@"
