"""The spawn helper's collection of rank results (tetrad.testing), without processes."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest

from tetrad import testing
from tetrad.testing import _collect


def test_a_result_still_in_the_pipe_when_its_rank_has_exited_is_read():
    """A rank puts its result and exits; under load the parent's read may time out just
    before the bytes arrive: the rank's exit must not be taken for a lost result."""
    results: queue.Queue = queue.Queue()
    procs = [SimpleNamespace(exitcode=0)]  # already gone
    threading.Timer(0.8, results.put, args=((0, True, "done"),)).start()
    assert _collect(procs, results, 1, timeout=30) == ["done"]


def test_a_rank_that_exits_without_a_result_is_named(monkeypatch):
    monkeypatch.setattr(testing, "EXIT_GRACE_S", 0.2)
    procs = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=3)]
    results: queue.Queue = queue.Queue()
    results.put((0, True, "ok"))
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3 without a result"):
        _collect(procs, results, 2, timeout=30)
