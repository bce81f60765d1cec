#!/usr/bin/env bash
# The whole test suite (README's second command; .ci/run runs it): every test on this
# CPU's kernels, then the tests whose bounds rest on rounding (fp32 and bf16 runs, marked
# `rounding`) again on SSE4.2 kernels, so a bound that holds on one CPU's rounding only
# fails here, wherever "here" is (docs/architecture.md, "Bounds"). Extra arguments go to
# the first run. pytest's exit code 5 (nothing collected) fails like any other.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q "$@"
echo "--- the rounding-bound tests again, on SSE4.2 kernels"
MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 \
  .venv/bin/python -m pytest -q -m rounding
