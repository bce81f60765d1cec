"""What the plan tests share: a test's Config as the planner takes it."""

from __future__ import annotations

import dataclasses
from typing import Any

from tetrad.config import Config, ModelConfig
from tetrad.layout import Layout


def layout_config(model: ModelConfig, global_batch: int, seq_len: int, dtype: str = "bf16",
                  fp8: str = "", **parallel: Any) -> Config:  # fmt: skip
    """A test's Config of `model`, batch, sequence, compute dtype (and FP8 recipe) and
    degrees (synthetic data): what `plan.candidates.layout_for` builds a Layout from."""
    cfg = Config()
    cfg.model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq_len))
    cfg.data.source = "synthetic"
    cfg.train.global_batch, cfg.train.seq_len, cfg.train.dtype = global_batch, seq_len, dtype
    cfg.train.fp8 = fp8
    cfg.parallel = dataclasses.replace(cfg.parallel, **parallel)
    return cfg


def planned(cfg: Config) -> tuple[Layout, ModelConfig]:
    """`cfg`'s validated Layout (for its own world) and its model: the planner's arguments."""
    return Layout.build(cfg, cfg.parallel.world), cfg.model
