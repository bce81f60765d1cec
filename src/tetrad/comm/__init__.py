"""Every collective and point-to-point transfer tetrad makes goes through `Comm`.

Each call names its group explicitly and is recorded per (axis, operation): calls, buffer
bytes (the tensor a rank hands to the collective) and bus bytes (what a ring algorithm
makes each rank send: the nccl-tests convention, all-reduce 2(n-1)/n, all-gather and
reduce-scatter (n-1)/n of the full buffer, broadcast and send 1x), and the seconds spent
blocking. Tests compare these counts with the theoretical volume of each layout; the
trainer reports them per step.

Every tensor handed to a collective must live on the compute device the `Comm` was made
for (NCCL takes device tensors only; gloo would hide the mistake on CPU): a tensor on
another device is refused with a ValueError before any process is involved. "Seconds
blocked" is host time on CPU; on a GPU, where `wait()` only makes the compute stream
wait, it is the time that stream stalls, measured with CUDA events around the wait.
Only `torch.distributed` functions that exist since the declared floor (torch 2.6) are
called (tests/test_torch_floor.py holds the code to that).

The marks of every blocking wait can also be kept in order (`Comm.waits`, a `WaitLog`),
for a meter that subtracts them from a span of the device's timeline (a rank's compute
time, train/straggler.py).

Every collective is also numbered per group in a `Ledger` (the last ones kept in a ring),
which the watchdog dumps on a timeout so the launcher can name the rank that is behind.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tetrad.comm.ledger import Call, Ledger
from tetrad.comm.watchdog import Watchdog
from tetrad.devices import Clock
from tetrad.mesh import Group

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def bus_factor(op: str, n: int) -> float:
    """Bytes each rank sends per buffer byte, for a ring over n ranks (nccl-tests busbw)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # broadcast, send (and a send/recv ring step)


class WaitLog:
    """The (start, end) marks of every blocking wait, in order, kept until taken: what a
    compute-time meter subtracts from a span of the device's timeline (train/straggler.py).
    Off until `start`: a log nobody takes would only grow (on a GPU, events)."""

    def __init__(self) -> None:
        self.on = False
        self._marks: list[tuple[Any, Any]] = []

    def start(self) -> None:
        self.on = True

    def add(self, start: Any, end: Any) -> None:
        if self.on:
            self._marks.append((start, end))

    def take(self) -> list[tuple[Any, Any]]:
        """The marks logged since the last take (on a GPU, events not yet read)."""
        marks, self._marks = self._marks, []
        return marks


@dataclass
class OpStats:
    """Totals for one (axis, op) pair."""

    calls: int = 0
    bytes: int = 0  # buffer bytes (full buffer for all-gather/reduce-scatter)
    bus_bytes: float = 0.0  # bytes this rank sends on a ring
    clock: Clock | None = field(default=None, repr=False)
    log: WaitLog | None = field(default=None, repr=False)  # the Comm's, every wait in order
    _seconds: float = 0.0
    _pending: list[tuple[Any, Any]] = field(default_factory=list, repr=False)  # unread marks

    def blocked(self, start: Any, end: Any) -> None:
        """Charge the time between two marks of `clock` (read when `seconds` is)."""
        self.log.add(start, end)  # a Comm's stats (the only ones that block) have both
        self._pending.append((start, end))

    @property
    def seconds(self) -> float:
        """Time blocked in the call or in its wait() (on a GPU, waits for the marks)."""
        for start, end in self._pending:
            self._seconds += self.clock.interval(start, end)
        self._pending.clear()
        return self._seconds


@dataclass
class Flight:
    """An async collective's time in flight, in host seconds: launched at `start`, done at
    `end` (set by the work's future when it completes, or, for works without one, such as
    gloo's reduce-scatter, when a wait returns; None until then)."""

    op: str
    group: str
    start: float
    end: float | None = None


def _blocking(block, stats: OpStats, watchdog: Watchdog | None, call: Call) -> None:
    """Run `block()`, which waits for `call`: watched (if there is a watchdog), its time
    charged to `stats`, and `call` marked done once it returns."""
    t0 = stats.clock.mark()
    if watchdog:
        watchdog.arm(call)
    block()
    if watchdog:
        watchdog.disarm()
    stats.blocked(t0, stats.clock.mark())
    call.done = True


class Work:
    """An in-flight async collective; `wait()` charges its blocking time to the stats."""

    def __init__(
        self, handle, stats: OpStats, watch: Watchdog | None = None, what: Call | None = None
    ):
        self._handle, self._stats = handle, stats
        self._watch, self._what = watch, what
        self.flight: Flight | None = None  # when traced

    def done(self) -> bool:
        """Whether it has completed (never blocks; a completed one still needs `wait`; a
        gloo point-to-point work says no until waited for, so only collectives are polled)."""
        return self._handle is None or self._handle.is_completed()

    is_completed = done  # the name of torch's own works

    def wait(self) -> None:
        if self._handle is not None:
            _blocking(self._handle.wait, self._stats, self._watch, self._what)
            self._handle = None
            if self.flight is not None and self.flight.end is None:
                self.flight.end = time.time()


class Comm:
    """The collectives, with accounting. One per process, passed explicitly.

    device: the compute device; every tensor handed to a collective must live there. With a
    `watchdog`, every blocking call (a synchronous collective, an async one's wait, a host
    sync in `watching`) is armed with its name and group, so a call that never completes is
    named; the calls are numbered in the watchdog's ledger (else in one of its own).
    """

    def __init__(
        self, device: torch.device | str = "cpu", watchdog: Watchdog | None = None
    ) -> None:
        self.watchdog = watchdog
        self.ledger = watchdog.ledger if watchdog is not None else Ledger()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.clock = device, Clock(device)
        # every blocking wait's marks, when a meter asked for them (`WaitLog.start`)
        self.waits = WaitLog()
        self.stats: dict[tuple[str, str], OpStats] = defaultdict(
            lambda: OpStats(clock=self.clock, log=self.waits)
        )
        # when a list: every async collective's `Flight` is appended (a pipeline step's
        # communication lane); set by `trace_into`
        self.trace: list[Flight] | None = None

    def trace_into(self, flights: list[Flight] | None) -> None:
        """Append every async collective's `Flight` to `flights` from now on (None: stop)."""
        self.trace = flights

    def check_device(self, t: torch.Tensor, group: Group, op: str) -> None:
        """Refuse a tensor that is not on the compute device (NCCL would, less clearly)."""
        if t.device != self.device:
            raise ValueError(
                f"{op} over {group.name!r}: a tensor on {t.device}, but this rank's "
                f"collectives take tensors on its compute device {self.device}"
            )

    def reset(self) -> None:
        self.stats.clear()

    def total_bus_bytes(self) -> float:
        return sum(s.bus_bytes for s in self.stats.values())

    def summary(self) -> dict[str, dict[str, float]]:
        """{"axis/op": {calls, bytes, bus_bytes, seconds}} for reporting."""
        keys = ("calls", "bytes", "bus_bytes", "seconds")
        return {
            f"{axis}/{op}": {k: getattr(s, k) for k in keys}
            for (axis, op), s in sorted(self.stats.items())
        }

    @contextlib.contextmanager
    def watching(self, what: str):
        """Watch a blocking point that is not a collective call (on a GPU, a host sync that
        waits for enqueued collectives): named by `what` and the last collective issued."""
        if self.watchdog is None:
            yield
            return
        last = self.ledger.ring[-1].describe() if self.ledger.ring else "none yet"
        self.watchdog.arm(f"{what} (the last collective issued: {last})")
        try:
            yield
        finally:
            self.watchdog.disarm()

    def _count(self, group: Group, op: str, nbytes: int, sent: float | None = None) -> OpStats:
        """Count a call of `nbytes` buffer bytes; `sent`: the bytes this rank sends, when
        no ring factor gives them (all-to-all: what leaves for the other ranks)."""
        s = self.stats[(group.name, op)]
        s.calls += 1
        s.bytes += nbytes
        s.bus_bytes += bus_factor(op, group.size) * nbytes if sent is None else sent
        return s

    def _run(
        self, group: Group, op: str, nbytes: int, fn, async_op: bool, sent: float | None = None
    ) -> Work | None:
        """Count a collective (see `_count`), number it in the ledger and run
        `fn(async_op=...)` (a `torch.distributed` call, all of its other arguments bound)."""
        stats, call = self._count(group, op, nbytes, sent), self.ledger.issue(op, group, nbytes)
        if async_op:
            work = Work(fn(async_op=True), stats, self.watchdog, call)
            if self.trace is not None and work._handle is not None:
                work.flight = _flight(work._handle, call)
                self.trace.append(work.flight)
            return work
        _blocking(lambda: fn(async_op=False), stats, self.watchdog, call)
        return None

    def _collective(
        self,
        op: str,
        group: Group,
        out: torch.Tensor,
        inp: torch.Tensor,
        nbytes: int,
        fn,
        async_op: bool = False,
        sent: float | None = None,
    ) -> Work | None:
        """Every collective's one path: both tensors checked to be on the compute device; on
        one rank `inp` copied into `out` (no call); else counted as `nbytes` buffer bytes
        (`sent`, see `_count`), numbered and run (`fn(async_op=...)`)."""
        self.check_device(out, group, op)
        self.check_device(inp, group, op)
        if group.size == 1:
            if out is not inp:
                out.copy_(inp)
            return Work(None, OpStats()) if async_op else None
        return self._run(group, op, nbytes, fn, async_op, sent)

    def all_reduce(
        self, t: torch.Tensor, group: Group, async_op: bool = False, op: str = "sum"
    ) -> Work | None:
        """In place over `group`: the "sum" (gloo has no AVG: callers scale) or the "max"."""
        call = partial(dist.all_reduce, t, op=REDUCE_OPS[op], group=group.pg)
        return self._collective("all_reduce", group, t, t, t.nbytes, call, async_op)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False
    ) -> Work | None:
        """Concatenate every rank's `inp` along dim 0 into `out` (size * inp)."""
        call = partial(dist.all_gather_into_tensor, out, inp, group=group.pg)
        return self._collective("all_gather", group, out, inp, out.nbytes, call, async_op)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False
    ) -> Work | None:
        """Sum `inp` over the group and keep this rank's dim-0 slice in `out`."""
        call = partial(dist.reduce_scatter_tensor, out, inp, group=group.pg)
        return self._collective("reduce_scatter", group, out, inp, inp.nbytes, call, async_op)

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Group,
        op: str = "all_to_all",
        async_op: bool = False,
    ) -> Work | None:
        """Rows `in_splits[i]` of `inp` (dim 0, in group order) go to group rank i; rows
        from rank i land in `out` in order, `out_splits[i]` of them. Counted as the bytes
        handed in, and as sent the bytes that leave this rank (its own rows stay); `op`
        names the record (the expert layer counts its token counts apart)."""
        kept = in_splits[group.rank] * math.prod(inp.shape[1:]) * inp.element_size()
        call = partial(dist.all_to_all_single, out, inp, out_splits, in_splits, group=group.pg)
        return self._collective(op, group, out, inp, inp.nbytes, call, async_op, inp.nbytes - kept)

    def broadcast(self, t: torch.Tensor, src: int, group: Group) -> None:
        """Broadcast from group-local index `src`."""
        call = partial(dist.broadcast, t, group.ranks[src], group=group.pg)
        self._collective("broadcast", group, t, t, t.nbytes, call)

    def batch_p2p(self, ops: list[tuple[str, torch.Tensor, int]], group: Group) -> list[Work]:
        """Post sends/receives together: ops are ("send"|"recv", tensor, global peer rank).

        One Work per op. NCCL runs the batch as one group and returns one work for all of
        it: every op then shares it (waiting for any op waits for the whole batch). gloo
        cannot group them: `batch_isend_irecv` would post each on its own after checks
        that cost more than the post (a pipeline's small transfers feel it), so on the
        CPU each is posted directly, in the batch's order."""
        for kind, t, _ in ops:
            self.check_device(t, group, kind)
            self._count(group, kind, t.nbytes if kind == "send" else 0)  # a recv: a call only
        if not ops:
            return []
        post = {"send": dist.isend, "recv": dist.irecv}
        if self.device.type == "cuda":
            p2p = [dist.P2POp(post[kind], t, peer, group=group.pg) for kind, t, peer in ops]
            handles = dist.batch_isend_irecv(p2p)
            if len(handles) != len(p2p):  # coalesced: one work for the whole batch
                handles = [handles[0] if handles else None] * len(p2p)
        else:
            handles = [post[kind](t, peer, group=group.pg) for kind, t, peer in ops]
        nbytes = sum(t.nbytes for _, t, _ in ops)
        call = self.ledger.issue("send/recv", group, nbytes, numbered=False)
        stats = self.stats[(group.name, "p2p_wait")]
        return [Work(h, stats, self.watchdog, call) for h in handles]

    def barrier(self, group: Group) -> None:
        """Every member of `group` reaches this point (counted, numbered and watched)."""
        if group.size == 1:
            return
        # NCCL: name the device, or torch guesses one per rank and may pick a shared GPU
        ids = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
        self._run(group, "barrier", 0, partial(dist.barrier, group=group.pg, **ids), False)


def _flight(handle, call: Call) -> Flight:
    """A Flight for `handle`, its end stamped by the work's future on completion."""
    flight = Flight(call.op, call.group, time.time())

    def land(_) -> None:
        flight.end = time.time()

    with contextlib.suppress(RuntimeError):  # no future on this work: its wait stamps the end
        handle.get_future().then(land)
    return flight
