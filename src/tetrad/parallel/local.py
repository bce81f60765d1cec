"""This rank's model before it has memory: the one builder every layout and the planner use.

`local_model` builds the whole model on the meta device (its family's `ModelSpec.build`),
keeps this rank's pipeline stages, and shrinks each planned module to its tensor-parallel
shard (the family's plan), and its experts to its expert-parallel slice. `parallelize` then
materialises it; the memory model and the checkpoint gathers only read its names and
shapes. Same code, so prediction and execution agree on what a rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tetrad.comm import Comm
from tetrad.config import ModelConfig
from tetrad.layout import Layout
from tetrad.mesh import Mesh, rank_of
from tetrad.models.families import spec_for
from tetrad.parallel.context import apply_cp
from tetrad.parallel.expert import EPSharding, apply_ep, sum_sequences_over
from tetrad.parallel.pipeline.stage import Chunk, rank_chunks
from tetrad.parallel.tensor import TPSharding, apply_tp

# Axes a parameter is, by default, replicated over (identical on every rank of them).
REPLICATED = ("dp", "fsdp", "cp", "tp")


@dataclass
class LocalModel:
    """A rank's share of the model (on the meta device until materialised)."""

    model: nn.Module
    chunks: list[Chunk] | None  # its pipeline stages (None: no pipeline)
    tp: TPSharding | None  # its tensor-parallel layout (None: no tp)
    ep: EPSharding | None = None  # its experts' layout (None: no ep)

    @property
    def replicated(self) -> dict[str, tuple[str, ...]]:
        """Parameter name -> the axes its value is replicated over (tp shards: not tp)."""
        out = {n: REPLICATED for n, _ in self.model.named_parameters()}
        out.update(self.tp.replicated if self.tp else {})
        out.update(self.ep.replicated if self.ep else {})
        return out


def local_model(layout: Layout, m: ModelConfig, mesh: Mesh, comm: Comm) -> LocalModel:
    """Steps 1-3 of `parallelize`, on the meta device: build, pipeline split, tp shrink,
    and context parallelism's attention cores (they hold no parameters)."""
    spec = spec_for(m)
    model = spec.build(m)
    chunks = None
    if layout.pp > 1:  # the modules this rank's stages do not use dropped
        chunks = rank_chunks(layout, m, mesh["pp"].rank)
        layers = [name for c in chunks for name in c.layers]
        spec.prune(model, layers, any(c.first for c in chunks), any(c.last for c in chunks))
    tp = None
    if layout.tp > 1:
        tp = apply_tp(model, spec.tp_plan, mesh, comm, m, layout.sp, layout.reduce_dtype)
    if layout.cp > 1:
        apply_cp(model, mesh, comm, layout.cp_attention, spec, layout.cp_kernel)
    # MoE's per-sequence expert counts: a sequence is split over cp, and over tp with sp
    split = [mesh[axis] for axis, on in (("cp", layout.cp > 1), ("tp", layout.sp)) if on]
    if split:
        sum_sequences_over(model, comm, split)
    # experts: sharded over ep, their tokens split over tp (at ep 1 too: parallel/expert.py)
    ep = apply_ep(model, layout, mesh, comm) if layout.ep > 1 or layout.tp > 1 else None
    return LocalModel(model, chunks, tp, ep)


def planned(layout: Layout, m: ModelConfig, rank: int) -> LocalModel:
    """`local_model` of global `rank` without processes (a pure mesh, an idle Comm)."""
    return local_model(layout, m, Mesh.plan(layout.degrees, rank, layout.ep), Comm())


def stage_param_names(layout: Layout, m: ModelConfig, pp_rank: int) -> list[str]:
    """Logical names of the parameters pipeline rank `pp_rank` holds (pure)."""
    rank = rank_of(dict.fromkeys(layout.degrees, 0) | {"pp": pp_rank}, layout.degrees)
    return [n for n, _ in planned(layout, m, rank).model.named_parameters()]
