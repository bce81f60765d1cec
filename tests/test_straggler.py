"""Stragglers named: the scoring (windows, medians over a stage's ranks, the threshold, the
reset) as pure functions; the compute-time meters (CPU time leaves out sleeping and
waiting, the device-style span subtracts the collective waits `Comm` logs); and, on two
ranks, a rank slowed on purpose is named at the earliest window it can be, once, and
forgotten when it recovers, while an even run names nobody."""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch

from harness import Jobs, tiny_config, trainer_for
from tetrad.cli import build_config, parser
from tetrad.comm import Comm, WaitLog
from tetrad.config import check_sections, from_dict
from tetrad.mesh import Mesh
from tetrad.train.straggler import (
    ComputeMeter,
    Detector,
    Straggler,
    StragglerWatch,
    peer_groups,
    scores,
    warning,
)

EVERY, WINDOWS, STEPS = 2, 3, 10
SLOW_UNTIL = 8  # the slowed rank is slow in steps 0..7 (windows 1 to 4), then recovers
BURN_S = 0.06  # CPU seconds burnt in each slowed forward: several times a tiny step's
DEGREES = {"pp": 1, "dp": 2, "fsdp": 1, "cp": 1, "tp": 1}


def _burn(cpu_seconds: float) -> None:
    """Spin until this thread has used `cpu_seconds` of CPU (sleeping would not count:
    the meter measures CPU time, and a busy neighbour cannot shorten a burn)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def _config(steps: int = STEPS):
    train = {"steps": steps, "straggler_every": EVERY, "straggler_windows": WINDOWS}
    return tiny_config(parallel={"dp": 2}, train=train)


def _train_worker(rank: int, world: int, cfg_dict: dict, slow_rank: int | None) -> dict:
    """Train; `slow_rank` burns BURN_S of CPU in every forward before step SLOW_UNTIL.
    Rank 0's printed lines, every row's straggler fields and every window's scores."""
    trainer = trainer_for(from_dict(cfg_dict), rank)
    if rank == slow_rank:

        def slow(*_):
            if trainer.step < SLOW_UNTIL:
                _burn(BURN_S)

        trainer.engine.model.register_forward_pre_hook(slow)
    window_scores = []
    observe = trainer.straggler.detector.observe

    def record(seconds):
        out = observe(seconds)
        window_scores.append(trainer.straggler.detector.last)
        return out

    trainer.straggler.detector.observe = record
    printed, gathered = io.StringIO(), []
    with contextlib.redirect_stdout(printed):
        rows = trainer.fit(stop=STEPS - 1)  # the last step alone: a window's end
        gathered.append(trainer.comm.summary()["world/all_reduce"]["bytes"])
        rows += trainer.fit()
        gathered.append(trainer.comm.summary()["world/all_reduce"]["bytes"])
    named = {
        r["step"]: (r["straggler_rank"], r["straggler_score"])
        for r in rows
        if "straggler_rank" in r
    }
    out = {"printed": printed.getvalue(), "named": named, "scores": window_scores}
    return out | {"gathered": gathered, "steps": [r["step"] for r in rows]}


def _span_worker(rank: int, world: int) -> dict:
    """The span meter (CUDA's way, here on the host's clock) around a collective that rank
    1 reaches 0.3 s late, after sleeping: rank 0's wait is subtracted, rank 1's sleep,
    outside any collective, is counted; the CPU-time meter counts neither."""
    mesh = Mesh.build(DEGREES, rank)
    comm = Comm("cpu")
    span, cpu = ComputeMeter(comm, span=True), ComputeMeter(comm, span=False)
    comm.barrier(mesh["world"])
    t0 = time.time()
    span.start()
    cpu.start()
    if rank == 1:
        time.sleep(0.3)
    comm.all_reduce(torch.zeros(4), mesh["world"])
    span.stop()
    cpu.stop()
    return {"wall": time.time() - t0, "span": span.take(), "cpu": cpu.take()}


def declare_jobs(jobs: Jobs) -> None:
    """Two ranks: a run with rank 1 slowed, an even run, and the span meter's check."""
    cfg = _config().to_dict()
    jobs.add("slowed", 2, _train_worker, cfg, 1)
    jobs.add("even", 2, _train_worker, cfg, None)
    jobs.add("span", 2, _span_worker)


# --- the scoring, pure ----------------------------------------------------------------------


def test_peers_are_the_ranks_of_one_pipeline_stage():
    degrees = {"pp": 2, "dp": 2, "fsdp": 1, "cp": 1, "tp": 2}
    assert peer_groups(degrees) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert peer_groups(DEGREES) == [[0, 1]]


def test_score_is_time_over_the_median_of_the_peers():
    got = scores([1.0, 1.0, 3.0, 1.2, 2.0], [[0, 1, 2, 3, 4]])
    assert got == pytest.approx([1 / 1.2, 1 / 1.2, 3 / 1.2, 1.0, 2 / 1.2])
    # two stages, the second twice as slow throughout: each is compared with itself only
    assert scores([1.0, 1.0, 2.0, 2.0], [[0, 1], [2, 3]]) == [1.0] * 4
    # a rank alone in its stage, or nothing measured: nothing to compare, score 1
    assert scores([1.0, 5.0, 0.0, 0.0], [[0], [1], [2, 3]]) == [1.0] * 4


def test_a_rank_is_named_after_enough_slow_windows_in_a_row_and_once():
    d = Detector([[0, 1, 2]], threshold=1.2, windows=3)
    slow = [1.0, 1.0, 1.5]  # rank 2: 1.5x the median
    assert d.observe(slow) == ([], [])
    assert d.observe(slow) == ([], [])
    new, now = d.observe(slow)
    assert new == now == [Straggler(2, pytest.approx(1.5))]
    new, now = d.observe([1.0, 1.0, 2.0])  # still slow: still named, not announced again
    assert new == [] and now == [Straggler(2, pytest.approx((1.5 + 1.5 + 2.0) / 3))]


def test_a_window_at_or_under_the_threshold_resets_the_rank():
    d = Detector([[0, 1, 2]], threshold=1.2, windows=2)
    d.observe([1.0, 1.0, 1.5])
    assert d.observe([1.0, 1.0, 1.2]) == ([], [])  # exactly 1.2x: not slow; the run ends
    assert d.observe([1.0, 1.0, 1.5]) == ([], [])  # a new run starts from one window
    assert d.observe([1.0, 1.0, 1.5])[0] == [Straggler(2, pytest.approx(1.5))]
    d.observe([1.0, 1.0, 1.0])  # recovered after being named: forgotten
    assert d.observe([1.0, 1.0, 1.5]) == ([], [])
    new, _ = d.observe([1.0, 1.0, 1.5])  # slow again: named (announced) again
    assert [s.rank for s in new] == [2]


def test_several_stragglers_each_named_and_the_row_names_the_slowest():
    d = Detector([[0, 1, 2, 3, 4]], threshold=1.2, windows=1)
    new, now = d.observe([1.0, 1.0, 1.0, 1.5, 2.0])
    assert [s.rank for s in new] == [3, 4]
    mesh = Mesh.plan({**DEGREES, "dp": 5}, 1)
    watch = StragglerWatch(from_dict({"train": {"straggler_windows": 1}}).train, mesh, Comm())
    assert watch.observe([1.0, 1.0, 1.0, 1.5, 2.0]) == {"straggler_rank": 4, "straggler_score": 2.0}
    assert watch.observe([]) == {}


def test_the_warning_line():
    line = warning(Straggler(3, 1.4321), windows=3, every=20)
    assert line == (
        "tetrad: warning: rank 3 is a straggler: 1.43x the median compute time over the "
        "last 3 windows of 20 steps"
    )


def test_the_window_is_gathered_only_at_its_end_and_only_with_peers():
    t = from_dict({"train": {"straggler_every": 4}}).train
    watch = StragglerWatch(t, Mesh.plan({**DEGREES, "dp": 3}, 1), Comm())
    watch.start()
    _burn(0.01)
    watch.stop()
    assert watch.slots(3) == []  # not a window's end: nothing gathered
    zero, mine, two = watch.slots(4)
    assert zero == two == 0.0 and 0.005 < mine < 1.0
    alone = StragglerWatch(t, Mesh.plan(DEGREES | {"dp": 1}, 0), Comm())
    assert alone.meter is None and alone.slots(4) == []  # one rank: nobody to compare
    off = StragglerWatch(
        from_dict({"train": {"straggler_every": 0}}).train, Mesh.plan(DEGREES, 0), Comm()
    )
    assert off.meter is None and off.slots(20) == []


def test_cpu_time_leaves_out_sleeping():
    meter = ComputeMeter(Comm("cpu"))
    assert not meter.span  # CPU: the training thread's CPU time
    meter.start()
    time.sleep(0.2)
    _burn(0.05)
    meter.stop()
    assert 0.04 < meter.take() < 0.15
    assert meter.take() == 0.0  # taken: the next window starts from zero


@pytest.mark.parametrize(
    "train",
    [{"straggler_every": -1}, {"straggler_threshold": 1.0}, {"straggler_windows": 0}],
    ids=lambda v: next(iter(v)),
)
def test_bad_settings_are_refused_naming_the_value(train):
    ((key, value),) = train.items()
    with pytest.raises(ValueError, match=f"train.{key}={value}"):
        check_sections(tiny_config(train=train))


def test_the_flags_set_the_config():
    argv = ["train", "--straggler-every", "5", "--straggler-threshold", "1.5"]
    cfg = build_config(parser().parse_args([*argv, "--straggler-windows", "4"]))
    t = cfg.train
    assert (t.straggler_every, t.straggler_threshold, t.straggler_windows) == (5, 1.5, 4)


# --- two ranks --------------------------------------------------------------------------------


@pytest.mark.distributed
def test_the_span_meter_subtracts_collective_waits(jobs):
    zero, one = jobs["span"]
    assert zero["wall"] > 0.25 and zero["span"] < 0.1  # waited for rank 1: not compute
    assert one["span"] > 0.25  # slept outside any collective: on its own timeline
    assert zero["cpu"] < 0.1 and one["cpu"] < 0.1  # asleep or waiting: no CPU time


@pytest.mark.distributed
def test_a_slowed_rank_is_named_at_the_earliest_window_once_and_forgotten(jobs):
    zero, one = jobs["slowed"]
    assert zero["named"] == one["named"]  # every rank scores alike
    # windows end after steps 2, 4, ... (rows 1, 3, ...); rank 1 is slow in the first
    # four: named at the third (the earliest it can be), still at the fourth, then not
    assert sorted(zero["named"]) == [EVERY * WINDOWS - 1, EVERY * (WINDOWS + 1) - 1]
    for rank, score in zero["named"].values():
        assert rank == 1 and score > 1.3
    lines = [ln for ln in zero["printed"].splitlines() if "straggler" in ln]
    assert len(lines) == 1, zero["printed"]
    assert lines[0].startswith("tetrad: warning: rank 1 is a straggler: ")
    assert lines[0].endswith(
        f"x the median compute time over the last {WINDOWS} windows of {EVERY} steps"
    )
    assert one["printed"] == ""  # rank 0 speaks for the job


@pytest.mark.distributed
def test_an_even_run_names_nobody(jobs):
    zero, _ = jobs["even"]
    assert zero["steps"] == list(range(STEPS))
    assert zero["named"] == {}
    assert "straggler" not in zero["printed"]
    assert len(zero["scores"]) == STEPS // EVERY  # every window was scored


@pytest.mark.distributed
def test_the_times_ride_on_the_metrics_all_reduce_at_window_ends_only(jobs):
    zero, _ = jobs["even"]
    inside, at_end = zero["gathered"]  # a step inside a window, the step that ends one
    assert at_end - inside == 8 * 2  # one float64 per rank, in the same all-reduce (counted)


def test_the_wait_log_keeps_nothing_until_started():
    log = WaitLog()
    log.add(1.0, 2.0)
    assert log.take() == []  # off: a log nobody takes must not grow
    log.start()
    log.add(1.0, 2.0)
    assert log.take() == [(1.0, 2.0)] and log.take() == []


@pytest.mark.cuda
def test_on_a_gpu_a_step_records_events_and_the_window_reads_them_after_the_sync():
    comm = Comm("cuda")
    meter = ComputeMeter(comm)
    assert meter.span  # CUDA: the stream's timeline, in events
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the step raises
    try:
        meter.start()
        for _ in range(10):
            x = x @ x
            x = x / x.norm()
        meter.stop()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    x.sum().item()  # the step's host sync
    t0 = time.perf_counter()
    seconds = meter.take()
    assert time.perf_counter() - t0 < 0.05  # every event was behind the sync: no wait
    assert seconds > 0
