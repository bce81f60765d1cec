"""A rank's transfer program as the runtime runs it, for the checker (pure).

`p2p.program` says where each wait is; the runtime postpones gradient sends' waits
(`as_run`), and between the transfers it issues collectives on other communicators: TP's
and CP's inside computes, DP's and ZeRO's reductions from each stage's last backward work
(`with_collectives`). `check.check_program` proves the programs with both.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tetrad.parallel.pipeline.p2p import Item, Wait
from tetrad.parallel.pipeline.schedules import Action

ActionKey = tuple[str, int, int]  # (kind, stage, microbatch)


@dataclass(frozen=True)
class Collective:
    """A collective on another communicator than the pipeline's, in a rank's issue order:
    inside the compute that follows (`needed`: TP/CP), or launched by the compute before
    (DP/ZeRO reductions, waited for at the step's end)."""

    group: str
    needed: bool


def as_run(items: list[Item], late: int) -> list[Item]:
    """`items` with each gradient send's wait moved where the runtime does it when no send
    reports done early: once more than `late` newer ones are in flight, or at the end."""
    out: list[Item] = []
    pending: list[Action] = []
    for item in items:
        if not isinstance(item, Wait):
            out.append(item)
            continue
        now = tuple(a for a in item.ops if a.kind != "SEND_B")
        pending += [a for a in item.ops if a.kind == "SEND_B"]
        if now:
            out.append(Wait(now))
        if len(pending) > late:
            out.append(Wait(tuple(pending[: len(pending) - late])))
            pending = pending[len(pending) - late :]
    if pending:
        out.append(Wait(tuple(pending)))
    return out


def with_collectives(
    items: list[Item], inner: Collection[str], finals: Collection[ActionKey]
) -> list[Item | Collective]:
    """`items` with the other communicators' collectives in issue order (see `Collective`)."""
    out: list[Item | Collective] = []
    for item in items:
        is_compute = isinstance(item, Action)
        if is_compute and item.kind in inner:
            out.append(Collective("tp/cp", needed=True))
        out.append(item)
        if is_compute and (item.kind, item.stage, item.microbatch) in finals:
            out.append(Collective("dp/fsdp", needed=False))
    return out


def last_backward_work(acts: list[Action]) -> set[ActionKey]:
    """Per stage of a rank's actions, its last B, BW or W: where the runtime launches that
    stage's gradient reductions (`runtime.final_actions`, parameters not shared)."""
    last = {a.stage: (a.kind, a.stage, a.microbatch) for a in acts if a.kind in ("B", "BW", "W")}
    return set(last.values())  # per stage, the later action overwrote the earlier
