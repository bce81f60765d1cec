"""Timelines: the shared record, its Chrome trace and its picture."""

from __future__ import annotations

import json

import pytest

from tetrad.parallel.pipeline.simulate import Costs, simulate_schedule
from tetrad.parallel.pipeline.timeline import (
    Event,
    Timeline,
    plot_timeline,
    save_chrome_trace,
    to_chrome_trace,
)


def _measured() -> Timeline:
    """What a runtime would record: wall-clock seconds, starting anywhere."""
    t0 = 1000.0
    return Timeline(
        [
            [Event("F", 0, 0, t0, t0 + 1), Event("BW", 0, 0, t0 + 4, t0 + 6)],
            [Event("F", 1, 0, t0 + 1, t0 + 2), Event("BW", 1, 0, t0 + 2, t0 + 4)],
        ],
        unit="s",
        schedule="1f1b",
    )


def test_timeline_metrics():
    t = _measured()
    assert t.pp == 2 and t.makespan == 6
    assert t.busy(0) == 3 and t.busy(1) == 3
    assert t.bubble_fraction == pytest.approx(0.5)
    assert t.bubble_time == 3
    assert t.peak_activations() == [1, 1]
    assert Timeline([[]]).bubble_fraction == 0.0


def test_chrome_trace(tmp_path):
    t = simulate_schedule("zb-h1", 3, 4, Costs(1, 1, 1))
    trace = to_chrome_trace(t, us_per_unit=1000)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * 4 * 3
    assert {e["pid"] for e in spans} == {0, 1, 2}
    assert {e["cat"] for e in spans} == {"F", "B", "W"}
    first = min(spans, key=lambda e: (e["pid"], e["ts"]))
    assert first == {
        "name": "F0", "cat": "F", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1000.0,
        "args": {"stage": 0, "microbatch": 0},
    }  # fmt: skip
    path = tmp_path / "trace.json"
    save_chrome_trace(_measured(), str(path))
    loaded = json.loads(path.read_text())
    assert loaded["otherData"]["bubble_fraction"] == pytest.approx(0.5)
    assert max(e.get("ts", 0) + e.get("dur", 0) for e in loaded["traceEvents"]) == 6e6


def test_plot_png(tmp_path):
    path = tmp_path / "timeline.png"
    simulated = simulate_schedule("1f1b", 2, 1, Costs(1, 1, 1))
    plot_timeline({"measured": _measured(), "simulated": simulated}, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_communication_lane(tmp_path):
    """Collectives form their own lane: in the trace as a "communication" thread of the
    rank, in the picture as a strip; the bubble counts compute only."""
    t = _measured()
    t0 = 1000.0
    t.comm = [[Event("RS", -1, -1, t0 + 5, t0 + 7)], [Event("AR", -1, -1, t0 + 3.5, t0 + 4.5)]]
    assert t.bubble_fraction == pytest.approx(0.5) and t.makespan == 6
    trace = to_chrome_trace(t)["traceEvents"]
    lane = [e for e in trace if e.get("cat") == "comm"]
    assert [(e["pid"], e["tid"], e["name"]) for e in lane] == [(0, 1, "RS"), (1, 1, "AR")]
    assert lane[0]["ts"] == pytest.approx(5e6) and lane[0]["dur"] == pytest.approx(2e6)
    names = [e for e in trace if e.get("name") == "thread_name"]
    assert {e["pid"] for e in names} == {0, 1}
    path = tmp_path / "lane.png"
    plot_timeline({"with comm": t}, str(path))
    assert path.stat().st_size > 0
