"""The collective watchdog: a call that does not complete in time is named, and the job ends.

A rank whose peer died, hangs or never reaches the same collective would wait forever
(NCCL) or until the process group's timeout with a message naming neither the operation
nor the group (gloo). `Comm` arms the watchdog around every blocking call with a
description ("all_reduce over data (ranks [0, 1])"); a daemon thread checks it, and one
still armed after `timeout` seconds is reported (to the launcher, see `tetrad.errors`) and
ends this process, so the launcher tears the job down instead of waiting.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from tetrad.errors import EXIT_FAILED, rank_and_attempt, report


def exit_stuck(message: str) -> None:
    """The default reaction: report the stuck call and end the process at once (a thread
    cannot interrupt the main thread's blocked call)."""
    print(f"tetrad: error: {message}", file=sys.stderr, flush=True)
    report("error", message, EXIT_FAILED)
    os._exit(EXIT_FAILED)


class Watchdog:
    """Fires `on_stuck(message)` when one armed call has lasted longer than `timeout` s."""

    def __init__(self, timeout: float, on_stuck: Callable[[str], None] = exit_stuck):
        if timeout <= 0:
            raise ValueError(f"collective timeout must be > 0 seconds, got {timeout}")
        self.timeout, self.on_stuck = timeout, on_stuck
        self._armed: tuple[object, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tetrad-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what) -> None:
        """Start timing a blocking call: `what` is (op, group) or a description."""
        self._armed = (what, time.monotonic())

    def disarm(self) -> None:
        self._armed = None

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 4)
        while not self._stop.wait(poll):
            armed = self._armed  # one read: the main thread may disarm meanwhile
            if armed is not None and time.monotonic() - armed[1] > self.timeout:
                rank, _ = rank_and_attempt()
                self.on_stuck(
                    f"rank {rank}: {describe(armed[0])} did not complete within {self.timeout:g} s"
                    " (a peer is stuck, dead or in another collective); see --timeout"
                )
                self._armed = None


def describe(what) -> str:
    """'all_reduce over data (ranks [0, 1])' from (op, group); a string as it is."""
    if isinstance(what, tuple):
        op, group = what
        ranks = list(group.ranks)
        shown = ranks if len(ranks) <= 16 else f"[{ranks[0]}, ..., {ranks[-1]}]"
        return f"{op} over {group.name} (ranks {shown})"
    return str(what)
