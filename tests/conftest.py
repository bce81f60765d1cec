"""Shared fixtures: the single-process reference runs, computed once per session.

Helpers tests import (runs, comparisons, the test model) are in harness.py."""

from __future__ import annotations

import pytest
import torch

from harness import run_layout, tiny_config

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def reference():
    """reference(**overrides) -> the single-process run of tiny_config(**overrides), cached."""
    cache: dict[str, dict] = {}

    def get(**overrides):
        key = repr(sorted((k, sorted(v.items())) for k, v in overrides.items()))
        if key not in cache:
            cfg = tiny_config(**overrides)
            cfg.parallel = type(cfg.parallel)(microbatches=cfg.parallel.microbatches)
            cache[key] = run_layout(cfg)
        return cache[key]

    return get


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: skipped, saying so, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
