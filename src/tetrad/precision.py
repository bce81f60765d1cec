"""The dtypes a step's parts are kept in, from the compute dtype alone.

Compute runs in `train.dtype` (bf16, fp32, or fp64 to verify). What must not round like
the compute (master weights, softmax and norm statistics, loss sums, accumulators) is kept
*wide*: float32 beneath fp64, float64 under fp64. fp64 is a verification dtype: with every
part in float64 (model, optimizer, reductions, collectives; gloo carries it), two layouts
differ by float64 round-off alone, about 1e-16 relative per operation, so the equivalence
tests hold them to 1e-10 whatever the CPU's kernels (docs/architecture.md, "Bounds").
"""

from __future__ import annotations

import torch


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics, sums and master weights are kept in beside compute `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def widen(x: torch.Tensor) -> torch.Tensor:
    """`x` in its wide dtype (itself when already there: fp32 and fp64 are not copied)."""
    return x.to(wide(x.dtype))


def mixed(dtype: torch.dtype) -> bool:
    """Whether compute `dtype` is narrower than its master weights (bf16: fp32 masters)."""
    return dtype != wide(dtype)
