#!/usr/bin/env bash
# The whole test suite (README's second command; .ci/run runs it): every test on this
# CPU's kernels, then the tests whose bounds rest on rounding (fp32 and bf16 runs, marked
# `rounding`) again on SSE4.2 kernels, so a bound that holds on one CPU's rounding only
# fails here, wherever "here" is (docs/architecture.md, "Bounds").
#
# The modules that launch whole jobs (torchrun agents, `tetrad` commands, killed nodes)
# spend most of their time waiting: for a rendezvous to close, a watchdog to fire, a
# restarted rank to come up. They run in a second pytest beside the rest, whose
# in-process worlds keep the cores busy meanwhile; each half must collect tests and pass.
# With arguments, one pytest runs them (`scripts/test.sh tests/test_dp.py -x`). pytest's
# exit code 5 (nothing collected) fails like any other.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest -q)
LAUNCHING=(
  tests/test_elastic.py tests/test_launch_survival.py tests/test_launch_agent.py
  tests/test_cli.py tests/test_cli_first_run.py tests/test_comm_bench.py
  tests/test_memory_flags.py tests/test_gpu_check.py tests/test_plan_from_run.py
)
if [ $# -gt 0 ]; then
  "${PYTEST[@]}" "$@"
else
  log=$(mktemp)
  "${PYTEST[@]}" -p no:cacheprovider "${LAUNCHING[@]}" > "$log" 2>&1 &
  beside=$!
  rest=0
  "${PYTEST[@]}" "${LAUNCHING[@]/#/--ignore=}" || rest=$?
  launching=0
  wait "$beside" || launching=$?
  echo "--- the modules that launch jobs (run beside the rest): exit $launching"
  cat "$log"
  rm -f "$log"
  if [ "$rest" -ne 0 ] || [ "$launching" -ne 0 ]; then
    exit 1
  fi
fi
echo "--- the rounding-bound tests again, on SSE4.2 kernels"
MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 \
  "${PYTEST[@]}" -m rounding
