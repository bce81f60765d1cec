"""The cluster model: links, NCCL's latency at scale, and calibration from a bench result;
no processes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tetrad.plan.hardware import calibrated, cluster_preset

ROOT = Path(__file__).resolve().parents[1]


def test_links_follow_the_cluster():
    c = cluster_preset("h100")
    assert c.intra.bw_Bps / c.intra.line_Bps == pytest.approx(370 / 450)  # REFERENCE: NVLink4
    assert c.link(1, 8) is c.intra  # a tp group of 8 stays on NVLink
    assert c.link(8, 4).bw_Bps == c.inter.bw_Bps  # one member per node: one NIC
    assert c.link(2, 16).bw_Bps == 4 * c.inter.bw_Bps  # four members per node: four NICs
    assert c.link(1, 64).bw_Bps == c.intra.bw_Bps  # eight NICs' worth, NVLink-bound
    nbytes = 1e9
    assert c.intra.time("all_reduce", 8, nbytes) == pytest.approx(
        8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * nbytes / c.intra.bw_Bps  # NCCL's tuning model
    )


def test_latency_at_scale():
    """A ring over n ranks pays n - 1 steps, the node-crossing ones at the network's 14 us
    (NCCL's model): an all-gather over 1,536 A100s (192 nodes) spends about 6.3 ms in
    latency alone, whatever the bytes; an all-reduce takes NCCL's tree once it is faster,
    its latency growing with log2 of the nodes."""
    c = cluster_preset("a100")
    link = c.link(1, 1536)
    assert link.nodes == 192
    latency = link.time("all_gather", 1536, 0.0)
    assert latency == pytest.approx(8.4e-6 + (1535 - 191) * 3.4e-6 + 191 * 14e-6)
    assert c.link(1, 384).time("all_gather", 384, 0.0) < latency / 3.5  # linear in ranks
    tree = link.time("all_reduce", 1536, 0.0)
    assert tree == pytest.approx(8.4e-6 + 2 * (7 * 3.4e-6 + math.log2(192) * 14e-6))
    transfer = 2 * 1535 / 1536 / link.bw_Bps  # seconds a buffer byte
    ring_latency = 8.4e-6 + (3070 - 382) * 3.4e-6 + 382 * 14e-6
    for nbytes in (4e9, 40e9):  # the tree wins at 4 GB; at 40 GB the ring's bandwidth does
        want = min(ring_latency + transfer * nbytes, tree + transfer * nbytes / 0.9)
        assert link.time("all_reduce", 1536, nbytes) == pytest.approx(want)
    assert link.time("all_reduce", 1536, 40e9) == pytest.approx(ring_latency + transfer * 40e9)


def test_calibration_from_a_bench_json(tmp_path):
    src = ROOT / "docs" / "results" / "comm_nproc2.json"  # a `tetrad bench comm` result
    cpu = calibrated(cluster_preset("cpu"), src)
    fit = json.loads(src.read_text())["alpha_beta"]["all_reduce"]
    want = fit["alpha_s"] + 1e6 / fit["busbw_beta_Bps"]  # n = 2: bus bytes = buffer bytes
    assert cpu.intra.time("all_reduce", 2, 1e6) == pytest.approx(want)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="alpha_beta"):
        calibrated(cluster_preset("cpu"), bad)
