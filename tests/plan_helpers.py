"""What the plan tests share: a test's Config as the planner takes it."""

from __future__ import annotations

from tetrad.config import Config, ModelConfig
from tetrad.layout import Layout


def planned(cfg: Config) -> tuple[Layout, ModelConfig]:
    """`cfg`'s validated Layout (for its own world) and its model: the planner's arguments."""
    return Layout.build(cfg, cfg.parallel.world), cfg.model
