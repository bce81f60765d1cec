"""This rank's model before it has memory: the one builder every layout and the planner use.

`local_model` builds the whole model on the meta device (its family's `ModelSpec.build`),
keeps this rank's pipeline stages, and shrinks each planned module to its tensor-parallel
shard (the family's plan). `parallelize` then
materialises it; the memory model and the checkpoint gathers only read its names and
shapes. Same code, so prediction and execution agree on what a rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tetrad.comm import Comm
from tetrad.config import Config
from tetrad.mesh import Mesh, rank_of
from tetrad.models.families import spec_for
from tetrad.parallel.context import apply_cp
from tetrad.parallel.pipeline.stage import Chunk, prune, rank_chunks
from tetrad.parallel.tensor import TPLayout, apply_tp

# Axes a parameter is, by default, replicated over (identical on every rank of them).
REPLICATED = ("dp", "fsdp", "cp", "tp")


@dataclass
class LocalModel:
    """A rank's share of the model (on the meta device until materialised)."""

    model: nn.Module
    chunks: list[Chunk] | None  # its pipeline stages (None: no pipeline)
    tp: TPLayout | None  # its tensor-parallel layout (None: no tp)

    @property
    def replicated(self) -> dict[str, tuple[str, ...]]:
        """Parameter name -> the axes its value is replicated over (tp shards: not tp)."""
        out = {n: REPLICATED for n, _ in self.model.named_parameters()}
        out.update(self.tp.replicated if self.tp else {})
        return out


def local_model(cfg: Config, mesh: Mesh, comm: Comm) -> LocalModel:
    """Steps 1-3 of `parallelize`, on the meta device: build, pipeline split, tp shrink,
    and context parallelism's attention cores (they hold no parameters)."""
    spec = spec_for(cfg.model)
    model = spec.build(cfg.model)
    chunks = None
    if mesh.degrees["pp"] > 1:
        chunks = rank_chunks(cfg, mesh["pp"].rank)
        prune(model, chunks, spec)
    layout = apply_tp(model, spec.tp_plan, mesh, comm, cfg) if mesh.degrees["tp"] > 1 else None
    if mesh.degrees["cp"] > 1:
        apply_cp(model, mesh, comm, cfg)
    return LocalModel(model, chunks, layout)


def planned(cfg: Config, rank: int) -> LocalModel:
    """`local_model` of global `rank` without processes (a pure mesh, an idle Comm)."""
    return local_model(cfg, Mesh.plan(cfg.parallel.degrees, rank), Comm())


def stage_param_names(cfg: Config, pp_rank: int) -> list[str]:
    """Logical names of the parameters pipeline rank `pp_rank` holds (pure)."""
    degrees = cfg.parallel.degrees
    rank = rank_of({**{a: 0 for a in degrees}, "pp": pp_rank}, degrees)
    return [n for n, _ in planned(cfg, rank).model.named_parameters()]
