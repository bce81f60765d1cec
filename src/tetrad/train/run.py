"""One rank's whole job: join the mesh, train, write metrics, leave cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from tetrad.config import Config
from tetrad.train.loop import Trainer, init_distributed
from tetrad.train.metrics import MetricsWriter


def run(cfg: Config, threads: int | None = None) -> list[dict]:
    """Train `cfg` on this process's rank (torchrun's environment, or a single process)."""
    if threads:
        torch.set_num_threads(threads)
    mesh, device = init_distributed(cfg)
    try:
        trainer = Trainer(cfg, mesh, device)
        writer = None
        if mesh.rank == 0:
            out = Path(cfg.train.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
            writer = MetricsWriter(cfg.train.out, cfg.train.steps, cfg.train.progress)
        rows = trainer.fit(writer)
        if writer is not None:
            writer.close()
        return rows
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
