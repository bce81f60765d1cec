"""Shared fixtures: the single-process reference runs, computed once per session, and the
test modules' multi-process jobs, run in one spawn per world size.

Helpers tests import (runs, comparisons, the test model) are in harness.py."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, run_layout, tiny_config

torch.set_num_threads(1)

# A test that reads `jobs` may be the one that runs a whole world size's jobs for the
# session: its timeout (set below) is that spawn's.
JOBS_TIMEOUT = 1200.0


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


@pytest.fixture(scope="session", autouse=True)
def all_jobs(request, tmp_path_factory) -> Jobs:
    """The multi-process jobs of every test module with a selected test that reads `jobs`,
    each module's declared by its `declare_jobs(jobs)`. Those of one world size run in one
    spawn: starting ranks is most of a small job's time (about 2 s of CPU each), so the
    suite starts each world size once, not per test. The worlds start with the session,
    in the background, while the tests that need none run (they come first, see below)."""
    jobs = Jobs(timeout=JOBS_TIMEOUT, mktemp=tmp_path_factory.mktemp)
    for module in dict.fromkeys(_reads_jobs(request.session.items)):
        declare = getattr(module, "declare_jobs", None)
        if declare is not None:
            declare(jobs.scoped(module.__name__))
    jobs.start()
    return jobs


def _reads_jobs(items) -> list:
    """The modules of the tests among `items` that read the `jobs` fixture, in order."""
    return [item.module for item in items if "jobs" in getattr(item, "fixturenames", ())]


@pytest.fixture(scope="module")
def jobs(all_jobs, request) -> Jobs:
    """This module's jobs (its `declare_jobs`): jobs[name] is job `name`'s results, by rank."""
    return all_jobs.scoped(request.module.__name__)


def pytest_collection_modifyitems(config, items):
    """Tests that read `jobs` run last (in their order; the others of their modules, such
    as a launch through torchrun, run first), so the worlds' ranks run beside the rest of
    the suite. A module-scoped fixture used on both sides is made twice: one that costs a
    launch is session-scoped instead. Tests that read `jobs` get the jobs' timeout. Tests
    marked `cuda` need a GPU: skipped, saying so, where there is none."""
    items.sort(key=lambda item: "jobs" in getattr(item, "fixturenames", ()))  # stable
    for item in items:
        if "jobs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(JOBS_TIMEOUT))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
