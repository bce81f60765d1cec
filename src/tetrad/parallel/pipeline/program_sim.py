"""Time the transfer programs the runtime executes (p2p.program), not just the schedule.

`simulate.simulate` times a schedule's action lists as if every receive were posted the
moment its compute needs it and every send were free. The runtime does less well than
that, by design: it posts each receive at a point fixed by the unit-cost order (so that
the programs are deadlock-free under NCCL's semantics, see p2p.py), and a gloo or NCCL
send completes only once the receiver has posted the matching receive (a rendezvous),
so a sender whose program waits for a send (`slack` computes after posting it) stalls
until its peer gets there. With non-uniform stage costs (an embedding or a head that
outweighs a layer) the real order drifts from the unit-cost one, and those stalls are
idle time the action-level simulator cannot see.

Here each rank walks its items: a Post marks each of its transfers as posted now (and
costs `Costs.p2p` of host time per transfer); a Wait lasts until each transfer's both
ends are posted and `Costs.comm` has passed since the later post; a compute starts
`Costs.overhead` after the rank's host is free. With uniform costs and no overhead this
agrees with `simulate.simulate` (tests/test_pp_simulate.py), so the difference
between the two is exactly what the runtime's transfer placement costs.
"""

from __future__ import annotations

from tetrad.parallel.pipeline.p2p import Item, Post, Wait
from tetrad.parallel.pipeline.schedules import wire
from tetrad.parallel.pipeline.simulate import Costs, run_all
from tetrad.parallel.pipeline.timeline import Event, Timeline

End = tuple[bool, tuple[str, int, int]]  # (is the send side, the tensor on the wire)


def simulate_program(programs: list[list[Item]], costs: Costs, schedule: str = "") -> Timeline:
    """Time every rank's program; raise ValueError if they deadlock."""
    pp = len(programs)
    now = [0.0] * pp
    posted: dict[End, float] = {}
    ranks: list[list[Event]] = [[] for _ in range(pp)]

    def step(item: Item, r: int) -> bool:
        """Advance rank `r`'s host past `item` if it can complete now; return whether it did."""
        t = now[r]
        if isinstance(item, Post):
            for a in item.ops:
                t += costs.p2p
                posted[a.kind.startswith("SEND"), wire(a)] = t
        elif isinstance(item, Wait):
            for a in item.ops:
                mine = a.kind.startswith("SEND")
                other = posted.get((not mine, wire(a)))
                if other is None:
                    return False  # a wait on a transfer whose other end is not posted yet
                t = max(t, max(posted[mine, wire(a)], other) + costs.comm)
        else:
            start = t + costs.overhead
            t = start + costs.of(item.kind, item.stage)
            ranks[r].append(Event(item.kind, item.stage, item.microbatch, start, t))
        now[r] = t
        return True

    run_all(programs, step, "programs deadlock")
    return Timeline(ranks, unit="cost", schedule=schedule)
