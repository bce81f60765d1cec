"""The pipeline's learned decisions stay safe when a step's graph is not the counted one.

The runtime counts saved tensors on the first step only and, on the steps after it, frees
sent outputs and pools receive buffers by what that step saw. These runs break the
assumption that every step builds the first step's graph, through every schedule, and
must still reproduce the single process: a microbatch made entirely of padding, and a
model whose blocks, from the second step on, keep a term of each microbatch's input for
the next microbatch's backward (autograd then still reads a received buffer after the
backward that consumed it, which pooling it would overwrite).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from harness import Jobs, assert_close_run, run_layout, tiny_config, train_worker
from tetrad.layout import SCHEDULES
from tetrad.models.batch import IGNORE, Microbatch
from tetrad.models.llama import Block
from tetrad.train.data import Loader

pytestmark = pytest.mark.distributed

MODEL = {"layers": 4}
M = 4  # microbatches
TRAIN = {"global_batch": 8}
SCENARIOS = ("padding", "carry")


def _config(schedule: str, pp: int = 2):
    v = 2 if schedule in ("interleaved-1f1b", "zb-v") else 1
    par = {"pp": pp, "pp_schedule": schedule, "microbatches": M, "virtual_stages": v}
    if pp == 1:
        par = {"microbatches": M}
    return tiny_config(model=MODEL, train=TRAIN, parallel=par)


@contextlib.contextmanager
def _padding() -> Iterator[None]:
    """From the second step on, microbatch 1's targets are all padding (its loss chunk
    ignored; the other microbatches keep the step's token count above zero)."""
    original = Loader.next

    def padded(self) -> list[Microbatch]:
        micro = original(self)
        if self.step > 1:
            micro[1] = Microbatch(micro[1].inputs, torch.full_like(micro[1].targets, IGNORE))
        return micro

    Loader.next = padded
    try:
        yield
    finally:
        Loader.next = original


@contextlib.contextmanager
def _carry() -> Iterator[None]:
    """From the second step on, every block adds to its output a scalar made from the
    previous microbatch's block input (detached) and its norm's gain: the next
    microbatch's backward reads that input's storage (on a stage's first block, a receive
    buffer), a graph the first step never built. Layout-invariant: each block sees the
    microbatches of a step in order, once each."""
    original = Block.body

    def body(self: Block, x: torch.Tensor) -> torch.Tensor:
        out = original(self, x)
        calls = getattr(self, "_calls", 0)
        self._calls = calls + 1
        step, mb = divmod(calls, M)
        if step == 0:
            return out
        if mb > 0:
            out = out + self._carried
        self._carried = (x.detach() * self.ffn_norm.weight).square().mean()
        return out

    Block.body = body
    try:
        yield
    finally:
        Block.body = original


PATCHES = {"padding": _padding, "carry": _carry}


def _run(rank: int, world: int, raw: dict, scenario: str) -> dict:
    with PATCHES[scenario]():
        return train_worker(rank, world, raw)


def declare_jobs(jobs: Jobs) -> None:
    """Every schedule under each scenario, on 2 ranks."""
    for scenario in SCENARIOS:
        for schedule in SCHEDULES:
            jobs.add(f"{scenario}-{schedule}", 2, _run, _config(schedule).to_dict(), scenario)


@pytest.fixture(scope="module")
def single():
    """The single process under each scenario (in this process, patched while it runs)."""
    out = {}
    for scenario in SCENARIOS:
        with PATCHES[scenario]():
            out[scenario] = run_layout(_config("1f1b", pp=1))
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_changed_graph_still_reproduces_the_single_process(jobs, single, scenario, schedule):
    got = jobs[f"{scenario}-{schedule}"][0]
    assert_close_run(got, single[scenario])
