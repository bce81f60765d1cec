"""An event simulator for pipeline schedules: the same action lists the runtime executes.

Each rank runs its list in order, one compute at a time. A send is non-blocking; a
receive waits until the matching send has run plus `comm`. With uniform costs, comm = 0
and no overhead this reproduces the textbook bubbles exactly (see
tests/test_pp_simulate.py for the closed forms it is held to).

A real runtime also spends host time between computes that no compute accounts for:
posting and waiting for its transfers, its own bookkeeping. `Costs.overhead` (per
compute) and `Costs.p2p` (per send or receive the rank handles since its last compute)
model it: a compute starts once its inputs have arrived *and* that time has passed since
the rank's previous compute ended (whichever is later: the bookkeeping of a rank that
waits for a transfer is done while it waits). `measure.estimate_costs` reads both off a
measured step, so the simulator learns the runtime's own overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tetrad.parallel.pipeline.schedules import Action, build_schedule, wire
from tetrad.parallel.pipeline.timeline import Event, Timeline


@dataclass(frozen=True)
class Costs:
    """Time of each compute kind, per stage (a sequence) or for every stage (a scalar).

    f: forward; b: backward w.r.t. the input; w: weight gradient; a full backward (BW)
    costs b + w. comm: time from a send to the matching receive's completion.
    overhead: the runtime's fixed host time per compute (idle on the timeline).
    p2p: the runtime's fixed host time per send or receive it posts and waits for.
    each: durations of single computes, by (kind, stage, microbatch), that override the
    per-stage figures (a measured step replayed action by action: `measure.replay_costs`).
    """

    f: float | Sequence[float] = 1.0
    b: float | Sequence[float] = 1.0
    w: float | Sequence[float] = 1.0
    comm: float = 0.0
    overhead: float = 0.0
    p2p: float = 0.0
    each: Mapping[tuple[str, int, int], float] = field(default_factory=dict)

    def of(self, kind: str, stage: int, microbatch: int = -1) -> float:
        """Duration of compute `kind` on `stage` (of that microbatch's, where `each` has it)."""
        if self.each and (kind, stage, microbatch) in self.each:  # empty but in a replay
            return self.each[kind, stage, microbatch]
        if kind == "BW":
            return self.of("B", stage) + self.of("W", stage)
        value = {"F": self.f, "B": self.b, "W": self.w}[kind]
        return float(value if isinstance(value, int | float) else value[stage])


def simulate(actions: list[list[Action]], costs: Costs, schedule: str = "") -> Timeline:
    """Time every rank's action list; raise ValueError if the lists deadlock."""
    _check_costs(costs, 1 + max((a.stage for acts in actions for a in acts), default=0))
    pp = len(actions)
    clock = [0.0] * pp  # end of the rank's last compute
    # since the last compute: [host time spent on transfers, time the inputs arrived]
    since = [[0.0, 0.0] for _ in range(pp)]
    sent: dict[tuple[str, int, int], float] = {}
    ranks: list[list[Event]] = [[] for _ in range(pp)]

    def step(a: Action, rank: int) -> bool:
        """Advance `rank` past action `a` if it can run now; return whether it did."""
        host = since[rank]
        if a.kind.startswith("SEND"):
            sent[wire(a)] = clock[rank]  # made when its compute ended
            host[0] += costs.p2p
        elif a.kind.startswith("RECV"):
            if wire(a) not in sent:
                return False  # a receive whose send has not run yet holds its rank
            host[0] += costs.p2p
            host[1] = max(host[1], sent[wire(a)] + costs.comm)
        else:
            start = max(clock[rank] + costs.overhead + host[0], host[1])
            end = start + costs.of(a.kind, a.stage, a.microbatch)
            ranks[rank].append(Event(a.kind, a.stage, a.microbatch, start, end))
            clock[rank] = end
            since[rank] = [0.0, 0.0]
        return True

    run_all(actions, step, "schedule deadlocks")
    return Timeline(ranks, unit="cost", schedule=schedule)


def run_all(lists: Sequence[Sequence[Any]], step: Callable[[Any, int], bool], what: str) -> None:
    """Advance every rank through its list, in turns, while any can: `step(item, rank)`
    runs the item and returns True, or returns False when the item must wait for another
    rank. ValueError(`what` and each stuck rank's item) if the lists deadlock."""
    pc = [0] * len(lists)
    moved = True
    while moved:
        moved = False
        for r, items in enumerate(lists):
            while pc[r] < len(items) and step(items[pc[r]], r):
                pc[r] += 1
                moved = True
    stuck = [f"rank {r} at {lists[r][pc[r]]}" for r in range(len(lists)) if pc[r] < len(lists[r])]
    if stuck:
        raise ValueError(f"{what}: " + "; ".join(stuck))


def _check_costs(costs: Costs, n_stages: int) -> None:
    for name in ("f", "b", "w"):
        value = getattr(costs, name)
        if not isinstance(value, int | float) and len(value) < n_stages:
            raise ValueError(f"Costs.{name} has {len(value)} entries for {n_stages} stages")


def simulate_schedule(
    name: str, pp: int, microbatches: int, costs: Costs, virtual_stages: int = 1
) -> Timeline:
    """Build schedule `name` and simulate it: the planner's one-call entry point."""
    actions = build_schedule(name, pp, microbatches, virtual_stages)
    return simulate(actions, costs, schedule=name)
