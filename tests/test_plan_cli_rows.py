"""`tetrad plan`'s memory rows (plan/cli.py `memory_rows`): what the table says of a peak."""

from __future__ import annotations

from tetrad.plan.cli import memory_rows
from tetrad.plan.hardware import GiB


def test_memory_rows_name_what_the_peak_holds_reserved():
    """A moment's reserved bytes (an eager loss's freed logits) get their own row, apart
    from the workspace and allocator share, and the rows still add up to the total."""
    mem = {
        "model_state": 4 * GiB, "activations": 30 * GiB, "allocated": 58 * GiB,
        "total": 68 * GiB, "capacity": 89 * GiB, "fits": True,
        "peak": {"moment": "loss backward", "terms": [("loss chunk, backward", 24 * GiB)],
                 "reserved": [("freed logits' space", 4 * GiB)]},
    }  # fmt: skip
    rows = dict(memory_rows(mem))
    assert rows["  reserved: freed logits' space"] == "+4.00 GiB"
    assert rows["  workspace and allocator"] == "+6.00 GiB"  # 68 - 58 - 4
    assert rows["memory: peak / capacity"].startswith("68.00 / 89.0 GiB")
