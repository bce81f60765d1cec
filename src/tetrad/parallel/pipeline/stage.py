"""A rank's share of the model under pipeline parallelism.

Every rank keeps one `Llama` module holding only the layers of its stages (chunks), so
parameter names stay the logical ones ("layers.7.attention.wq.weight"): initialisation,
tensor parallelism, ZeRO and checkpoints need no translation. A `Chunk` is a view of one
stage: which layers, and whether it embeds tokens (global stage 0) or ends in the head and
the loss (the last global stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tetrad.config import ModelConfig
from tetrad.layout import Layout
from tetrad.parallel.pipeline.partition import balance, llama_layer_costs
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
    costs = llama_layer_costs(
        m.layers, m.dim, m.hidden_dim, m.heads, m.kv_heads, m.vocab, layout.seq_len
    )
    return balance(costs, layout.stages)


def rank_chunks(layout: Layout, m: ModelConfig, pp_rank: int) -> list[Chunk]:
    """The chunks `pp_rank` runs, in increasing stage order."""
    split = layer_split(layout, m)
    starts = [sum(split[:i]) for i in range(len(split))]
    out = []
    for s in rank_stages(pp_rank, layout.pp, layout.virtual_stages, layout.schedule):
        layers = tuple(str(i) for i in range(starts[s], starts[s] + split[s]))
        out.append(Chunk(s, layers, s == 0, s == len(split) - 1))
    return out


def prune(model: nn.Module, chunks: list[Chunk]) -> nn.Module:
    """Drop (on the meta device) every module this rank's chunks do not use."""
    keep = {name for c in chunks for name in c.layers}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    embeds = any(c.first for c in chunks)
    heads = any(c.last for c in chunks)
    tied = model.output is None
    if not embeds and not (heads and tied):
        model.tok_embeddings = None
    if not heads:
        model.norm, model.output = None, None
    model.first, model.last = embeds, heads
    return model
