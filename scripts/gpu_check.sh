#!/usr/bin/env bash
# tetrad's GPU path in one run (under 18 minutes on one GPU): the CUDA-marked tests, a bf16
# 125M Llama (tokens/s, MFU, peak memory against the planner), the same run with --compile
# (MFU, speed over eager, compile seconds, recompilations) and with --fp8 tensorwise (MFU,
# speed over bf16), an MoE layer's grouped matmul against the loop over experts (max
# differences, times), and with 2+ GPUs every
# layout against the single GPU plus `tetrad bench comm`. One JSON summary: --out PATH.
#   scripts/gpu_check.sh [--out gpu_check.json] [--gpus N] [--steps 50] [--skip-tests]
# Uses .venv if there is one (scripts/setup.sh makes it; install a CUDA torch into it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed collective ends the job, not hangs it
exec "$PY" scripts/gpu_check.py "$@"
