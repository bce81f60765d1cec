"""What a real pipeline step did: its timeline, its costs, its activation memory.

`gather_timeline` collects every pp rank's measured compute events into one `Timeline`
(seconds from the step's first start). `estimate_costs` reads per-stage F/B/W times and
the transfer latency off that timeline (medians), and `simulated_timeline` replays the
same schedule in the simulator with those costs, so a measured bubble can be held
against the bubble the schedule itself predicts. `write_timeline` draws both and writes
Chrome traces. `ActivationMeter` counts activation bytes through autograd's saved-tensor
hooks (parallel/meter.py, re-exported here), for tetrad's runtimes and for the peer in
benchmarks/pp.py alike.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from tetrad.comm import Comm
from tetrad.mesh import Group
from tetrad.parallel.meter import ActivationMeter  # noqa: F401  (re-exported)
from tetrad.parallel.pipeline.simulate import Costs, simulate_schedule
from tetrad.parallel.pipeline.timeline import (
    COMM_KINDS,
    Event,
    Timeline,
    plot_timeline,
    save_chrome_trace,
)

KINDS = ("F", "B", "W", "BW", *COMM_KINDS)  # compute, then the communication lane's


# --- the measured timeline ------------------------------------------------------------


def gather_timeline(events: list[Event], comm: Comm, group: Group, **meta) -> Timeline:
    """Every pp rank's events of one step as one Timeline; a collective over `group`.

    Clocks are compared directly (one host: one clock), so times are seconds from the
    earliest start on any rank. Ranks may hold different numbers of events: each pads.
    Events of a COMM_KINDS kind (a runtime's `comm_events`) form the communication lane.
    """
    f64 = dict(dtype=torch.float64, device=comm.device)  # NCCL gathers device tensors only
    count = torch.tensor([float(len(events))], **f64)
    counts = torch.empty(group.size, **f64)
    comm.all_gather(counts, count, group)
    n = int(counts.max())
    rows = torch.full((n, 5), -1.0, **f64)  # [kind, stage, mb, start, end]
    if events:  # float64: epoch seconds need its 53 bits to keep microseconds
        rows[: len(events)] = torch.tensor(
            [[KINDS.index(e.kind), e.stage, e.microbatch, e.start, e.end] for e in events],
            **f64,
        )
    table = torch.empty(group.size * n, 5, **f64)
    comm.all_gather(table, rows, group)
    table = table.view(group.size, n, 5).cpu()
    valid = table[..., 0] >= 0
    t0 = float(table[..., 3][valid].min()) if bool(valid.any()) else 0.0
    every = [
        [
            Event(KINDS[int(k)], int(s), int(mb), float(a) - t0, float(b) - t0)
            for k, s, mb, a, b in table[r][valid[r]].tolist()
        ]
        for r in range(group.size)
    ]
    ranks = [[e for e in ev if e.kind not in COMM_KINDS] for ev in every]
    lane = [[e for e in ev if e.kind in COMM_KINDS] for ev in every]
    schedule = meta.pop("schedule", "")
    return Timeline(ranks, comm=lane, unit="s", schedule=schedule, meta=meta)


# --- costs read off a measured timeline ----------------------------------------------


def estimate_costs(tl: Timeline, n_stages: int) -> Costs:
    """Per-stage median F, B and W times, and the median transfer latency.

    A full backward (BW) splits evenly into B and W: the simulator only ever adds them.
    Latency samples: a consumer that sat idle until its producer finished, from the
    producer's end to the consumer's start (transfer plus the runtime's bookkeeping).
    """
    times: dict[tuple[str, int], list[float]] = {}
    for events in tl.ranks:
        for e in events:
            if e.kind == "BW":
                times.setdefault(("B", e.stage), []).append(e.duration / 2)
                times.setdefault(("W", e.stage), []).append(e.duration / 2)
            else:
                times.setdefault((e.kind, e.stage), []).append(e.duration)
    per_stage = {
        kind: [_median(times.get((kind, s), [])) for s in range(n_stages)]
        for kind in ("F", "B", "W")
    }
    return Costs(per_stage["F"], per_stage["B"], per_stage["W"], _median(transfer_gaps(tl)))


def transfer_gaps(tl: Timeline) -> list[float]:
    """Producer-end to consumer-start gaps where the consumer was waiting for that tensor."""
    where = {(e.kind, e.stage, e.microbatch): (r, e) for r, ev in enumerate(tl.ranks) for e in ev}
    gaps = []
    for r, events in enumerate(tl.ranks):
        idle_since = 0.0
        for e in events:
            src = _producer(e, where)
            if src is not None and src[0] != r and src[1].end >= idle_since:
                gaps.append(max(e.start - src[1].end, 0.0))
            idle_since = e.end
    return gaps


def _producer(e: Event, where: dict) -> tuple[int, Event] | None:
    """The (rank, event) whose output `e` consumes from another stage, if any."""
    if e.kind == "F":
        return where.get(("F", e.stage - 1, e.microbatch))
    if e.kind in ("B", "BW"):
        return where.get(("B", e.stage + 1, e.microbatch)) or where.get(
            ("BW", e.stage + 1, e.microbatch)
        )
    return None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def simulated_timeline(
    schedule: str, pp: int, microbatches: int, costs: Costs, virtual_stages: int = 1
) -> Timeline:
    """The simulator's timeline of the same schedule at measured costs (unit: seconds)."""
    tl = simulate_schedule(schedule, pp, microbatches, costs, virtual_stages)
    tl.unit = "s"
    return tl


def measure_step(
    events: list[Event], comm: Comm, group: Group, schedule: str, microbatches: int, v: int = 1
) -> tuple[Timeline, Timeline]:
    """(measured, simulated) timelines of one step; a collective over the pp `group`."""
    measured = gather_timeline(
        events, comm, group, schedule=schedule, microbatches=microbatches, virtual_stages=v
    )
    costs = estimate_costs(measured, group.size * v)
    simulated = simulated_timeline(schedule, group.size, microbatches, costs, v)
    measured.meta["costs"] = simulated.meta["costs"] = _costs_dict(costs)
    return measured, simulated


def _costs_dict(c: Costs) -> dict:
    return {"f": list(c.f), "b": list(c.b), "w": list(c.w), "comm": c.comm}


def write_timeline(measured: Timeline, simulated: Timeline, out_dir: str | Path) -> list[Path]:
    """DIR/timeline.png (measured above simulated), DIR/timeline.json and
    DIR/timeline_sim.json (Chrome traces: open them in Perfetto). Returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "timeline.png", out / "timeline.json", out / "timeline_sim.json"]
    plot_pair(measured, simulated, paths[0])
    save_chrome_trace(measured, str(paths[1]))
    save_chrome_trace(simulated, str(paths[2]))
    return paths


def plot_pair(measured: Timeline, simulated: Timeline, path: str | Path) -> None:
    """One PNG: the measured timeline above the simulated one, on one time axis, so the
    idle time the schedule explains and the idle time it does not line up."""
    name = measured.schedule or "pipeline"
    timelines = {
        f"{name} measured, pp={measured.pp}": measured,
        f"{name} simulated at the measured median costs": simulated,
    }
    plot_timeline(timelines, str(path), share_time=True)
