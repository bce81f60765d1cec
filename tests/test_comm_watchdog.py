"""The collective watchdog names a call that outlives its timeout, and only such a call."""

from __future__ import annotations

import time

from tetrad.comm.watchdog import Watchdog
from tetrad.mesh import Group


def test_a_stuck_call_is_named_and_a_quick_one_is_not():
    fired: list[str] = []
    dog = Watchdog(0.4, on_stuck=fired.append)
    try:
        dog.arm(("all_reduce", Group("data", [0, 1], 0)))
        dog.disarm()  # completed in time
        time.sleep(0.8)
        assert fired == []
        dog.arm(("all_gather", Group("fsdp", [2, 3], 1)))
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.close()
    (message,) = fired
    assert "all_gather over fsdp (ranks [2, 3]) did not complete within 0.4 s" in message
