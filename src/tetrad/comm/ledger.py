"""The ledger: each rank's recent collectives, numbered per group, for naming a hang.

Every rank issues the same collectives on a group in the same order (NCCL and gloo match
them by that order), so the count of collectives a rank has issued on a group, its
sequence number, says how far it got: when a collective hangs, the members whose number
is lower than the others' are the ones behind, and the others wait in the collective
numbered with theirs. `Comm` numbers every collective it issues (barriers included;
point-to-point transfers are kept in the ring unnumbered: pipeline stages make different
numbers of them) and keeps the last `size` in a ring buffer, which the watchdog dumps on a
timeout (`tetrad.errors.write_trace`). On NCCL a call's "done" is the host's view: the
work was handed to the device; PyTorch's flight recorder, dumped beside, has the device's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from tetrad.mesh import Group

RING = 64  # collectives kept per rank


@dataclass
class Call:
    """One collective as this rank issued it; `seq` 0 for point-to-point batches."""

    op: str
    group: str
    ranks: list[int]
    seq: int
    bytes: int
    done: bool = False

    def describe(self) -> str:
        """'all_reduce over data (ranks [0, 1])', as the watchdog names a stuck call."""
        shown = self.ranks if len(self.ranks) <= 16 else f"[{self.ranks[0]}, ..., {self.ranks[-1]}]"
        return f"{self.op} over {self.group} (ranks {shown})"


class Ledger:
    """Per-group sequence numbers and a ring of the last `size` calls."""

    def __init__(self, size: int = RING):
        self.seq: dict[str, int] = {}
        self.ranks: dict[str, list[int]] = {}
        self.ring: deque[Call] = deque(maxlen=size)

    def issue(self, op: str, group: Group, nbytes: int, numbered: bool = True) -> Call:
        """Record a call about to be issued on `group`; mark it `done` once it returned."""
        seq = 0
        if numbered:
            # the ranks before the number: a snapshot reads that
            self.ranks.setdefault(group.name, list(group.ranks))
            seq = self.seq[group.name] = self.seq.get(group.name, 0) + 1
        call = Call(op, group.name, group.ranks, seq, nbytes)  # a group's ranks never change
        self.ring.append(call)
        return call

    def snapshot(self, waiting: Call | None = None) -> dict:
        """What a trace holds: per group its ranks and last number, the recent calls, and
        the call this rank is blocked in (None: it is not blocked in one)."""
        # copies first (taken whole under the GIL): the watchdog's thread reads while the
        # main thread may be issuing the next call
        seq, ranks, ring = dict(self.seq), dict(self.ranks), list(self.ring)
        return {
            "groups": {g: {"ranks": ranks[g], "seq": s} for g, s in seq.items()},
            "recent": [asdict(c) for c in ring],
            "waiting": asdict(waiting) if isinstance(waiting, Call) and waiting.seq else None,
        }
