"""Stopping on a signal: SIGTERM or SIGINT asks every rank to finish the step, save, and exit.

The request is noticed by a thread that reads the signal's byte from a wakeup descriptor
(`signal.set_wakeup_fd`), so it is seen even while the main thread is blocked in a
collective. The trainer adds the flag to the all-reduce every step already makes, so all
ranks agree to stop after the same step (one decision, every rank), save a checkpoint and
raise `Preempted`. A process still alive `grace` seconds after the signal is stuck (a peer
died mid-collective, or a step hangs): it exits. A second signal, or one outside the
training loop (starting, loading: nothing to agree on or save), exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from tetrad.errors import rank_and_attempt, report

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Every rank stopped on a signal after `step` steps, with a checkpoint at `path`."""

    def __init__(self, step: int, path: Path, signum: int):
        self.step, self.path, self.signum = step, path, signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; checkpoint {path} saved")


class StopRequest:
    """Whether a stop was asked for, and by which signal. `install()` wires it to signals."""

    def __init__(self, grace: float = 30.0):
        self.grace = grace
        self.signum: int | None = None  # set once, by the first signal (nobody waits on it)
        self._restore: tuple | None = None  # what install() replaced
        self._timer: threading.Timer | None = None
        self.deferring = False  # while the trainer's steps can agree on a stop: `deferred`

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """While inside, a signal is agreed on by the steps and saved for, not fatal at once
        (the trainer's loop)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def request(self, signum: int) -> None:
        """Ask for a stop (what a signal does). Outside the training loop (starting, loading,
        leaving: nothing to agree on or save), or a second time, it ends the process now."""
        if self.requested or not self.deferring:
            os._exit(128 + signum)
        self.signum = signum
        self._timer = threading.Timer(self.grace, self._expire, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, signum: int) -> None:
        rank, _ = rank_and_attempt()
        message = (
            f"rank {rank}: still running {self.grace:g} s after {signal.Signals(signum).name}"
            " (stuck in a step or a collective): exiting without a checkpoint"
        )
        print(f"tetrad: {message}", file=sys.stderr, flush=True)
        report("stopped", message, 128 + signum)
        os._exit(128 + signum)

    def install(self) -> None:
        """Route SIGTERM and SIGINT here (main thread only) until `uninstall()`."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        old = {sig: signal.getsignal(sig) for sig in SIGNALS}
        for sig in SIGNALS:
            signal.signal(sig, lambda *_: None)  # the watcher thread acts; not the main one
        self._restore = (old_fd, old, reader, writer)
        threading.Thread(target=self._watch, args=(reader,), daemon=True).start()

    def uninstall(self) -> None:
        """Give the signals back to whoever had them (a test process, an embedding program);
        a stop that got this far is not stuck: its deadline is cancelled."""
        if self._timer is not None:
            self._timer.cancel()
        if self._restore is None:
            return
        old_fd, old, reader, writer = self._restore
        signal.set_wakeup_fd(old_fd)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        writer.close()  # ends the watcher's recv
        self._restore = None

    def _watch(self, reader: socket.socket) -> None:
        with reader:
            while data := reader.recv(64):
                for signum in data:
                    if signum in SIGNALS:
                        self.request(signum)
