"""`tetrad bench comm`: the size grid and alpha-beta fit (pure), and one small real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tetrad.commbench import fit_alpha_beta, parse_ops, sizes


def test_size_grid():
    assert sizes(1024, 256 * 2**20, 4) == [1024 * 4**i for i in range(10)]
    assert sizes(1024, 8192, 2) == [1024, 2048, 4096, 8192]
    assert sizes(1024, 5000, 4) == [1024, 4096]
    with pytest.raises(ValueError, match="max_bytes=10"):
        sizes(1024, 10, 4)
    with pytest.raises(ValueError, match="factor=1"):
        sizes(1024, 4096, 1)


def test_parse_ops():
    assert parse_ops("all") == ["all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                "send_recv"]  # fmt: skip
    assert parse_ops("broadcast, send_recv") == ["broadcast", "send_recv"]
    with pytest.raises(ValueError, match=r"unknown ops \['gather'\]"):
        parse_ops("all_reduce,gather")


def test_alpha_beta_fit_recovers_the_model():
    alpha, beta = 50e-6, 2e9
    rows = [{"bytes": n, "time_s": alpha + n / beta} for n in sizes(1024, 2**28, 4)]
    fit = fit_alpha_beta(rows)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_Bps"] == pytest.approx(beta, rel=1e-6)
    assert fit["max_rel_err"] < 1e-9


def test_alpha_beta_fit_keeps_alpha_non_negative():
    rows = [{"bytes": n, "time_s": n / 1e9 * (0.5 if n == 1024 else 1.0)} for n in (1024, 4096)]
    fit = fit_alpha_beta(rows)
    assert fit["alpha_s"] == 0.0 and fit["beta_Bps"] > 0


def test_alpha_beta_fit_of_flat_times_is_pure_latency():
    rows = [{"bytes": n, "time_s": t} for n, t in ((1024, 2e-4), (4096, 1e-4), (16384, 1e-4))]
    fit = fit_alpha_beta(rows)
    assert fit["beta_Bps"] is None and 1e-4 < fit["alpha_s"] < 2e-4


def tetrad(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tetrad.cli", *args], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.distributed
def test_bench_comm_small(tmp_path):
    path = tmp_path / "comm.json"
    res = tetrad(
        "bench", "comm", "--nproc", "2", "--max-bytes", "16384", "--ops", "all_reduce,send_recv",
        "--iters", "3", "--seconds", "0.05", "--json", str(path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report == json.loads(res.stdout[res.stdout.index("{") :])
    assert report["world"] == 2 and report["backend"] == "gloo"
    assert [(r["op"], r["bytes"]) for r in report["results"]] == [
        (op, n) for op in ("all_reduce", "send_recv") for n in (1024, 4096, 16384)
    ]
    for r in report["results"]:
        assert r["time_s"] > 0 and r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])
    assert set(report["alpha_beta"]) == {"all_reduce", "send_recv"}
    assert "busbw" in res.stderr  # the table


def test_bench_bad_flags(capsys):
    from tetrad.cli import main

    assert main(["bench", "comm", "--ops", "all_to_all"]) == 2
    assert "unknown ops ['all_to_all']" in capsys.readouterr().err
    assert main(["bench", "comm", "--min-bytes", "4096", "--max-bytes", "1024"]) == 2
    assert main(["bench", "comm", "--nproc", "1"]) == 2
