"""Stragglers named: the scoring (windows, medians over a stage's ranks, the threshold, the
reset) as pure functions; the meter (a rank's own time: its step's span minus the
collective waits `Comm` logs, so sleeping outside a collective counts and waiting for a
peer does not); and, on two ranks, a rank given more work is named at the earliest window
it can be, once, and forgotten when it recovers, a rank paused by SIGSTOP half of every
0.4 s is named too, and an even run names nobody."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time

import pytest
import torch

from harness import Jobs, tiny_config, trainer_for
from tetrad.cli import build_config, parser
from tetrad.comm import Comm, WaitLog
from tetrad.config import ParallelConfig, check_sections, from_dict
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

EVERY, WINDOWS = 20, 3  # the defaults: a window is long enough to average the OS's noise
STEPS = EVERY * 5  # the slowed run: five windows
SLOW_UNTIL = EVERY * 3  # the slowed rank is slow in windows 1 to 3, then recovers
BURN_S = 0.04  # CPU seconds burnt in each slowed forward: a few times a step's compute
EVEN_STEPS = EVERY * 4
STOP_S, PERIOD_S = 0.2, 0.4  # the paused rank is stopped for STOP_S of every PERIOD_S
# The paused run ends at the first window that names, or after PAUSED_STEPS. A rank paused
# half the time scores near 1.33, and a window holds only a few pauses, some of them in
# its waits: now and then a window falls under the threshold (docs/straggler.md). Two slow
# windows in a row name it here (no even run measured there had two, loaded or not).
PAUSED_WINDOWS, PAUSED_STEPS = 2, EVERY * 16
DEGREES = {"pp": 1, "dp": 2, "fsdp": 1, "cp": 1, "tp": 1}

# Stops its parent (SIGSTOP) for `stop` seconds of every `period`, as a preempted host
# would: the parent's CPU time stands still. It always resumes the parent before it
# leaves, and it leaves when the parent closes its stdin (done, or gone), when it has
# another parent (the first one died), or after `limit` seconds.
PAUSER = """
import os, select, signal, sys, time
target, stop, period, limit = int(sys.argv[1]), *map(float, sys.argv[2:])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that `finally` runs
end = time.monotonic() + limit
while os.getppid() == target and time.monotonic() < end:
    os.kill(target, signal.SIGSTOP)
    try:
        time.sleep(stop)
    finally:
        os.kill(target, signal.SIGCONT)
    if select.select([sys.stdin], [], [], period - stop)[0]:
        break
"""


def _burn(cpu_seconds: float) -> None:
    """Spin until this thread has used `cpu_seconds` of CPU (more work, not a pause: on a
    busy machine a burn takes longer, never less CPU)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


@contextlib.contextmanager
def _paused(on: bool):
    """This process paused by a helper process (PAUSER) while the block runs, if `on`."""
    if not on:
        yield
        return
    args = [sys.executable, "-I", "-S", "-c", PAUSER, str(os.getpid()), str(STOP_S), str(PERIOD_S)]
    helper = subprocess.Popen([*args, "120"], stdin=subprocess.PIPE)
    try:
        yield
    finally:
        helper.stdin.close()  # this process runs: the helper is between a resume and a pause
        helper.wait(timeout=30)


def _config(steps: int, windows: int = WINDOWS) -> dict:
    """Two data ranks of a model with more compute per step than the tiny one (dim 64, 64
    tokens a sequence): the collectives' fixed latency is then a smaller part of a step,
    as in real runs, and fewer pauses land in a rank's waits."""
    train = {"steps": steps, "seq_len": 64, "straggler_every": EVERY, "straggler_windows": windows}
    return tiny_config(model={"dim": 64}, parallel={"dp": 2}, train=train).to_dict()


def _recorded(trainer) -> list[list[float]]:
    """Every window's scores, appended as the trainer's detector computes them."""
    out = []
    observe = trainer.straggler.detector.observe

    def record(seconds):
        verdict = observe(seconds)
        out.append(trainer.straggler.detector.last)
        return verdict

    trainer.straggler.detector.observe = record
    return out


def _named(rows: list[dict]) -> dict[int, tuple[int, float]]:
    """The rows that name a straggler: step -> (rank, score)."""
    named = [r for r in rows if "straggler_rank" in r]
    return {r["step"]: (r["straggler_rank"], r["straggler_score"]) for r in named}


def _train_worker(rank: int, world: int, cfg_dict: dict, slow_rank: int | None) -> dict:
    """Train; `slow_rank` burns BURN_S of CPU in every forward before step SLOW_UNTIL.
    Rank 0's printed lines, every row's straggler fields and every window's scores."""
    trainer = trainer_for(from_dict(cfg_dict), rank)
    if rank == slow_rank:

        def slow(*_):
            if trainer.step < SLOW_UNTIL:
                _burn(BURN_S)

        trainer.engine.model.register_forward_pre_hook(slow)
    window_scores = _recorded(trainer)
    printed, gathered = io.StringIO(), []
    steps = trainer.cfg.train.steps
    with contextlib.redirect_stdout(printed):
        rows = trainer.fit(stop=steps - 1)  # the last step alone: a window's end
        gathered.append(trainer.comm.summary()["world/all_reduce"]["bytes"])
        rows += trainer.fit()
        gathered.append(trainer.comm.summary()["world/all_reduce"]["bytes"])
    out = {"printed": printed.getvalue(), "named": _named(rows), "scores": window_scores}
    return out | {"gathered": gathered, "steps": [r["step"] for r in rows]}


def _paused_worker(rank: int, world: int, cfg_dict: dict, paused_rank: int) -> dict:
    """Train with `paused_rank` paused (STOP_S of every PERIOD_S) until a window names a
    rank (every rank scores alike, so all stop at the same window) or the steps run out."""
    trainer = trainer_for(from_dict(cfg_dict), rank)
    window_scores = _recorded(trainer)
    printed, rows = io.StringIO(), []
    t0 = time.monotonic()
    with contextlib.redirect_stdout(printed), _paused(rank == paused_rank):
        while trainer.step < trainer.cfg.train.steps and not _named(rows):
            rows += trainer.fit(stop=trainer.step + EVERY)
    seconds = time.monotonic() - t0
    out = {"printed": printed.getvalue(), "named": _named(rows), "scores": window_scores}
    return out | {"seconds": seconds, "steps": len(rows)}


def _span_worker(rank: int, world: int) -> dict:
    """The meter around a collective that rank 1 reaches 0.3 s late, after sleeping: rank
    0's wait is subtracted, rank 1's sleep, outside any collective, is counted."""
    mesh = Mesh.build(ParallelConfig(dp=2), rank)
    comm = Comm("cpu")
    meter = ComputeMeter(comm)
    comm.barrier(mesh["world"])
    t0 = time.time()
    meter.start()
    if rank == 1:
        time.sleep(0.3)
    comm.all_reduce(torch.zeros(4), mesh["world"])
    meter.stop()
    return {"wall": time.time() - t0, "own": meter.take()}


def declare_jobs(jobs: Jobs) -> None:
    """Two ranks: rank 1 given more work, rank 1 paused, an even run, the meter's check."""
    jobs.add("slowed", 2, _train_worker, _config(STEPS), 1)
    jobs.add("paused", 2, _paused_worker, _config(PAUSED_STEPS, PAUSED_WINDOWS), 1)
    jobs.add("even", 2, _train_worker, _config(EVEN_STEPS), None)
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


def test_own_time_counts_sleeping_and_work_outside_collectives():
    meter = ComputeMeter(Comm("cpu"))
    meter.start()
    time.sleep(0.1)  # a rank that could not run (paused, starved, waiting on its input)
    _burn(0.05)
    meter.stop()
    assert 0.14 < meter.take() < 1.0
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
def test_the_meter_subtracts_collective_waits(jobs):
    zero, one = jobs["span"]
    assert zero["wall"] > 0.25 and zero["own"] < 0.1  # waited for rank 1: not its own
    assert one["own"] > 0.25  # slept outside any collective: its own time


@pytest.mark.distributed
def test_a_rank_given_more_work_is_named_at_the_earliest_window_once_and_forgotten(jobs):
    zero, one = jobs["slowed"]
    assert zero["named"] == one["named"]  # every rank scores alike
    # windows end after steps 20, 40, ... (rows 19, 39, ...); rank 1 is slow in the first
    # three: named at the third, the earliest it can be; once it has recovered, a window
    # at or under the threshold forgets it, so the fifth does not name it
    first = EVERY * WINDOWS - 1
    assert min(zero["named"]) == first, zero["scores"]
    assert set(zero["named"]) <= {first, first + EVERY}, zero["scores"]
    for rank, score in zero["named"].values():
        assert rank == 1 and score > 1.2
    lines = [ln for ln in zero["printed"].splitlines() if "straggler" in ln]
    assert len(lines) == 1, zero["printed"]
    assert lines[0].startswith("tetrad: warning: rank 1 is a straggler: ")
    assert lines[0].endswith(
        f"x the median compute time over the last {WINDOWS} windows of {EVERY} steps"
    )
    assert one["printed"] == ""  # rank 0 speaks for the job


@pytest.mark.distributed
def test_a_paused_rank_is_named(jobs):
    zero, one = jobs["paused"]
    assert zero["named"] == one["named"], zero["scores"]
    assert len(zero["named"]) == 1, zero["scores"]  # the run ends at the first that names
    ((rank, score),) = zero["named"].values()
    assert rank == 1 and score > 1.2, zero["scores"]
    lines = [ln for ln in zero["printed"].splitlines() if "straggler" in ln]
    assert len(lines) == 1 and lines[0].startswith("tetrad: warning: rank 1 is a straggler: ")


@pytest.mark.distributed
def test_an_even_run_names_nobody(jobs):
    zero, _ = jobs["even"]
    assert zero["steps"] == list(range(EVEN_STEPS))
    assert zero["named"] == {}, zero["scores"]
    assert "straggler" not in zero["printed"]
    assert len(zero["scores"]) == EVEN_STEPS // EVERY  # every window was scored


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
    meter = ComputeMeter(comm)  # CUDA: the stream's timeline, in events
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
