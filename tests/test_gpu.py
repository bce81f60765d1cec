"""The GPU tier: what only a GPU can show (skipped without one; scripts/gpu_check.sh runs
it). NCCL's semantics are proven without a GPU in test_pp_p2p.py; here they meet
the real thing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tetrad.comm import Comm
from tetrad.devices import Clock
from tetrad.mesh import Group

pytestmark = pytest.mark.cuda
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def two_gpus(test):
    """Needs 2 GPUs, and starts 2 ranks through torchrun."""
    return pytest.mark.distributed(pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")(test))


def test_clock_times_the_device_not_the_launch():
    clock = Clock(torch.device("cuda", 0))
    t0 = time.perf_counter()
    a = clock.mark()
    torch.cuda._sleep(100_000_000)  # ~0.05-0.1 s of GPU time, enqueued in microseconds
    b = clock.mark()
    launch = time.perf_counter() - t0
    device = clock.interval(a, b)
    assert device > 0.01 and launch < device / 5, (device, launch)
    assert clock.seconds(b) - clock.seconds(a) == pytest.approx(device, rel=1e-6)


def test_comm_refuses_a_host_tensor():
    comm = Comm(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="a tensor on cpu.*compute device cuda:0"):
        comm.all_reduce(torch.zeros(1), Group("world", [0], 0))


def test_bf16_steps_on_one_gpu():
    from harness import tiny_config
    from tetrad.mesh import Mesh
    from tetrad.train.loop import Trainer

    cfg = tiny_config(train={"dtype": "bf16", "device": "cuda", "peak_tflops": 1.0})
    trainer = Trainer(cfg, Mesh.build(cfg.parallel, 0), torch.device("cuda", 0))
    losses = [trainer.train_step().loss for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def _train(tmp_path, name: str, *flags: str) -> list[float]:
    out = tmp_path / name
    argv = [
        sys.executable,
        "-m",
        "tetrad.cli",
        "train",
        "--model",
        "tiny",
        "--device",
        "cuda",
        "--data",
        "synthetic",
        "--steps",
        "3",
        "--global-batch",
        "4",
        "--seq-len",
        "32",
        "--no-progress",
        "--out",
        str(out),
        *flags,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@two_gpus
@pytest.mark.parametrize(
    "flags",
    [
        ("--pp-schedule", "1f1b", "--microbatches", "1"),  # the old order's deadlock
        ("--pp-schedule", "zb-h1", "--microbatches", "4"),
        ("--pp-schedule", "zb-v", "--virtual-stages", "2", "--microbatches", "2"),
        ("--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2", "--microbatches", "4")
        + ("--layers", "4"),
    ],
)
def test_pipeline_over_nccl_matches_one_gpu(tmp_path, flags):
    mb = flags[flags.index("--microbatches") + 1]
    model = flags[flags.index("--layers") :][:2] if "--layers" in flags else ()
    ref = _train(tmp_path, "one", "--nproc", "1", "--microbatches", mb, *model)
    got = _train(tmp_path, "pp", "--nproc", "2", "--pp", "2", "--timeline", str(tmp_path), *flags)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)
    assert (tmp_path / "timeline.json").exists()  # the timeline gather ran over NCCL


@two_gpus
def test_a_rank_behind_is_named_over_nccl(tmp_path):
    """Rank 1 sleeps at step 2 before its collectives: rank 0 enqueues its own and blocks
    in the step's host sync, which the watchdog watches; every rank's trace names rank 1."""
    faults = str(Path(__file__).parent / "faults")
    env = dict(os.environ, TETRAD_TEST_FAULT="hang:1:2")
    env["PYTHONPATH"] = os.pathsep.join([faults, env.get("PYTHONPATH", "")])
    out = tmp_path / "hang"
    argv = [sys.executable, "-m", "tetrad.cli", "train", "--model", "tiny", "--device", "cuda",
            "--data", "synthetic", "--steps", "20", "--nproc", "2", "--dp", "2",
            "--timeout", "5", "--no-progress", "--out", str(out)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "did not complete within 5 s" in proc.stderr
    behind = [x for x in proc.stderr.splitlines() if x.startswith("tetrad: behind on data")]
    assert behind and "rank 1 at #" in behind[0] and "ranks [0] wait in" in behind[0], proc.stderr
    assert time.monotonic() - t0 < 120  # the watchdog's 5 s, not NCCL's timeout
    traces = list((out / "logs").glob("reports-*/trace-*.json"))
    assert len(traces) == 2
    assert all(json.loads(p.read_text())["nccl_flight_recorder"] for p in traces)


@two_gpus
def test_bench_comm_over_nccl(tmp_path):
    path = tmp_path / "bench.json"
    argv = [
        sys.executable,
        "-m",
        "tetrad.cli",
        "bench",
        "comm",
        "--nproc",
        "2",
        "--max-bytes",
        str(2**20),
        "--json",
        str(path),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["backend"] == "nccl" and all(r["time_s"] > 0 for r in report["results"])
