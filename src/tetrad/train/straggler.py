"""Stragglers named: each rank's compute time over a window of steps, against its peers'.

Every `straggler_every` steps each rank's compute time over the window (its own, without
the time it waited in collectives) is gathered, one float per rank, in slots of the
all-reduce the metrics row already makes (a sum over disjoint slots is an all-gather), and
every rank scores every rank alike: its time over the median of its peers' times. Peers
are the ranks of one pipeline stage: they do the same work in a step, and different
stages do not. A rank whose score is above the threshold in `windows` windows in a row is
named once, in one warning line on rank 0, and in the metrics row of every window it stays
slow in (`straggler_rank`, `straggler_score`); a window at or under the threshold resets
it. NVIDIA's straggler detection (nvidia-resiliency-ext) scores ranks relative to the
others over a reporting interval in the same spirit; this is tetrad's own, on its timings.

What "compute time" is: a rank's own time, the span from a step's start to its host sync
minus the time it blocked in collectives (the marks `Comm` records around every blocking
wait, handed over by `Comm.waits`). What is left is what its peers wait for: its work,
and also the time it could not run (paused, preempted, throttled, waiting on its input).
CPU time would miss that second kind, the common one: a starved rank's CPU time does not
grow while its peers wait for it. The span is read on the device's timeline:

* CPU: the host's wall clock.
* CUDA: the compute stream's timeline, in CUDA events (a starved host lets the stream run
  dry, and the idle stream is in the span). They are read only at a window's end, after
  that step's host sync: the stream has passed every one of them by then, so reading
  waits for nothing, and no step adds a device sync of its own. (The optimizer's update
  runs after the host sync, so it is outside the span: a mark after it could only be read
  by waiting for the device. The same span is kept on CPU.)

A pause that lands while the paused rank itself waits in a collective counts as a wait for
both ranks, and one outside the span (the update, the metrics row) for neither. The rest
are in the proportion that a peer's own time is of a step, so a rank paused half the time
has about twice a peer's own time (a score near 1.33 against one peer). A wall clock counts
the time the OS gave to other processes, so on a loaded machine whichever rank happened to
lose its core looks slow for a while: the window and the `windows` slow windows in a row
are what keep that from naming anyone (docs/straggler.md has the measurements).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from tetrad.comm import Comm
from tetrad.config import TrainConfig
from tetrad.mesh import Mesh, axis_groups


def peer_groups(degrees: dict[str, int]) -> list[list[int]]:
    """Ranks that do the same work in a step, compared with each other: one pipeline
    stage's (dp, fsdp, cp and tp ranks split the work evenly; stages do not)."""
    # the s-th rank of every pp group is in stage s
    return [list(stage) for stage in zip(*axis_groups(degrees, "pp"))]


def scores(seconds: list[float], peers: list[list[int]]) -> list[float]:
    """Each rank's seconds over the median of its peer group's; 1.0 where there is nothing
    to compare with (a group of one rank, or nothing measured). With two peers the median
    is their mean, so a score of 1.2 is 1.5 times the other rank's time."""
    out = [1.0] * len(seconds)
    for group in peers:
        mid = statistics.median(seconds[r] for r in group)
        if len(group) > 1 and mid > 0:
            for r in group:
                out[r] = seconds[r] / mid
    return out


@dataclass(frozen=True)
class Straggler:
    """A named rank and its mean score over the windows that named it."""

    rank: int
    score: float


class Detector:
    """The scoring, pure: each window's per-rank seconds in; the ranks slow in `windows`
    windows in a row out. A rank's run of slow windows ends (and it may be named again
    later) at the first window at or under `threshold`."""

    def __init__(self, peers: list[list[int]], threshold: float, windows: int):
        self.peers, self.threshold, self.windows = peers, threshold, windows
        self.runs: dict[int, list[float]] = {}  # rank -> its last scores, all slow
        self.named: set[int] = set()
        self.last: list[float] = []  # the last window's scores (what tests and logs read)

    def observe(self, seconds: list[float]) -> tuple[list[Straggler], list[Straggler]]:
        """Score one window: (ranks named for the first time in their run, every rank
        named now), each with its mean score over its last `windows` windows."""
        self.last = scores(seconds, self.peers)
        for rank, score in enumerate(self.last):
            if score > self.threshold:
                self.runs[rank] = (self.runs.get(rank, []) + [score])[-self.windows :]
            else:
                self.runs.pop(rank, None)
                self.named.discard(rank)
        now = [
            Straggler(rank, statistics.fmean(run))
            for rank, run in sorted(self.runs.items())
            if len(run) == self.windows
        ]
        new = [s for s in now if s.rank not in self.named]
        self.named.update(s.rank for s in now)
        return new, now


class ComputeMeter:
    """This rank's own seconds between `start` and `stop` marks, summed until `take`: each
    span on the device's timeline minus the collective waits logged inside it (see the
    module's docstring)."""

    def __init__(self, comm: Comm):
        self.comm, self.clock = comm, comm.clock
        comm.waits.start()
        self._t0: Any = None
        self._spans: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []  # start, stop, waits

    def start(self) -> None:
        self.comm.waits.take()  # waits before this step's start are not this span's
        self._t0 = self.clock.mark()

    def stop(self) -> None:
        """Just before the step's host sync (on a GPU, only records an event)."""
        self._spans.append((self._t0, self.clock.mark(), self.comm.waits.take()))

    def take(self) -> float:
        """The seconds measured since the last take (after a host sync: on a GPU every
        mark is already behind the stream, so reading them does not wait)."""
        seconds = 0.0
        for start, end, waits in self._spans:
            seconds += self.clock.interval(start, end)
            seconds -= sum(self.clock.interval(a, b) for a, b in waits)
        self._spans.clear()
        return max(seconds, 0.0)


def warning(s: Straggler, windows: int, every: int) -> str:
    """The one line that names a straggler."""
    return (
        f"tetrad: warning: rank {s.rank} is a straggler: {s.score:.2f}x the median compute "
        f"time over the last {windows} windows of {every} steps"
    )


class StragglerWatch:
    """The trainer's part: marks each step, gathers at each window's end, names."""

    def __init__(self, t: TrainConfig, mesh: Mesh, comm: Comm):
        # one rank has nobody to be compared with: nothing is measured
        self.every = t.straggler_every if mesh.world > 1 else 0
        self.windows, self.rank, self.world = t.straggler_windows, mesh.rank, mesh.world
        self.meter = ComputeMeter(comm) if self.every else None
        self.detector = Detector(peer_groups(mesh.degrees), t.straggler_threshold, self.windows)

    def start(self) -> None:
        if self.meter:
            self.meter.start()

    def stop(self) -> None:
        if self.meter:
            self.meter.stop()

    def slots(self, step: int) -> list[float]:
        """After `step` steps: at a window's end, a world-long vector with this rank's
        compute seconds in its own slot and zeros elsewhere (summed over the world, every
        rank's seconds); elsewhere empty (nothing is gathered, nothing read)."""
        if not self.every or step % self.every:
            return []
        out = [0.0] * self.world
        out[self.rank] = self.meter.take()
        return out

    def observe(self, seconds: list[float]) -> dict[str, Any]:
        """Score a window's gathered seconds (every rank alike; rank 0 prints the warning
        of a rank named for the first time); the metrics row's straggler fields, naming
        the slowest named rank. Empty when `seconds` is (not a window's end)."""
        if not seconds:
            return {}
        new, now = self.detector.observe(seconds)
        if self.rank == 0:
            for s in new:
                print(warning(s, self.windows, self.every), flush=True)
        if not now:
            return {}
        worst = max(now, key=lambda s: s.score)
        return {"straggler_rank": worst.rank, "straggler_score": round(worst.score, 4)}
