"""What a pipeline step looked like: compute intervals per rank, simulated or measured.

`Timeline` is the one record that the simulator returns and the runtime fills in with
measured times, so both export to the same Chrome trace and draw the same picture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_COLOURS = {"F": "#4c78c8", "B": "#7fc9d9", "W": "#8cc97e", "BW": "#e8a05c"}
# the communication lane: async collectives (all-reduce, reduce-scatter, all-gather, and
# expert parallelism's dispatch all-to-all)
COMM_KINDS = ("AR", "RS", "AG", "A2A")
_COMM_COLOURS = {"AR": "#c0392b", "RS": "#8e44ad", "AG": "#7f8c8d", "A2A": "#d4ac0d"}


@dataclass(frozen=True)
class Event:
    """One compute action as it ran: kind F/B/W/BW, its stage and microbatch, and its
    start and end in the timeline's unit, measured from the step's start."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def made(self) -> tuple[str, int, int] | None:
        """The tensor this compute makes for a neighbouring stage, keyed as on the wire
        (`schedules.wire`: F or B, the stage it feeds, the microbatch); None for a W."""
        if self.kind == "W":
            return None
        return (self.kind[0], self.stage + (1 if self.kind == "F" else -1), self.microbatch)


@dataclass
class Timeline:
    """Per-rank compute events of one pipeline step, and its communication lane.

    ranks: ranks[r] holds rank r's events in execution order.
    comm: comm[r] holds rank r's async collectives (kinds in COMM_KINDS, launched to
      completed; stage and microbatch -1), drawn in a lane of their own; idle time and
      the bubble count compute only. Empty for the simulator.
    unit: "s" for measured seconds; "cost" for the simulator's cost units.
    schedule: the schedule's name, for titles.
    meta: free-form extras a recorder wants to keep (step, microbatches, ...).
    """

    ranks: list[list[Event]]
    comm: list[list[Event]] = field(default_factory=list)
    unit: str = "s"
    schedule: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def pp(self) -> int:
        return len(self.ranks)

    @property
    def start(self) -> float:
        return min((e.start for events in self.ranks for e in events), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end, over all ranks."""
        end = max((e.end for events in self.ranks for e in events), default=0.0)
        return end - self.start

    def busy(self, rank: int) -> float:
        """Total compute time of one rank."""
        return sum(e.duration for e in self.ranks[rank])

    @property
    def bubble_fraction(self) -> float:
        """1 - busy compute time / (pp x makespan): the share of the step idle."""
        return self.bubble_time / self.makespan if self.makespan else 0.0

    @property
    def bubble_time(self) -> float:
        """Idle time per rank, averaged over ranks."""
        return self.makespan - sum(self.busy(r) for r in range(self.pp)) / self.pp

    def peak_activations(self) -> list[int]:
        """Per rank, the most (stage, microbatch) pairs whose F has run but whose B or
        BW has not: the stashed activations. With one stage per rank, microbatches."""
        return [_peak(events, opens=("F",), closes=("B", "BW")) for events in self.ranks]

    def peak_pending_w(self) -> list[int]:
        """Per rank, the most (stage, microbatch) pairs with B done and W not yet run."""
        return [_peak(events, opens=("B",), closes=("W",)) for events in self.ranks]


def _peak(events: list[Event], opens: tuple[str, ...], closes: tuple[str, ...]) -> int:
    live: set[tuple[int, int]] = set()
    peak = 0
    for e in sorted(events, key=lambda e: e.start):
        if e.kind in opens:
            live.add((e.stage, e.microbatch))
            peak = max(peak, len(live))
        elif e.kind in closes:
            live.discard((e.stage, e.microbatch))
    return peak


def to_chrome_trace(timeline: Timeline, us_per_unit: float = 1e6) -> dict:
    """Chrome trace event format ("X" events, one process row per rank): Perfetto opens it.

    `us_per_unit` converts the timeline's unit to the format's microseconds (1e6 for
    seconds; simulated cost units are drawn as if they were seconds).
    """
    t0 = timeline.start

    def span(e: Event, rank: int, tid: int) -> dict:
        ts, dur = (e.start - t0) * us_per_unit, e.duration * us_per_unit
        return {"ph": "X", "pid": rank, "tid": tid, "ts": ts, "dur": dur}

    events: list[dict] = []
    for rank, rank_events in enumerate(timeline.ranks):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"pp rank {rank}"}}
        )
        for e in rank_events:
            args = {"stage": e.stage, "microbatch": e.microbatch}
            events.append(
                {"name": f"{e.kind}{e.microbatch}", "cat": e.kind, **span(e, rank, 0), "args": args}
            )
    for rank, rank_events in enumerate(timeline.comm):  # its own thread row per rank
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1,
                       "args": {"name": "communication"}})  # fmt: skip
        events += [{"name": e.kind, "cat": "comm", **span(e, rank, 1)} for e in rank_events]
    meta = {"schedule": timeline.schedule, "bubble_fraction": timeline.bubble_fraction}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def save_chrome_trace(timeline: Timeline, path: str) -> None:
    """Write `to_chrome_trace(timeline)` as JSON to `path`."""
    with open(path, "w") as f:
        json.dump(to_chrome_trace(timeline), f)


def plot_timeline(timelines: dict[str, Timeline], path: str, share_time: bool = False) -> None:
    """Draw one PNG: a subplot per timeline, ranks as rows (rank 0 on top), F/B/W/BW as
    coloured blocks labelled with their microbatch, idle time left white. `share_time`
    puts every subplot on one time axis (a measured run above its simulation)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    rows = sum(max(t.pp, 1) for t in timelines.values())
    fig, axes = plt.subplots(
        len(timelines), 1, figsize=(14, 1.0 + 0.45 * rows + 0.6 * len(timelines)),
        squeeze=False, sharex=share_time,
    )  # fmt: skip
    span = max(t.makespan for t in timelines.values())
    for ax, (title, tl) in zip(axes[:, 0], timelines.items()):
        _draw(ax, title, tl)
        if share_time:
            ax.set_xlim(0, span)
            ax.tick_params(labelbottom=True)  # sharex hides the upper panels' time labels
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw(ax, title: str, tl: Timeline) -> None:
    from matplotlib.patches import Patch

    t0, span = tl.start, tl.makespan or 1.0
    first_stage = [min((e.stage for e in ev), default=0) for ev in tl.ranks]
    height = 0.55 if any(tl.comm) else 0.8  # compute on top, communication in a strip below
    for rank, events in enumerate(tl.comm):
        for e in events:
            ax.broken_barh(
                [(e.start - t0, max(e.duration, span / 500))], (rank + 0.2, 0.2),
                facecolors=_COMM_COLOURS[e.kind], edgecolor="none", alpha=0.6,
            )  # fmt: skip
    for rank, events in enumerate(tl.ranks):
        for e in events:
            # a rank's later chunks (interleaved, zb-v) are drawn hatched
            hatch = "//" if e.stage != first_stage[rank] else None
            ax.broken_barh(
                [(e.start - t0, e.duration)], (rank - 0.4, height),
                facecolors=_COLOURS.get(e.kind, "grey"), edgecolor="black",
                linewidth=0.4, hatch=hatch,
            )  # fmt: skip
            if e.duration > span / 150:
                ax.text(e.start - t0 + e.duration / 2, rank - 0.4 + height / 2, str(e.microbatch),
                        ha="center", va="center", fontsize=7)  # fmt: skip
    ax.set_ylim(tl.pp - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_yticks(range(tl.pp), [f"rank {r}" for r in range(tl.pp)])
    ax.set_xlabel(f"time ({tl.unit})")
    ax.set_title(f"{title}: bubble {100 * tl.bubble_fraction:.1f}% of the step")
    kinds = sorted({e.kind for ev in tl.ranks for e in ev}, key=list(_COLOURS).index)
    handles = [Patch(facecolor=_COLOURS[k], edgecolor="black", label=k) for k in kinds]
    if any(e.stage != first_stage[r] for r, ev in enumerate(tl.ranks) for e in ev):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="later chunk"))
    kinds = sorted({e.kind for ev in tl.comm for e in ev}, key=COMM_KINDS.index)
    handles += [Patch(facecolor=_COMM_COLOURS[k], alpha=0.6, label=f"comm {k}") for k in kinds]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
    )
