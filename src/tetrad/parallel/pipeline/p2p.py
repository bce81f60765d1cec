"""When each pipeline rank posts, waits for and frees its transfers: one program per rank.

The runtime executes these programs item by item and the checker (`check.check_program`)
proves them deadlock-free under NCCL's semantics and gloo's; both call `program`, so what
is proven is what runs.

NCCL runs the operations of a communicator in issue order on one stream: a batch of
sends and receives is posted together, and a transfer completes only once the peer's
matching operation has been posted too; until then everything issued after it on that
stream waits. Receives posted one step early, in their own batch before the sends of
the step, deadlock there (pp = 2, m = 1: rank 0 waits in "recv B0" before "send F0",
rank 1 in "recv F0" before "send B0").

So both ends of a transfer post it at the same point of one global order, as Megatron
pairs each send with the receive its peer issues at the same point. The order is the
unit-cost simulation of the schedule: a tensor made at simulated time t is posted by its
sender right after the compute that made it (which ends at t), and by its receiver in
the batch it posts after its own last compute that ends no later than t. Every
operation of a batch posted after compute k therefore belongs to [end(k), end(k+1)), and
a compute waits only for batches posted before it: by induction over simulated time,
each batch's peers reach their matching batch, and no cycle can close. Ordering each
batch by (time, tensor) keeps every link's sends and receives in one order, which NCCL
(it matches messages on a link in order, ignoring tags) needs.

gloo posts each operation on its own and completes a send once the receiver has posted
it; the same program is safe there (check.check_program proves both). There a receive
may also be posted earlier, `early` computes before the one that needs it, so that its
transfer overlaps that compute: posting blocks nothing on gloo, while on NCCL it would
block the stream (so `early` is 0 for NCCL; the checker shows why). A send is waited for
(and its buffer freed) `slack` computes after it was posted; the runtime does so for a
stage output, and only reaps a gradient's send there (waiting for it at the step's end
if not done): a host wait done later removes a blocking point and adds none.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from tetrad.parallel.pipeline.schedules import Action, wire
from tetrad.parallel.pipeline.simulate import Costs, simulate

Wire = tuple[str, int, int]  # (direction, stage, microbatch): a tensor on the wire


@dataclass(frozen=True)
class Post:
    """Transfers (sends and receives) handed to the transport together, as one batch."""

    ops: tuple[Action, ...]


@dataclass(frozen=True)
class Wait:
    """Transfers to complete before going on: receives a compute needs, and sends whose
    buffers may then be freed."""

    ops: tuple[Action, ...]


Item = Post | Wait | Action  # an Action item is a compute (F, B, W or BW)


def program(actions: list[list[Action]], slack: int = 1, early: int = 0) -> list[list[Item]]:
    """Every rank's items, in the order its runtime issues them (see the module docstring).

    early: post each receive up to this many computes before the one needing it (gloo
    only: under NCCL's semantics only 0 is safe)."""
    tl = simulate(actions, Costs(f=1.0, b=1.0, w=1.0, comm=0.0))
    ends = [[e.end for e in events] for events in tl.ranks]
    # the simulated time at which each tensor exists: its compute's end
    made: dict[Wire, float] = {e.made: e.end for ev in tl.ranks for e in ev if e.kind != "W"}
    return [_rank_program(r, acts, ends[r], made, slack, early) for r, acts in enumerate(actions)]


def _rank_program(
    rank: int, acts: list[Action], ends: list[float], made: dict, slack: int, early: int
) -> list[Item]:
    computes = [a for a in acts if a.is_compute]
    n = len(computes)
    posts: list[list[Action]] = [[] for _ in range(n + 1)]  # point k: before compute k
    waits: list[list[Action]] = [[] for _ in range(n + 1)]
    k, recv_at = -1, {}
    for a in acts:
        if a.is_compute:
            k += 1
        elif a.kind.startswith("SEND"):
            posts[k + 1].append(a)
            waits[min(k + 1 + slack, n)].append(a)
        else:
            point = bisect_right(ends, made[wire(a)])  # computes ending by the tensor's time
            if point > k + 1:
                raise ValueError(f"rank {rank}: {a} would be posted after the compute needing it")
            recv_at[a] = min(point, max(k + 1 - early, 0))
            waits[k + 1].append(a)  # a receive sits just before the compute needing it
    # each link's receives in its send order, (time, tensor): none posted after a later one
    later: dict[int | None, int] = {}
    for a in sorted(recv_at, key=lambda a: (made[wire(a)], wire(a)), reverse=True):
        recv_at[a] = later[a.peer] = min(recv_at[a], later.get(a.peer, n))
    for a, point in recv_at.items():
        posts[point].append(a)
    items: list[Item] = []
    for k in range(n + 1):
        if posts[k]:
            items.append(Post(tuple(sorted(posts[k], key=lambda a: (made[wire(a)], wire(a))))))
        if waits[k]:
            items.append(Wait(tuple(waits[k])))
        if k < n:
            items.append(computes[k])
    return items


def computes(items: list[Item]) -> list[Action]:
    """The compute actions of one rank's program, in order."""
    return [i for i in items if isinstance(i, Action)]
