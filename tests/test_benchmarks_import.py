"""Every benchmark script imports: what it takes from tetrad still exists.

The benchmarks run outside the suite (minutes each, on several processes), so a name
they import that a change of src/ removed or renamed would go unnoticed until someone
runs them (it happened twice). Importing them runs no benchmark: each runs under
`if __name__ == "__main__"` alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "harness.py")


def test_every_benchmark_runs_only_as_a_script():
    assert len(SCRIPTS) >= 10
    for path in SCRIPTS:
        assert 'if __name__ == "__main__":' in path.read_text(), path.name


@pytest.fixture
def benchmark_path(monkeypatch):
    """benchmarks/ first on the path, its modules (`harness`: the tests have one too)
    taken out of `sys.modules` afterwards and the tests' put back."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # their shared harness and each other
    monkeypatch.delitem(sys.modules, "harness", raising=False)  # restored afterwards
    yield
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").parent == BENCHMARKS:
            del sys.modules[name]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_imports(path, benchmark_path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
