"""ZeRO-3's FP8 all-gather priced (`--fp8-all-gather`, docs/low_precision.md).

A block unit of n ranks, whose rank r holds f_r values of FP8 weights and o_r others in
its shard, gathers n·w bytes, w = max_r(f_r + e·o_r) rounded up to a multiple of e (e:
the compute dtype's bytes): each rank sends one byte an FP8 value and e bytes the rest,
padded to the most a rank sends. The scales add one all-reduce a step of 4 bytes per
FP8 weight. Which weights are FP8 is `models/fp8.use_fp8`'s choice (every plain linear
inside the blocks), read off a meta model of one block of each kind.
"""

from __future__ import annotations

import dataclasses
import math

from tetrad.config import ModelConfig
from tetrad.models.families import spec_for
from tetrad.models.fp8 import use_fp8
from tetrad.parallel.model_state import expert_names
from tetrad.parallel.zero import ROOT, UnitSlots, plan_units

Shapes = list[tuple[str, tuple[int, ...]]]


def fp8_weights(m: ModelConfig) -> frozenset[str]:
    """The FP8 linears' weights of a block, by their path inside it (as `block_linears`
    names modules), over the model's kinds of block: a meta build (callers cache it)."""
    spec = spec_for(m)
    one = dataclasses.replace(m, layers=min(m.layers, m.dense_layers + 1) if m.moe else 1)
    paths = use_fp8(spec.build(one), spec.blocks, "tensorwise")
    return frozenset(p[len(spec.block_of(p)) + 1 :] + ".weight" for p in paths)


def unit_gather_bytes(unit: UnitSlots, fp8: set[str], e: int) -> int:
    """n·w: the bytes one FP8 gather of `unit` moves (its buffer on every rank), `fp8` its
    FP8 weights' names, `e` the compute dtype's bytes."""
    n, shard = unit.world, unit.shard
    sent = [0] * n  # bytes each rank sends
    for name, start, shape in zip(unit.names, unit.offsets, unit.shapes):
        end, size = start + math.prod(shape), 1 if name in fp8 else e
        for r in range(start // shard, -(-end // shard)):  # the shards it overlaps
            sent[r] += size * (min(end, (r + 1) * shard) - max(start, r * shard))
    return n * -(-max(sent) // e) * e


def block_gathers(named: Shapes, replicated: dict, shards: int, m: ModelConfig,
                  inside: frozenset[str], e: int) -> tuple[float, int]:  # fmt: skip
    """(bytes of one block unit's FP8 gather, the mean over the rank's block units; FP8
    weights the rank holds) for a rank's local parameters `named` sharded over `shards`
    ranks; `inside`: `fp8_weights(m)`. The experts under ep, in units of their own, gather
    as before, apart."""
    spec, experts = spec_for(m), expert_names(replicated)
    dense = [(n, s) for n, s in named if n not in experts]  # the dense group's units
    fp8 = {n for n, _ in dense if spec.block_of(n) and n[len(spec.block_of(n)) + 1 :] in inside}
    units = [u for u in plan_units(dense, replicated, shards, spec) if u.name != ROOT]
    if not units:
        return 0.0, len(fp8)
    return sum(unit_gather_bytes(u, fp8, e) for u in units) / len(units), len(fp8)
