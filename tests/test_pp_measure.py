"""Measured pipeline timelines: a real run's bubble against its schedule's (computes
padded to fixed times, so that the machine's load does not decide it), the pictures and
traces `tetrad train --timeline` writes, the activation meter, and the runtime's early
freeing of sent outputs (pure: no processes)."""

from __future__ import annotations

import gc
import json
import statistics
import time

import pytest
import torch
from torch import nn

from harness import tiny_config, trainer_for
from tetrad.parallel.activation_meter import ActivationMeter
from tetrad.parallel.pipeline.measure import estimate_costs
from tetrad.parallel.pipeline.schedules import build_schedule
from tetrad.parallel.pipeline.simulate import Costs, simulate
from tetrad.parallel.pipeline.timeline import Event, Timeline
from tetrad.testing import spawn

# The bubble test holds the runtime to its schedule on a machine of any load. Each compute
# runs, then sleeps until it has taken a fixed time (F, B and W 25 ms, a 1F1B BW 50 ms:
# the tiny model's own compute is a few ms on an idle machine), and a sleeping rank asks
# nothing of a busy CPU. Where other jobs take the cores, a compute can outlast its pad
# (six busy loops beside the test on 2 cores: 1F1B's measured bubble 0.05 above the
# schedule's at the pads): the schedule's bubble is therefore taken at the step's own
# measured compute durations, transfers free (`_schedule_bubble_at`): what the runtime
# adds beyond it is its own waiting, which is what the test bounds. That includes a
# woken rank's wait for a core: a few ms a transfer while the suite's other worlds run
# (ZB-H1 0.058 above in a clean-clone CI run at load 9, 0.021-0.025 idle).
PAD = {"F": 0.025, "B": 0.025, "W": 0.025, "BW": 0.05}
BUBBLE_TOL = 0.10  # the median step's measured bubble above the schedule's, at most
# a runtime that posts every batch with a send 20 ms late (the negative control): its
# measured bubble must exceed the schedule's by more than the tolerance
LATE_POST = 0.020
STEPS = 5  # the first warms up; the other 4 are compared


def _padded(runtime, late: float = 0.0) -> None:
    """Pad each of `runtime`'s computes to its PAD time; with `late`, delay every post
    that sends (the bug the negative control stands for)."""
    compute, post = runtime._compute, runtime._post

    def padded(st, a):
        t0 = time.perf_counter()
        compute(st, a)
        time.sleep(max(0.0, PAD[a.kind] - (time.perf_counter() - t0)))

    def late_post(st, ops):
        if any(a.kind.startswith("SEND") for a in ops):
            time.sleep(late)
        post(st, ops)

    runtime._compute = padded
    if late:
        runtime._post = late_post


def _timeline_worker(rank: int, world: int, out_dir: str) -> dict:
    from tetrad.config import from_dict
    from tetrad.parallel.pipeline.measure import measure_step
    from tetrad.train.run import write_step_timeline

    result = {}
    for schedule, late in (("1f1b", 0.0), ("zb-h1", 0.0), ("1f1b", LATE_POST)):
        trainer = trainer_for(from_dict(_config(schedule).to_dict()), rank)
        _padded(trainer.engine.runner, late)
        bubbles = []
        for _ in range(STEPS):
            trainer.train_step()
            events = trainer.engine.last_run.events
            measured, _ = measure_step(events, trainer.comm, trainer.mesh["pp"], schedule, 4)
            bubbles.append((measured.bubble_fraction, _schedule_bubble_at(measured)))
        if not late:
            write_step_timeline(trainer, f"{out_dir}/{schedule}")  # what --timeline DIR runs
        result[(schedule, late)] = bubbles[1:]
    return result


def _schedule_bubble_at(measured: Timeline) -> float:
    """The schedule's bubble with every compute at its measured duration (its pad, or
    longer where the machine's other jobs delayed it), transfers free."""
    each = {(e.kind, e.stage, e.microbatch): e.duration for ev in measured.ranks for e in ev}
    actions = build_schedule(measured.schedule, 2, 4)
    return simulate(actions, Costs(each=each)).bubble_fraction


def _config(schedule: str):
    return tiny_config(
        parallel={"pp": 2, "pp_schedule": schedule, "microbatches": 4},
        train={"steps": STEPS},
    )


@pytest.mark.distributed
def test_measured_bubble_is_the_schedules_and_pictures_are_written(tmp_path):
    """The runtime idles where its schedule does and nowhere else, on a busy machine too;
    a runtime that posts its sends late is caught by the same comparison."""
    result = spawn(_timeline_worker, 2, str(tmp_path), timeout=300)[0]
    for schedule in ("1f1b", "zb-h1"):
        out = tmp_path / schedule
        assert (out / "timeline.png").stat().st_size > 10_000
        for name in ("timeline.json", "timeline_sim.json"):
            trace = json.loads((out / name).read_text())
            assert trace["otherData"]["schedule"] == schedule
            computes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
            assert len(computes) == (2 if schedule == "1f1b" else 3) * 4 * 2  # kinds x m x pp
        excess = statistics.median(got - want for got, want in result[(schedule, 0.0)])
        assert -0.01 <= excess <= BUBBLE_TOL, (schedule, result[(schedule, 0.0)])
    late = statistics.median(got - want for got, want in result[("1f1b", LATE_POST)])
    assert late > BUBBLE_TOL, result


def test_train_accepts_a_timeline_directory():
    from tetrad.cli import parser

    assert parser().parse_args(["train", "--pp", "2", "--timeline", "tl"]).timeline == "tl"


def test_costs_read_off_a_timeline():
    # rank 1 waits for rank 0's F (0.5 s transfer) and rank 0 for rank 1's B (0.25 s)
    tl = Timeline(
        [
            [Event("F", 0, 0, 0.0, 1.0), Event("B", 0, 0, 5.25, 6.25), Event("W", 0, 0, 6.25, 8)],
            [Event("F", 1, 0, 1.5, 3.5), Event("B", 1, 0, 3.5, 5.0), Event("W", 1, 0, 5, 5.5)],
        ]
    )
    c = estimate_costs(tl, 2)
    assert (c.f, c.b, c.w) == ([1.0, 2.0], [1.0, 1.5], [1.75, 0.5])
    assert c.comm == pytest.approx(0.375)  # median of the two waits


def test_activation_meter_counts_saved_storages_once_and_releases_them():
    lin = nn.Linear(16, 16, bias=False)
    meter = ActivationMeter()
    meter.reset(lin.parameters())
    x = torch.randn(4, 16, requires_grad=True)
    with meter.saving():
        h = lin(x)  # saves x (the weight is a parameter: not counted)
        y = (h * h).sum()  # saves h (once, though used twice)
    assert meter.live == x.nbytes + h.nbytes == meter.peak
    y.backward()
    assert meter.live == 0 and meter.peak == x.nbytes + h.nbytes
    meter.hold("k", [x, x[1:]])  # a view of the same storage counts once
    assert meter.live == x.nbytes
    meter.drop("k")
    assert meter.live == 0


def test_activation_meter_keeps_no_graph_alive():
    # exp saves its own output: holding that output as is would tie the graph in a
    # cycle the collector cannot see, and a dropped graph would never be freed
    meter = ActivationMeter()
    x = torch.randn(100, requires_grad=True)
    with meter.saving():
        y = torch.exp(x)
    assert meter.live == y.nbytes
    del y
    gc.collect()
    assert meter.live == 0


def test_alone_sees_every_other_reference_to_a_buffer():
    from tetrad.parallel.activation_meter import alone, held_as_is

    buf = torch.empty(4, 8)
    assert alone(buf) and not held_as_is(buf)
    view = buf[1:]
    assert not alone(buf)
    del view
    w = torch.ones(8, requires_grad=True)
    y = (buf.detach() * w).sum()  # autograd keeps a detached alias for w's gradient
    assert not alone(buf)
    y.backward()
    assert alone(buf)
    x = buf.requires_grad_(True)
    z = (x * w).sum()  # saved as is: the storage has no other tensor, the tensor a holder
    assert alone(buf) and held_as_is(buf)
    del z


def test_meter_counts_again_when_asked():
    meter = ActivationMeter()
    assert [meter.measure(0) for _ in range(3)] == [True, False, False]
    meter.recount()
    assert [meter.measure(0) for _ in range(2)] == [True, False]
