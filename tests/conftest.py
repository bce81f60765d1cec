"""Shared fixtures: the single-process reference runs, computed once per session."""

from __future__ import annotations

import pytest
import torch

from tetrad.testing import run_layout, tiny_config

torch.set_num_threads(1)


def assert_close_run(got: dict, ref: dict, rtol: float = 1e-5) -> None:
    """Per-step losses, grad norms and final weights equal to the reference (relative rtol)."""
    torch.testing.assert_close(
        torch.tensor(got["losses"], dtype=torch.float64),
        torch.tensor(ref["losses"], dtype=torch.float64),
        rtol=rtol, atol=0,
    )  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(got["grad_norms"], dtype=torch.float64),
        torch.tensor(ref["grad_norms"], dtype=torch.float64),
        rtol=rtol, atol=0,
    )  # fmt: skip
    assert got["state"].keys() == ref["state"].keys()
    # Weights: norm-wise relative error per tensor. Adam turns round-off in near-zero
    # gradients into visible element-wise differences, so element-wise rtol is too strict.
    for name, value in ref["state"].items():
        err = float((got["state"][name].double() - value.double()).norm() / value.double().norm())
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


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
