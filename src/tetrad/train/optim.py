"""AdamW (torch's) and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from tetrad.config import TrainConfig
from tetrad.models.plans import decays


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(named: list[tuple[str, nn.Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the given parameters, two groups: with and without weight decay."""
    groups = [
        {"params": [p for n, p in named if decays(n)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    # fused: one kernel over every tensor (CPU and CUDA), what torchtitan picks
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
