"""Every benchmark script imports: what it takes from tetrad still exists.

The benchmarks run outside the suite (minutes each, on several processes), so a name
they import that a change of src/ removed or renamed would go unnoticed until someone
runs them (it happened twice). Importing them runs no benchmark: each runs under
`if __name__ == "__main__"` alone. They import in a process of their own: their
`harness` is not the tests' (whose worlds other tests may be starting meanwhile)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "harness.py")

IMPORT_EACH = """
import importlib, json, sys, traceback
sys.path.insert(0, sys.argv[1])
failed = {}
for name in sys.argv[2:]:
    try:
        module = importlib.import_module(name)
        if not callable(getattr(module, "main", None)):
            failed[name] = "no main()"
    except Exception:
        failed[name] = traceback.format_exc(limit=-1)
print(json.dumps(failed))
"""


def test_every_benchmark_imports_and_runs_only_as_a_script():
    assert len(SCRIPTS) >= 10
    for path in SCRIPTS:
        assert 'if __name__ == "__main__":' in path.read_text(), path.name
    names = [p.stem for p in SCRIPTS]
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, str(BENCHMARKS), *names],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    failed = json.loads(done.stdout.splitlines()[-1])
    assert not failed, "\n".join(f"benchmarks/{n}.py: {why}" for n, why in failed.items())
