"""What a real pipeline step did: its timeline, its costs, its activation memory.

`gather_timeline` collects every pp rank's measured compute events into one `Timeline`
(seconds from the step's first start). `estimate_costs` reads per-stage F/B/W times and
the transfer latency off that timeline (medians), and `simulated_timeline` replays the
same schedule in the simulator with those costs, so a measured bubble can be held
against the bubble the schedule itself predicts. `write_timeline` draws both and writes
Chrome traces. (Activation bytes are counted by parallel/activation_meter.py's
`ActivationMeter`, for tetrad's runtimes and the peer in benchmarks/pp.py alike.)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

import torch

from tetrad.comm import Comm
from tetrad.mesh import Group
from tetrad.parallel.pipeline.schedules import Action, build_schedule
from tetrad.parallel.pipeline.simulate import Costs, simulate
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
        mine = [[KINDS.index(e.kind), e.stage, e.microbatch, e.start, e.end] for e in events]
        rows[: len(events)] = torch.tensor(mine, **f64)
    table = torch.empty(group.size * n, 5, **f64)
    comm.all_gather(table, rows, group)
    table = table.view(group.size, n, 5).cpu()
    valid = table[..., 0] >= 0
    t0 = float(table[..., 3][valid].min()) if bool(valid.any()) else 0.0
    every = [  # per rank, its valid rows (floats: tolist of float64)
        [Event(KINDS[int(k)], int(s), int(mb), a - t0, b - t0) for k, s, mb, a, b in t[ok].tolist()]
        for t, ok in zip(table, valid)
    ]
    ranks = [[e for e in ev if e.kind not in COMM_KINDS] for ev in every]
    lane = [[e for e in ev if e.kind in COMM_KINDS] for ev in every]
    return Timeline(ranks, comm=lane, unit="s", schedule=meta.pop("schedule", ""), meta=meta)


# --- costs read off a measured timeline ----------------------------------------------


def estimate_costs(tl: Timeline, n_stages: int, actions: list[list[Action]] | None = None) -> Costs:
    """Per-stage median F, B and W times, the median transfer latency and, given the
    schedule's `actions`, the runtime's fixed overhead per compute and per transfer.

    A full backward (BW) splits evenly into B and W: the simulator only ever adds them.
    Latency samples: a consumer that sat idle until its producer finished, from the
    producer's end to the consumer's start (transfer plus the runtime's bookkeeping).
    Overhead samples: see `estimate_overhead`.
    """
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for events in tl.ranks:
        for e in events:
            kinds = ("B", "W") if e.kind == "BW" else (e.kind,)
            for kind in kinds:
                times[kind, e.stage].append(e.duration / len(kinds))
    f, b, w = ([_median(times[k, s]) for s in range(n_stages)] for k in "FBW")
    comm = _median(transfer_gaps(tl))
    overhead, p2p = estimate_overhead(tl, actions, comm) if actions else (0.0, 0.0)
    return Costs(f, b, w, comm, overhead, p2p)


def estimate_overhead(
    tl: Timeline,
    actions: list[list[Action]],
    comm: float,
    center: Callable[[list[float]], float] = statistics.median,
) -> tuple[float, float]:
    """(per compute, per transfer) host time of the runtime, as the simulator models it.

    Samples: the idle gap before a compute whose input was there in time (made on this
    rank, or its producer ended at least `comm` before this rank's previous compute did),
    so the gap is the runtime's own time: overhead + p2p x (transfers since that compute).
    Fitted robustly: the median gap for each count of transfers (or another `center`),
    then a weighted least-squares line through those (slope clamped at 0, then intercept
    too).
    """
    counts = [_transfers_before_computes(acts) for acts in actions]
    samples: dict[int, list[float]] = {}
    for r, k, prev_end, e, src in _computes(tl):
        if 0 < k < len(counts[r]) and (src is None or src.end + comm <= prev_end):
            samples.setdefault(counts[r][k], []).append(max(e.start - prev_end, 0.0))
    if not samples:
        return 0.0, 0.0
    return _fit_line([(n, center(g), len(g)) for n, g in samples.items()])


def _transfers_before_computes(acts: list[Action]) -> list[int]:
    """For each compute of a rank's list, the sends and receives since the one before."""
    at = [i for i, a in enumerate(acts) if a.is_compute]  # the computes' positions
    return [j - i - 1 for i, j in zip([-1, *at], at)]


def _fit_line(points: list[tuple[int, float, int]]) -> tuple[float, float]:
    """Weighted least squares y = a + b x over (x, y, weight); b >= 0, then a >= 0."""
    total = sum(w for _, _, w in points)
    mx = sum(x * w for x, _, w in points) / total
    my = sum(y * w for _, y, w in points) / total
    var = sum(w * (x - mx) ** 2 for x, _, w in points)
    slope = max(sum(w * (x - mx) * (y - my) for x, y, w in points) / var, 0.0) if var > 0 else 0.0
    return max(my - slope * mx, 0.0), slope


def transfer_gaps(tl: Timeline) -> list[float]:
    """Producer-end to consumer-start gaps where the consumer was waiting for that tensor."""
    return [
        max(e.start - src.end, 0.0) for *_, idle, e, src in _computes(tl) if src and src.end >= idle
    ]


def _computes(tl: Timeline) -> Iterator[tuple[int, int, float, Event, Event | None]]:
    """Per rank r and its k-th compute e: (r, k, the end of the compute before it (0: none),
    e, the compute on another rank that made e's input (None: made here, or no input))."""
    made = {e.made: (r, e) for r, ev in enumerate(tl.ranks) for e in ev if e.kind != "W"}
    for r, events in enumerate(tl.ranks):
        prev_end = 0.0
        for k, e in enumerate(events):
            src = made.get((e.kind[0], e.stage, e.microbatch))  # its input, as on the wire
            yield r, k, prev_end, e, src[1] if src is not None and src[0] != r else None
            prev_end = e.end


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def replay_costs(tl: Timeline, costs: Costs, actions: list[list[Action]] | None = None) -> Costs:
    """`costs` with every compute of the measured `tl` at its own measured duration, and
    the transfers' latency and (given the schedule's `actions`) the runtime's overheads
    at their means: the simulator then replays the step action by action, and what
    separates its timeline from the measured one is what the runtime did between
    computes that the overhead model does not see.

    The per-stage medians leave out the step's jitter (one slow action delays everything
    that waits on it, and medians have no slow ones); the median gaps leave out their
    tail: a rank descheduled when its input arrives (more ranks than cores) starts
    milliseconds late, where the median transfer takes half of one (measured: zb-v at
    pp 4 on 2 cores, median 0.5 ms, mean 2.1 ms), and every such delay lies on a chain."""
    each = {(e.kind, e.stage, e.microbatch): e.duration for ev in tl.ranks for e in ev}
    gaps = transfer_gaps(tl)
    comm = statistics.fmean(gaps) if gaps else costs.comm
    if actions:  # overheads fitted at the given latency
        overhead, p2p = estimate_overhead(tl, actions, costs.comm, statistics.fmean)
        costs = replace(costs, overhead=overhead, p2p=p2p)
    return replace(costs, each=each, comm=comm)


def measure_step(
    events: list[Event], comm: Comm, group: Group, schedule: str, microbatches: int, v: int = 1
) -> tuple[Timeline, Timeline]:
    """(measured, simulated) timelines of one step; a collective over the pp `group`.

    The simulation runs at the step's per-stage median costs and includes the runtime's
    overhead learned from this very step; its meta["bubble_without_overhead"] is the
    prediction from compute and transfer costs alone (what the schedule itself explains)
    and meta["bubble_replayed"] the prediction with every compute at its own measured
    duration and the gaps at their means (`replay_costs`)."""
    measured = gather_timeline(
        events, comm, group, schedule=schedule, microbatches=microbatches, virtual_stages=v
    )
    actions = build_schedule(schedule, group.size, microbatches, v)
    costs = estimate_costs(measured, group.size * v, actions)
    out = simulate(actions, costs, schedule)  # the same schedule at measured costs
    out.unit = "s"
    bare = replace(costs, overhead=0.0, p2p=0.0)
    out.meta["bubble_without_overhead"] = simulate(actions, bare).bubble_fraction
    replayed = replay_costs(measured, costs, actions)
    out.meta["bubble_replayed"] = simulate(actions, replayed).bubble_fraction
    kept = {k: v for k, v in asdict(costs).items() if k != "each"}  # all but per-action overrides
    measured.meta["costs"] = out.meta["costs"] = kept
    return measured, out


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
