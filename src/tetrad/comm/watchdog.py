"""The collective watchdog: a call that does not complete in time is named, and the job ends.

A rank whose peer died, hangs or never reaches the same collective would wait forever
(NCCL) or until the process group's timeout with a message naming neither the operation
nor the group (gloo). `Comm` arms the watchdog around every blocking point: a synchronous
collective, an async one's wait, and on a GPU the host syncs where a hung kernel shows
(`Comm.watching`: the step's one `.tolist()`); a daemon thread checks it, and one still
armed after `timeout` seconds is reported (to the launcher, see `tetrad.errors`) and ends
this process, so the launcher tears the job down instead of waiting.

Before ending, the rank asks every rank for its recent collectives (`comm.ledger`): each
rank's watchdog thread looks for that request at every poll, whatever its main thread is
doing, and writes its trace; the stuck rank waits a moment for them, so the launcher can
name the rank that is behind. On NCCL each trace also carries PyTorch's flight recorder
(what the device ran), recorded because `nccl_environment` turned it on before the
process group existed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

from tetrad.comm.ledger import Call, Ledger
from tetrad.errors import (
    EXIT_FAILED,
    REPORT_DIR,
    rank_and_attempt,
    report,
    request_traces,
    traces_requested,
    traces_written,
    write_trace,
)

TRACES_WAIT_S = 5.0  # how long a stuck rank waits for the others' traces before it exits
FLIGHT_RECORDS = 2000  # NCCL flight recorder entries per rank


def exit_stuck(message: str) -> None:
    """The default reaction: report the stuck call and end the process once every rank's
    trace is written or `TRACES_WAIT_S` has passed (a thread cannot interrupt the main
    thread's blocked call)."""
    print(f"tetrad: error: {message}", file=sys.stderr, flush=True)
    report("error", message, EXIT_FAILED)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + TRACES_WAIT_S
    while traces_written() < world and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(EXIT_FAILED)


class Watchdog:
    """Fires `on_stuck(message)` when one armed call has lasted longer than `timeout` s,
    after writing this rank's trace and asking the others for theirs."""

    def __init__(self, timeout: float, on_stuck: Callable[[str], None] = exit_stuck):
        if timeout <= 0:
            raise ValueError(f"collective timeout must be > 0 seconds, got {timeout}")
        self.timeout, self.on_stuck = timeout, on_stuck
        self.ledger = Ledger()  # the Comm this watchdog serves numbers its calls here
        self._armed: tuple[object, float] | None = None
        self._traced = False
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="tetrad-watchdog", daemon=True).start()

    def arm(self, what) -> None:
        """Start timing a blocking call: `what` is its ledger `Call` or a description."""
        self._armed = (what, time.monotonic())

    def disarm(self) -> None:
        self._armed = None

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):  # the poll interval
            armed = self._armed  # one read: the main thread may disarm meanwhile
            if armed is not None and time.monotonic() - armed[1] > self.timeout:
                self._fire(armed[0])
                self._armed = None
            elif not self._traced and traces_requested():
                self.trace(armed[0] if armed else None)

    def _fire(self, what) -> None:
        message = (
            f"rank {rank_and_attempt()[0]}: {describe(what)} did not complete within "
            f"{self.timeout:g} s (a peer is stuck, dead or in another collective); see --timeout"
        )
        self.trace(what)
        request_traces()
        self.on_stuck(message)

    def trace(self, waiting) -> None:
        """Write this rank's recent collectives (and NCCL's flight recorder) for the
        launcher, once; `waiting`: the call this rank is blocked in, if any."""
        self._traced = True
        record = self.ledger.snapshot(waiting if isinstance(waiting, Call) else None)
        if not isinstance(waiting, Call) and waiting is not None:
            record["blocked_in"] = describe(waiting)
        write_trace(record | {"nccl_flight_recorder": nccl_flight_record()})


def describe(what) -> str:
    """'all_reduce over data (ranks [0, 1])' from a ledger Call; a string as it is."""
    return what.describe() if isinstance(what, Call) else str(what)


def nccl_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The NCCL settings a rank needs before its process group exists (set where unset;
    the user's own win): async error handling on, so a timed-out collective aborts its
    communicator and ends the process instead of hanging it; the flight recorder on and
    dumped on PyTorch's own timeout, into the launcher's report directory when there is
    one. Returns what it set."""
    env = os.environ if environ is None else environ
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDS),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    if env.get(REPORT_DIR):
        _, attempt = rank_and_attempt()
        prefix = os.path.join(env[REPORT_DIR], f"nccl-flight-attempt{attempt:03d}-rank")
        wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = prefix  # torch appends the rank
    set_now = {k: v for k, v in wanted.items() if k not in env}
    env.update(set_now)
    return set_now


def nccl_flight_record() -> dict | str | None:
    """PyTorch's NCCL flight recorder, parsed from its JSON dump (None off NCCL, or where
    this torch has no JSON dump: the function's name changed across versions, so it is
    looked up; a message if the dump failed)."""
    import torch.distributed as dist

    c10d = torch._C._distributed_c10d
    names = ("_dump_fr_trace_json", "_dump_nccl_trace_json")  # the newer name first
    dump = next((getattr(c10d, n) for n in names if hasattr(c10d, n)), None)
    if dump is None or not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return None
    try:
        raw = dump(includeCollectives=True, onlyActive=False)  # bytes of JSON
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except Exception as e:  # a failing dump must not hide the hang it reports
        return f"flight recorder dump failed: {e}"
