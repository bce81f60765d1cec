"""Expert parallelism, ours: each MoE layer's experts sharded over the `ep` ranks.

Which ranks. The ep group borrows ranks of one pipeline stage (`mesh.expert_groups`):
data ranks first, tensor ranks only when there are too few. Member i of an ep group holds
the i-th run of experts/ep experts (a dim-0 slice of the stacked weights). The ranks of a
stage holding the same slice form the expert-data group; expert gradients are summed over
it alone, while every other parameter is reduced as without ep.

Tokens. A layer's dispatcher (`AllToAllDispatch`, the MoE layer's dispatch protocol)
sorts this rank's token copies by expert (stable, as the single process does), sends each
run to the rank holding its expert (counts first, then rows: `comm.ep`), runs the local
experts over what arrived, regrouped by expert, and sends the outputs back, where they
are weighted and summed per token. The result equals the single process's: the same
copies meet the same expert weights. The dispatch all-to-all is launched asynchronously
and the layer's shared expert (handed to the dispatcher by the layer) computes while the
copies travel, then the transfer is waited for.

Tensor parallelism. Without sequence parallelism every tp rank holds the same tokens. We
do not compute them tp times: each tp rank dispatches its share of the tokens
(`share_of_tp`) and the expert outputs are joined over tp before the weighting
(`join_over_tp`), so the router's gradient is the same on every tp rank. The MoE layer is
a tp region (models/plans.MOE_PLAN), whose backward sums the tp ranks' input gradients:
each rank leaves the gradient of its share of the tokens (the router's, replicated, is
counted on one rank: the `once` style). Experts are replicated over tp when ep does not
span it, and their gradients (from different tokens) are summed over tp too: the
expert-data group spans tp. So under tp this dispatcher is used even at ep 1. With
sequence parallelism each tp rank already holds its own s/tp of the tokens at the
feed-forward: it dispatches them all, nothing is split or joined over tp, and the outputs
stay on their rank (the layer is then no tp region: see the plan's `once` and `tokens`).

Loss. Nothing is rescaled: every token's loss is already divided by the global token
count, and each expert gradient is a sum over the copies that reached it, so the sum over
the expert-data group is the single-process gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tetrad.comm import Comm
from tetrad.comm.ep import (
    all_to_all,
    all_to_all_start,
    exchange_counts,
    join_over_tp,
    share_of_tp,
    tp_share,
)
from tetrad.comm.tp import gather_along
from tetrad.layout import Layout
from tetrad.mesh import Group, Mesh
from tetrad.models.init import Slicer

Unshard = Callable[[str, torch.Tensor], torch.Tensor]  # name, local tensor -> full tensor

REPLICATED = ("ep_data",)  # what an expert weight's value is replicated over


class AllToAllDispatch:
    """The MoE layer's dispatch protocol over an ep group: `d(x [T, dim], ids [T, k],
    weights [T, k], experts) -> [T, dim]`, `experts` holding this rank's slice."""

    def __init__(self, experts_total: int, comm: Comm, ep: Group, tp: Group | None):
        self.n, self.comm, self.ep, self.tp = experts_total, comm, ep, tp
        self.events: list[str] | None = None  # when a list: what ran in which order

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: nn.Module,
        shared: nn.Module | None = None,
    ) -> torch.Tensor:
        tokens, k = ids.shape
        meanwhile = functools.partial(self._run_shared, shared, x)  # on the layer's input
        if self.tp is not None:  # each tp rank sends its share of the (identical) tokens
            x = share_of_tp(x, self.tp)
            ids = ids[slice(*tp_share(tokens, self.tp.size, self.tp.rank))]
        copies, early = self._through_experts(x, ids.reshape(-1), k, experts, meanwhile)
        if self.tp is not None:
            copies = join_over_tp(copies.view(-1, k, x.shape[-1]), tokens, self.comm, self.tp)
        copies = copies.view(tokens, k, -1)  # [T, k, dim], unweighted
        out = (copies * weights.unsqueeze(-1).to(copies.dtype)).sum(1)
        return out if early is None else out + early

    def _run_shared(self, shared: nn.Module | None, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert on the layer's input, while the tokens travel."""
        if shared is None:
            return None
        self._note("shared expert")
        return shared(x)

    def _note(self, event: str) -> None:
        if self.events is not None:
            self.events.append(event)

    def _through_experts(
        self, x: torch.Tensor, flat_ids: torch.Tensor, k: int, experts: nn.Module, meanwhile
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each copy (token t, slot j: row t*k+j) through its expert, on whichever rank
        holds it: the outputs in copy order [t*k, d]; and what `meanwhile()`, run while the
        copies travel, returned."""
        size, local = self.ep.size, self.n // self.ep.size
        order = torch.argsort(flat_ids, stable=True)  # copies sorted by expert
        # counted by a scatter: CUDA's bincount reads the largest id on the host first
        send = flat_ids.new_zeros(self.n).index_add_(0, flat_ids, torch.ones_like(flat_ids))
        send = send.view(size, local)  # [rank, expert]
        recv = exchange_counts(send, self.comm, self.ep)  # [source rank, local expert]
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()  # the host sync
        arrived, travel = all_to_all_start(x[order // k], recv_rows, send_rows, self.comm, self.ep)
        self._note("dispatch launched")
        early = meanwhile()
        travel.wait()  # only now may `arrived` be read
        self._note("dispatch waited")
        # arrived: by source rank, then by expert; the experts want them by expert
        expert_of = torch.arange(local, device=x.device).repeat(size)
        rows = expert_of.repeat_interleave(recv.reshape(-1), output_size=sum(recv_rows))
        regroup = torch.argsort(rows, stable=True)
        out = experts(arrived[regroup], recv.sum(0))
        if not out.requires_grad:  # no rows arrived: still in the graph, so this rank
            out = out + arrived.sum() * 0  # joins the backward all-to-alls like its peers
        back = all_to_all(out[torch.argsort(regroup)], send_rows, recv_rows, self.comm, self.ep)
        return back[torch.argsort(order)], early


@dataclass
class EPSharding:
    """What `parallelize` needs after `apply_ep`: the expert weights' names (`rows`' keys),
    slices and how to join them (checkpoints), and what they are replicated over (the norm)."""

    ep: Group
    comm: Comm
    rows: dict[str, int]  # an expert weight's logical name -> experts held here (its dim-0 rows)

    def slicer(self, inner: Slicer | None) -> Slicer:
        """`inner` (tp's) with the expert weights' dim-0 slice: this rank's experts."""

        def index(name: str) -> tuple[slice, ...] | None:
            if name not in self.rows:
                return inner(name) if inner else None
            n = self.rows[name]
            return (slice(self.ep.rank * n, (self.ep.rank + 1) * n),)

        return index

    def unshard(self, inner: Unshard | None) -> Unshard:
        """`inner` (tp's) joining shards, and the experts all-gathered over ep."""

        def full(name: str, local: torch.Tensor) -> torch.Tensor:
            if name not in self.rows:
                return inner(name, local) if inner else local
            return gather_along(local.detach(), 0, self.comm, self.ep)

        return full

    @property
    def replicated(self) -> dict[str, tuple[str, ...]]:
        return {name: REPLICATED for name in self.rows}


def expert_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The MoE layers of `model`, by name: the modules that take a dispatcher."""
    for name, module in model.named_modules():
        if callable(getattr(module, "use_dispatch", None)):
            yield name, module


def apply_ep(model: nn.Module, layout: Layout, mesh: Mesh, comm: Comm) -> EPSharding | None:
    """Shrink every MoE layer's experts (on the meta device) to this rank's slice and give
    the layer the all-to-all dispatcher (None: no MoE layer here)."""
    # without sp every tp rank holds the same tokens, and each dispatches its share of
    # them; with sp each holds its own already, and dispatches them all
    ep, tp = mesh["ep"], (mesh["tp"] if layout.tp > 1 and not layout.sp else None)
    rows: dict[str, int] = {}  # expert weight -> experts held here
    for name, layer in expert_layers(model):
        experts = layer.experts
        total = next(experts.parameters()).shape[0]
        if total % ep.size:
            raise ValueError(f"{name or 'model'}: {total} experts, not divisible by ep={ep.size}")
        for pname, p in list(experts.named_parameters(recurse=False)):
            local = nn.Parameter(p.new_empty((total // ep.size, *p.shape[1:])))
            setattr(experts, pname, local)
            rows[".".join(filter(None, (name, "experts", pname)))] = total // ep.size
        layer.use_dispatch(AllToAllDispatch(total, comm, ep, tp))
    return EPSharding(ep, comm, rows) if rows else None


def sum_sequences_over(model: nn.Module, comm: Comm, groups: list[Group]) -> None:
    """Tell every MoE layer that its sequences are split over `groups` (cp, and tp under
    sp): the per-sequence expert counts its auxiliary loss needs are summed over each
    (counts only: no gradient flows through them)."""

    def whole(part: torch.Tensor) -> torch.Tensor:
        total = part.detach().clone()
        for group in groups:
            comm.all_reduce(total, group)
        return total

    for _, layer in expert_layers(model):
        layer.use_sequence_sum(whole)
