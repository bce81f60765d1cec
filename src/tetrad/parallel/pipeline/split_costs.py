"""`--pp-split measured`: a stage split balanced on costs timed on this machine.

Analytic FLOPs misjudge a CPU (the head runs closer to peak than a layer's small matmuls;
the embedding's backward writes a dense vocab x dim gradient that FLOPs call free), so
before the model is built every rank times, on one microbatch of the job's shape
(forward and backward, the job's dtype, recomputation and loss path): the embedding, each
layer, and the final norm with the head and the loss. The work is the same on every rank;
the timings are agreed by one all-reduce (max) over the whole world, so every rank
balances the same costs (`partition.balance`) and computes the same split. The resolved
split is fixed in the `Layout` the engine is built from (and recorded in the trainer's
configuration), so checkpoints, the memory accounting and a resumed job see the layer
counts actually used.

Memory stays small: a one-layer copy of the model is built (embedding, one block, head),
and its block is timed once per layer index (a family's blocks all have one shape, so
every layer is given the median of those timings: differences between them are noise,
which on a loaded machine could otherwise move a stage boundary). With tp the full, unsharded
items are timed: their slices cost in the same proportions.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from tetrad.comm import Comm
from tetrad.config import ModelConfig, TrainConfig
from tetrad.devices import Clock
from tetrad.layout import Layout
from tetrad.mesh import Group
from tetrad.models.families import spec_for
from tetrad.models.init import materialize
from tetrad.parallel.pipeline.partition import balance
from tetrad.parallel.runner import loss_for

REPEATS = 3  # timed runs per item, after one untimed warm-up run of each kind


def resolve_split(
    layout: Layout, m: ModelConfig, t: TrainConfig, comm: Comm, world: Group, device
) -> Layout:
    """`layout` with a "measured" split fixed to the one balanced on timed costs (a
    collective over `world`); any other layout unchanged, without communication."""
    if not layout.split_measured or layout.stages == 1:
        return layout
    costs = measure_item_costs(layout, m, t, comm, world, device)
    return layout.with_split(balance(costs, layout.stages))


def measure_item_costs(
    layout: Layout, m: ModelConfig, t: TrainConfig, comm: Comm, world: Group, device: torch.device
) -> list[float]:
    """Seconds of one microbatch's forward + backward per item, [embedding, layer_0, ...,
    layer_{L-1}, head + loss], the max over `world` (identical on every rank)."""
    own = _time_items(layout, m, t, device, REPEATS)
    agreed = torch.tensor(own, dtype=torch.float64, device=comm.device)
    comm.all_reduce(agreed, world, op="max")
    return agreed.tolist()


def _time_items(
    layout: Layout, m: ModelConfig, t: TrainConfig, device: torch.device, repeats: int
) -> list[float]:
    device, dtype = torch.device(device), layout.compute_dtype
    one, spec = replace(m, layers=1), spec_for(m)
    model = materialize(spec.build(one), one, t.seed, device).to(dtype)
    spec.set_recompute(model, t.recompute)
    loss_fn = loss_for(model, t.loss_chunk)  # the runtime's, fused with the head or not
    gen = torch.Generator().manual_seed(t.seed)
    shape = (layout.microbatch_size, layout.seq_len)
    tokens = torch.randint(0, m.vocab, shape, generator=gen).to(device)
    hidden = torch.randn(*shape, m.dim, generator=gen).to(device, dtype).requires_grad_(True)
    clock = Clock(device)
    # each item as a span of the model: (its input, its blocks, first, last)
    embedding, head = (tokens, [], True, False), (hidden, [], False, True)
    layer = (hidden, ["0"], False, False)  # the one block, timed once per layer index

    def run(x: torch.Tensor, blocks: list[str], first: bool, last: bool) -> float:
        """Seconds of the span's forward and backward (its gradients then dropped)."""
        t0 = clock.mark()
        out = model.forward_span(x, blocks, first, last)
        if last:
            loss_fn(out, tokens).backward()
        else:
            out.backward(torch.ones_like(out))
        seconds = clock.interval(t0, clock.mark())
        model.zero_grad(set_to_none=True)
        hidden.grad = None
        return seconds

    def timed(item: tuple) -> float:
        return statistics.median(run(*item) for _ in range(repeats))

    for item in (embedding, layer, head):  # warm-up: allocator, kernels, first-call paths
        run(*item)
    layers = [timed(layer) for _ in range(m.layers)]
    # the blocks have one shape, so their timings differ only by noise; on a loaded
    # machine that noise alone could move a stage boundary, so each gets their median
    return [timed(embedding)] + [statistics.median(layers)] * m.layers + [timed(head)]
