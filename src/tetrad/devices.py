"""Accelerator kinds: declared peak FLOP rates, memory, bandwidth. One table for all.

The trainer divides by a device's declared peak for MFU; the planner charges that peak
times a calibrated efficiency. Sources of every figure: docs/plan.md.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator kind.

    peak_tflops: declared dense peak by compute dtype; hbm_bytes: memory per device;
    hbm_Bps: memory bandwidth (prices the optimizer step, which is memory-bound);
    efficiency: achievable share of the peak over a training step's FLOPs (calibrated once);
    workspace_bytes: memory outside tensors the planner counts (cuBLAS and NCCL buffers).
    """

    name: str
    peak_tflops: dict[str, float]
    hbm_bytes: float
    hbm_Bps: float
    efficiency: float
    workspace_bytes: float = 1.0 * GiB

    def flops_per_s(self, dtype: str) -> float:
        """The FLOP rate the planner charges: peak x efficiency."""
        if dtype not in self.peak_tflops:
            raise ValueError(f"{self.name} has no {dtype} peak (known: {sorted(self.peak_tflops)})")
        return self.peak_tflops[dtype] * 1e12 * self.efficiency


# fp64 (verification runs): the FP64 tensor-core dense peak of NVIDIA's datasheets; fp8:
# the dense FP8 tensor-core peak (the linears under --fp8), twice bf16's on Hopper
HOPPER = {"bf16": 989.0, "fp32": 67.0, "fp64": 67.0, "fp8": 1979.0}
H100 = Device("h100", HOPPER, 81559 * 2**20, 3.35e12, 0.49)
# torchtitan's benchmark parts (Grand Teton): H100 SXM with 96 GB HBM2e at 2.4 TB/s,
# power-capped at 500 W: the same declared peak, a lower achievable share of it
H100_HBM2E = Device("h100-hbm2e", HOPPER, 96e9, 2.4e12, 0.42)
H200 = Device("h200", HOPPER, 140 * GiB, 4.8e12, 0.49)
A100 = Device("a100", {"bf16": 312.0, "fp32": 19.5, "fp64": 19.5}, 80 * GiB, 2.039e12, 0.62)

GPUS = {d.name: d for d in (H200, H100, H100_HBM2E, A100)}


def cpu_core_tflops() -> float:
    """Declared fp32 peak of one CPU core: 2 FMA units x SIMD lanes x 2 FLOPs x clock.

    Lanes are 16 with AVX-512, 8 with AVX2, 4 otherwise; the clock is /proc/cpuinfo's
    (2.5 GHz if unknown). A yardstick for MFU, not a measurement; `train.peak_tflops`
    overrides it.
    """
    flags, mhz = "", 2500.0
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        mhz = float(next(ln for ln in text.splitlines() if ln.startswith("cpu MHz")).split(":")[1])
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    return 2 * lanes * 2 * mhz * 1e6 / 1e12


def peak_tflops(device: torch.device, dtype: str) -> float:
    """Declared dense peak of one device (one rank) for `dtype`: the preset whose kind the
    CUDA device name contains; on CPU, one core's peak times the torch threads this rank
    uses. An unknown GPU is a ValueError asking for the figure: a guessed peak would make
    every MFU wrong without a word."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = next((d for d in (H200, H100, A100) if d.name in name.lower()), None)
        if kind is None:
            raise ValueError(
                f"no declared peak for GPU {name!r} (known: {sorted(GPUS)}); pass "
                f"--peak-tflops with its dense {dtype} peak in TFLOP/s"
            )
        return kind.peak_tflops[dtype]
    return cpu_core_tflops() * torch.get_num_threads()


def pick(want: str, dtype: str, peak: float, local_ranks: int, local_rank: int) -> torch.device:
    """This rank's compute device ("auto": a GPU if there is one), refused with a
    ValueError before any collective where it cannot serve: CUDA asked for but absent,
    more ranks on this node than GPUs, bf16 on a GPU without it (compute capability < 8.0),
    a GPU whose peak is unknown and not given (`peak` 0)."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"train.device='cuda' but CUDA is not available (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); use --device cpu"
        )
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ValueError(
            f"{local_ranks} ranks on this node but {gpus} GPU(s): each rank needs its own; "
            f"launch at most {gpus} per node, or use --device cpu"
        )
    device = torch.device("cuda", local_rank)
    major, minor = torch.cuda.get_device_capability(device)
    if dtype == "bf16" and major < 8:
        raise ValueError(
            f"dtype='bf16' needs compute capability 8.0 or newer; "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}: use --dtype fp32"
        )
    if not peak:
        peak_tflops(device, dtype)
    return device


class Clock:
    """Timestamps of device work, in seconds on the host's clock.

    On CPU a mark is the host's time. On a GPU the host only enqueues work, so its clock
    would time kernel launches: a mark is a CUDA event recorded on the current stream and
    read after the work ran (after the step's own host sync, so reading waits for
    nothing). Events are placed on the host's clock through one origin taken when the
    clock is made: the device drained once, then an event and the host's time at once (a
    synchronize serves where no event can). Nothing after that drains the device: a
    pipeline step's marks cost an event each, and the clock adds no wait to those a step
    already has (docs/architecture.md, "Where the host waits for the device"). (The GPU's
    and the host's clocks drift apart by parts per million: a
    millisecond an hour, well under a step; `drain` re-takes the origin.)
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._host, self._origin = 0.0, None
        self.drain()  # a GPU's origin (on CPU: nothing)

    def drain(self) -> None:
        """Wait for the device's queued work and re-take the origin (benchmarks: before a
        timed run; never on the training path, which waits only in its host sync)."""
        if self.cuda:
            torch.cuda.synchronize()
            self._origin = self.mark()
            self._host = time.time()

    def mark(self) -> Any:
        """Now, on the device's timeline."""
        if not self.cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: Any) -> float:
        """A mark as seconds since the epoch (on a GPU, waits for the mark's work)."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self._host + self._origin.elapsed_time(mark) / 1e3

    def interval(self, start: Any, end: Any) -> float:
        """Seconds between two marks (on a GPU, waits for the later one)."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3
