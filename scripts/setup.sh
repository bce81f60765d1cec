#!/usr/bin/env bash
# Create or reuse .venv and install tetrad with what it needs. Idempotent and quick when done.
# torch is pinned to the CPU build for this machine and CI; on a GPU machine install your own
# CUDA build of torch (any >= 2.6) into the venv first and this script leaves it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip would byte-compile every file of every package, most of which nothing imports (half
# of a fresh set-up's time); compile instead what tetrad runs, by importing it, below
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --no-compile "torch==2.13.0"
fi
stamp=.venv/.tetrad-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --no-compile -e ".[dev]"
  MPLBACKEND=Agg .venv/bin/python scripts/compile_imports.py
  touch "$stamp"
fi
