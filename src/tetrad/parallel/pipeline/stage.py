"""A rank's share of the model under pipeline parallelism.

Every rank keeps one model holding only the blocks of its stages (chunks), so parameter
names stay the logical ones (a block's parameters keep its layer index): initialisation,
tensor parallelism, ZeRO and checkpoints need no translation. Which modules are the
embedding, the blocks, the final norm and the head, the model family's `ModelSpec` says.
A `Chunk` is a view of one stage: which layers, and whether it embeds tokens (global
stage 0) or ends in the head and the loss (the last global stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.config import ModelConfig
from tetrad.layout import Layout
from tetrad.models.families import spec_for
from tetrad.parallel.pipeline.partition import balance
from tetrad.parallel.pipeline.schedules import rank_stages


@dataclass(frozen=True)
class Chunk:
    """One pipeline stage as held by its rank."""

    stage: int
    layers: tuple[str, ...]
    first: bool
    last: bool


def layer_split(layout: Layout, m: ModelConfig) -> list[int]:
    """Layers per global stage: the layout's checked split (the user's `pp_split`), or
    balanced on analytic FLOPs (embedding on the first stage, head and loss on the last).

    "measured" is resolved into layer counts before the engine is built (split_costs.py,
    a collective warm-up); met here unresolved, by the planner, which runs nothing, it
    is predicted by the analytic split."""
    if layout.split is not None:
        return list(layout.split)
    return balance(spec_for(m).layer_costs(m, layout.seq_len), layout.stages)


def rank_chunks(layout: Layout, m: ModelConfig, pp_rank: int) -> list[Chunk]:
    """The chunks `pp_rank` runs, in increasing stage order."""
    split = layer_split(layout, m)
    starts = [sum(split[:i]) for i in range(len(split))]
    out = []
    for s in rank_stages(pp_rank, layout.pp, layout.virtual_stages, layout.schedule):
        layers = tuple(str(i) for i in range(starts[s], starts[s] + split[s]))
        out.append(Chunk(s, layers, s == 0, s == len(split) - 1))
    return out
