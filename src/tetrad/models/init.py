"""Layout-invariant initialisation: a parameter's full value is a function of (seed, name).

Every layout builds the model on the meta device, shards it, then asks `materialize` to
fill each local tensor with *its slice* of the same full tensor. So a single process and
any layout start from identical weights, which is what makes equivalence testable.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from tetrad.config import ModelConfig
from tetrad.models.families import spec_for

# name -> index into the full tensor (a tuple of slices), or None for "the whole tensor"
Slicer = Callable[[str], tuple[slice, ...] | None]


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, parameter name), stable across processes and Python runs."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def full_value(seed: int, name: str, shape: tuple[int, ...], cfg: ModelConfig) -> torch.Tensor:
    """The full, unsharded float32 initial value of parameter `name`: a norm gain ones, a
    bias zeros (as Hugging Face's Qwen2 and Megatron start them), else normal."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        # residual-branch outputs scaled down with depth (GPT-2 / Megatron)
        std = cfg.init_std / math.sqrt(2 * cfg.layers)
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


def full_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of the logical (unsharded) parameter `name`, as its model family declares it."""
    return spec_for(cfg).full_shape(name, cfg)


@torch.no_grad()
def materialize(
    model: nn.Module,
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
    slicer: Slicer | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Allocate `model`'s (meta) parameters on `device` in `dtype` (its master weights':
    float32, or float64 to verify) and fill each with its slice of the float32 init."""
    model.to_empty(device=device).to(dtype)  # buffers too: a router's bias, updated in it
    for name, p in model.named_parameters():
        full = full_value(seed, name, full_shape(name, cfg), cfg)
        index = slicer(name) if slicer else None
        value = full[index] if index is not None else full
        if value.shape != p.shape:
            raise ValueError(f"{name}: slice {tuple(value.shape)} != local shape {tuple(p.shape)}")
        p.copy_(value.to(dtype))
    for b in model.buffers():  # a family's running state (the MoE router's bias) starts at 0
        b.zero_()
    return model


def build_model(cfg: ModelConfig, seed: int, device: str = "cpu") -> nn.Module:
    """Single-process convenience: build on meta and materialise the full model."""
    return materialize(spec_for(cfg).build(cfg), cfg, seed, device)
