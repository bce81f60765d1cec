"""Declared peak throughput of devices, for MFU. GPU figures are the vendors' dense specs."""

from __future__ import annotations

import torch

# dense TFLOP/s by (device kind, dtype)
PEAK_TFLOPS = {
    ("H200", "bf16"): 989.0,
    ("H100", "bf16"): 989.0,
    ("A100", "bf16"): 312.0,
    ("H200", "fp32"): 67.0,
    ("H100", "fp32"): 67.0,
    ("A100", "fp32"): 19.5,
}


def cpu_core_tflops() -> float:
    """Declared fp32 peak of one CPU core: 2 FMA units x SIMD lanes x 2 FLOPs x clock.

    Lanes are 16 with AVX-512, 8 with AVX2, 4 otherwise; the clock is /proc/cpuinfo's
    (2.5 GHz if unknown). A yardstick for MFU, not a measurement; `train.peak_tflops`
    overrides it.
    """
    flags, mhz = "", 2500.0
    try:
        text = open("/proc/cpuinfo").read()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        mhz = float(next(ln for ln in text.splitlines() if ln.startswith("cpu MHz")).split(":")[1])
    except (OSError, StopIteration, ValueError):
        pass
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    return 2 * lanes * 2 * mhz * 1e6 / 1e12


def peak_tflops(device: torch.device, dtype: str) -> float:
    """Declared peak of one device (one rank) for `dtype`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for (kind, dt), tflops in PEAK_TFLOPS.items():
            if kind in name and dt == dtype:
                return tflops
        return PEAK_TFLOPS[("H100", dtype)]
    return cpu_core_tflops() * torch.get_num_threads()
