"""What every side-by-side benchmark needs for its peer: the same model, data and timing.

The peer (DDP, FSDP2, DTensor) starts from tetrad's exact initial weights and reads the
same batches, so the two runs are numerically comparable step by step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tetrad.config import Config
from tetrad.models.init import materialize
from tetrad.models.llama import Llama
from tetrad.train.data import Loader, source_of


def peer_model(cfg: Config) -> Llama:
    """The full model on CPU with tetrad's layout-invariant initial weights."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    return materialize(model, cfg.model, cfg.train.seed, "cpu")


def peer_loader(cfg: Config, data_rank: int, data_ranks: int) -> Loader:
    """The loader tetrad's trainer would give this data rank (one microbatch per step)."""
    source = source_of(cfg)
    t = cfg.train
    return Loader(source, t.global_batch, t.seq_len, data_rank, data_ranks, 1)


def timed_block(
    step_fn: Callable[[], float], steps: int, losses: list[float]
) -> tuple[float, float]:
    """(wall seconds on the slowest rank, CPU seconds summed over ranks) of `steps` steps."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        losses.append(step_fn())
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall), float(cpu)


def global_tokens(micro: list) -> float:
    """Target tokens of the whole global batch: the loss denominator, as tetrad uses it."""
    count = torch.tensor([float(sum(mb.tokens for mb in micro))], dtype=torch.float64)
    dist.all_reduce(count)
    return float(count.item())
