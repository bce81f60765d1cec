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
# A nominal CPU core: 2 FMA units x 8 fp32 lanes x 2 FLOPs x 2.5 GHz = 80 GFLOP/s (AVX2).
# It is a declared yardstick, not a measurement; `train.peak_tflops` overrides it.
CPU_CORE_TFLOPS = 0.08


def peak_tflops(device: torch.device, dtype: str) -> float:
    """Declared peak of one device (one rank) for `dtype`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for (kind, dt), tflops in PEAK_TFLOPS.items():
            if kind in name and dt == dtype:
                return tflops
        return PEAK_TFLOPS[("H100", dtype)]
    return CPU_CORE_TFLOPS * torch.get_num_threads()
