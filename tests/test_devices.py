"""The GPU path's checks and clocks, provable without a GPU: pure tests.

torch.cuda's answers are replaced by those of an imagined machine, so each refusal is
shown to happen, with its message, before any process group exists."""

from __future__ import annotations

import pytest
import torch

from tetrad import devices
from tetrad.cli import main
from tetrad.comm import Comm
from tetrad.devices import Clock, pick
from tetrad.mesh import Group
from tetrad.parallel.pipeline.measure import gather_timeline
from tetrad.parallel.pipeline.timeline import Event


def _machine(monkeypatch, gpus: int, name: str = "NVIDIA H100 80GB HBM3", cap=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)


def test_cpu_and_auto_without_cuda(monkeypatch):
    _machine(monkeypatch, 0)
    assert pick("cpu", "fp32", 0.0, 4, 0) == torch.device("cpu")
    assert pick("auto", "bf16", 0.0, 4, 3) == torch.device("cpu")


def test_cuda_without_cuda(monkeypatch):
    _machine(monkeypatch, 0)
    with pytest.raises(ValueError, match="train.device='cuda' but CUDA is not available"):
        pick("cuda", "fp32", 0.0, 1, 0)


def test_more_ranks_than_gpus(monkeypatch):
    _machine(monkeypatch, 2)
    assert pick("auto", "bf16", 0.0, 2, 1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="4 ranks on this node but 2 GPU"):
        pick("cuda", "fp32", 0.0, 4, 0)


def test_unknown_gpu_needs_a_peak(monkeypatch):
    _machine(monkeypatch, 1, name="NVIDIA L4", cap=(8, 9))
    with pytest.raises(ValueError, match="no declared peak for GPU 'NVIDIA L4'.*--peak-tflops"):
        pick("cuda", "bf16", 0.0, 1, 0)
    assert pick("cuda", "bf16", 121.0, 1, 0) == torch.device("cuda", 0)
    _machine(monkeypatch, 1, name="NVIDIA A100-SXM4-80GB", cap=(8, 0))
    assert devices.peak_tflops(torch.device("cuda", 0), "bf16") == 312.0


def test_bf16_needs_ampere(monkeypatch):
    _machine(monkeypatch, 1, name="Tesla V100-SXM2-32GB", cap=(7, 0))
    with pytest.raises(ValueError, match="bf16.*capability 8.0.*7.0"):
        pick("cuda", "bf16", 125.0, 1, 0)
    assert pick("cuda", "fp32", 15.7, 1, 0) == torch.device("cuda", 0)


def test_cli_refuses_before_launching(monkeypatch, capsys):
    _machine(monkeypatch, 1)
    code = main(["train", "--device", "cuda", "--nproc", "2", "--steps", "1"])
    assert code == 2
    assert "tetrad: error: 2 ranks on this node but 1 GPU" in capsys.readouterr().err


# --- device discipline: every tensor handed to a collective is on the compute device ----


def test_comm_refuses_a_tensor_off_the_compute_device():
    comm, solo = Comm("cpu"), Group("pp", [0], 0)
    for call in (
        lambda t: comm.all_reduce(t, solo),
        lambda t: comm.all_gather(t, t, solo),
        lambda t: comm.reduce_scatter(t, t, solo),
        lambda t: comm.broadcast(t, 0, solo),
        lambda t: comm.batch_p2p([("send", t, 1)], solo),
    ):
        with pytest.raises(ValueError, match="a tensor on meta.*compute device cpu"):
            call(torch.empty(2, device="meta"))


def test_paths_put_their_collective_tensors_on_the_compute_device():
    """A tensor made without naming a device would be on the host while a GPU computes.
    Under a default device of "meta" such a tensor lands there instead, and the Comm
    refuses it: the timeline gather passes only if it names the compute device."""
    comm, solo = Comm("cpu"), Group("pp", [0], 0)
    events = [Event("F", 0, 0, 10.0, 11.0), Event("BW", 0, 0, 11.0, 13.0)]
    with torch.device("meta"):
        tl = gather_timeline(events, comm, solo, schedule="1f1b")
    assert [(e.kind, e.start, e.end) for e in tl.ranks[0]] == [("F", 0.0, 1.0), ("BW", 1.0, 3.0)]
    with pytest.raises(ValueError, match="compute device"), torch.device("meta"):
        comm.all_reduce(torch.zeros(1), solo)  # what the check exists to catch


def test_metrics_agreement_and_bench_use_the_compute_device():
    """The same proof for the metrics row, the checkpoint agreement and bench comm's
    agreement on the slowest rank (a single process: the collectives are local)."""
    from harness import tiny_config, trainer_for
    from tetrad.commbench import _slowest
    from tetrad.train import checkpoint
    from tetrad.train.loop import StepResult

    trainer = trainer_for(tiny_config(), 0)
    with torch.device("meta"):
        row = trainer.metrics(StepResult(1.0, 2.0, 64, False), 0.5, 100.0)
        checkpoint.agree(trainer.engine, None, "save")
        slowest = _slowest(0.25, trainer.comm, Group("world", [0], 0))
    assert row["step_time_s"] == 0.5 and row["comm_bytes"] == 100.0 and slowest == 0.25


def test_host_clock():
    clock = Clock(torch.device("cpu"))
    clock.drain()  # nothing to wait for on CPU
    a = clock.mark()
    b = clock.mark()
    assert clock.interval(a, b) >= 0 and clock.seconds(b) == b
