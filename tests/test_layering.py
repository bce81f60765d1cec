"""The package's layering and the engine's shape are enforced, not just described."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tetrad.config import from_dict
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.parallel import parallelize
from tetrad.parallel.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    """pyproject.toml's import-linter contracts: layers one way, no cycles, pure parts."""
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_engine_cannot_be_patched_from_outside():
    cfg = from_dict({"model": {"layers": 2, "dim": 32, "heads": 4, "kv_heads": 2, "vocab": 64},
                     "data": {"source": "synthetic"}})  # fmt: skip
    engine = parallelize(
        Layout.build(cfg), cfg.model, cfg.train, Mesh.plan(cfg.parallel.degrees, 0), None, "cpu"
    )
    assert isinstance(engine, Engine)
    with pytest.raises(AttributeError):
        engine.after_step = lambda: None  # what a measurement used to do
    with pytest.raises(AttributeError):
        engine.pipeline = object()  # what attaching a pipeline used to do
