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

So a compute's start is a function of earlier computes' ends alone: the rank's previous
compute (its clock), and for each receive since then the compute its sender ran last
before the send. `Dag` records those links once per action lists, with the computes in
an order that puts each after the ones it reads; timing it on costs (`Dag.times`) is one
pass over that order, the same sums and maxima as running the lists rank by rank (a
planner's search times one schedule on many costs).
"""

from __future__ import annotations

import functools
import itertools
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


@dataclass(frozen=True)
class Dag:
    """Action lists' computes and what each waits for, in an order that puts every
    compute after the computes it reads (module docstring). Compute i is `computes[i]`
    (an Action); `after[i]` is its rank's previous compute, `moves[i]` the sends and
    receives the rank handles between the two, `inputs[i]` for each of those receives
    the compute its sender ran last before the send (-1: none, at time 0); `ranks[r]`
    rank r's computes in its own order."""

    computes: tuple[Action, ...]
    after: tuple[int, ...]
    moves: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, actions: Sequence[Sequence[Action]]) -> Dag:
        """The Dag of per-rank action lists; ValueError naming each stuck rank's action if
        they deadlock (what `run_all` names)."""
        found: dict[str, list] = {name: [] for name in ("computes", "after", "moves", "inputs")}
        last, moves = [-1] * len(actions), [0] * len(actions)
        inputs: list[list[int]] = [[] for _ in actions]
        ranks: list[list[int]] = [[] for _ in actions]
        sent: dict[tuple[str, int, int], int] = {}

        def step(a: Action, r: int) -> bool:
            if a.kind.startswith("SEND"):
                sent[wire(a)] = last[r]
            elif a.kind.startswith("RECV"):
                if wire(a) not in sent:
                    return False
                inputs[r].append(sent[wire(a)])
            else:
                for name, value in zip(found, (a, last[r], moves[r], tuple(inputs[r]))):
                    found[name].append(value)
                last[r], moves[r], inputs[r] = len(found["computes"]) - 1, -1, []
                ranks[r].append(last[r])
            moves[r] += 1
            return True

        run_all(actions, step, "schedule deadlocks")
        return cls(**{k: tuple(v) for k, v in found.items()}, ranks=tuple(map(tuple, ranks)))

    def times(self, costs: Costs) -> tuple[list[float], list[float]]:
        """(start, end) of every compute on `costs`: the rank's clock (its previous
        compute's end, plus `overhead` and `p2p` per send or receive since), or the
        latest of its inputs' arrivals, whichever is later."""
        durations = self._durations(costs)
        # p2p summed as the ranks add it, one transfer at a time
        host = list(itertools.accumulate([costs.p2p] * max(self.moves, default=0), initial=0.0))
        comm, overhead = costs.comm, costs.overhead
        n = len(self.computes)
        start, end = [0.0] * n, [0.0] * (n + 1)  # end[-1]: no compute, time 0
        for i, (prev, moves, ins, took) in enumerate(
            zip(self.after, self.moves, self.inputs, durations)
        ):
            clock = end[prev] + overhead + host[moves]
            arrived = 0.0
            for src in ins:
                t = end[src] + comm
                if t > arrived:
                    arrived = t
            start[i] = begin = arrived if arrived > clock else clock
            end[i] = begin + took
        del end[n]
        return start, end

    def _durations(self, costs: Costs) -> list[float]:
        if costs.each:
            return [costs.of(a.kind, a.stage, a.microbatch) for a in self.computes]
        of = functools.cache(costs.of)  # a kind's duration on a stage, looked up once
        return [of(a.kind, a.stage) for a in self.computes]


def simulate(actions: list[list[Action]], costs: Costs, schedule: str = "") -> Timeline:
    """Time every rank's action list; raise ValueError if the lists deadlock."""
    n_stages = 1 + max((a.stage for acts in actions for a in acts), default=0)
    for name in ("f", "b", "w"):
        value = getattr(costs, name)
        if not isinstance(value, int | float) and len(value) < n_stages:
            raise ValueError(f"Costs.{name} has {len(value)} entries for {n_stages} stages")
    dag = Dag.of(actions)
    start, end = dag.times(costs)
    # an Action's first three fields are an Event's: kind, stage, microbatch
    ranks = [[Event(*dag.computes[i][:3], start[i], end[i]) for i in rank] for rank in dag.ranks]
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


def simulate_schedule(
    name: str, pp: int, microbatches: int, costs: Costs, virtual_stages: int = 1
) -> Timeline:
    """Build schedule `name` and simulate it: the planner's one-call entry point."""
    actions = build_schedule(name, pp, microbatches, virtual_stages)
    return simulate(actions, costs, schedule=name)
