#!/usr/bin/env bash
# The torch floor, run rather than asserted: install the lowest torch pyproject.toml declares
# ("torch>=X.Y" -> torch==X.Y.0) into a side venv and run, there, the equivalence tests of
# every axis (dp, fsdp/ZeRO, tp+sp, pp: every schedule, cp with either block kernel, recompute,
# bf16, moe and ep) and the API check of tests/test_torch_floor.py. With --write it also records, in
# tests/data/torch_floor_names.txt, the torch names tetrad uses, each resolved in the floor
# torch: the everyday suite then fails on a name used since, until this script runs again.
#
#   scripts/floor_check.sh [--write]     (FLOOR_VENV=/tmp/floor-venv by default)
#
# The package index's torch wheel is the CUDA build (about 3 GB with its libraries); it
# runs on CPU with gloo, which is all the tests need. Slow on a small machine: the install
# once, then about as long as those tests take with the development torch.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/.*"torch>=\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$floor" ] || { echo "no torch>=X.Y in pyproject.toml" >&2; exit 2; }
want="$floor.0"
venv=${FLOOR_VENV:-/tmp/floor-venv}
py=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
have=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  echo "installing torch==$want into $venv"
  "$venv/bin/pip" install -q "torch==$want"
fi
# tetrad's other dependencies and the test runner; tetrad itself from this checkout
"$venv/bin/pip" install -q "safetensors>=0.4" "rich>=13" "numpy>=1.24" "pytest>=8" "pytest-timeout>=2.2" \
  "tensorboard>=2.14"  # --tensorboard's SummaryWriter, a name tetrad uses
export PYTHONPATH="$PWD/src:$PWD/tests"
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__, "from", torch.__file__)'
if [ "${1:-}" = "--write" ]; then
  "$venv/bin/python" tests/test_torch_floor.py --write
fi
tests=(
  tests/test_torch_floor.py
  tests/test_dp.py tests/test_fsdp.py tests/test_tp.py tests/test_cp.py tests/test_cp_fused.py
  tests/test_pp.py tests/test_pp_zero_bubble.py
  tests/test_memory_recompute.py tests/test_memory_bf16.py
  tests/test_moe.py tests/test_moe_layouts.py tests/test_moe_ep_equivalence.py
  tests/test_moe_sp.py tests/test_moe_zb.py tests/test_moe_expert_zero.py tests/test_engine_norm.py
)
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"
