"""Tensor-parallel collectives as autograd functions (Megatron's f and g, and their SP twins).

Each is a pair of conjugate operations: what forward does, backward does the transpose of.

| function              | forward                     | backward                     |
|-----------------------|-----------------------------|------------------------------|
| `copy_to_tp`   (f)    | identity                    | all-reduce                   |
| `reduce_from_tp` (g)  | all-reduce                  | identity                     |
| `gather_from_tp`      | all-gather along `dim`      | reduce-scatter along `dim`   |
| `scatter_to_tp`       | reduce-scatter along `dim`  | all-gather along `dim`       |
| `once_in_tp`          | identity                    | tp rank 0 keeps it, others 0 |

With sequence parallelism `gather_from_tp` replaces f (the sequence is gathered before
the column-parallel matmuls) and `scatter_to_tp` replaces g (the row-parallel partial
sums are reduced and split along the sequence at once). Every call goes through `Comm`
with the group passed explicitly, so the bytes are counted.

Under torch.compile (`--compile`) each is a graph break (`tetrad.compiling.graph_break`): it
runs eagerly, counted as always, and the compiled block resumes after it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from tetrad.comm import Comm
from tetrad.compiling import graph_break
from tetrad.mesh import Group

Op = Callable[[torch.Tensor], torch.Tensor]


class Conjugate(torch.autograd.Function):
    """`fwd(x)` forward and `bwd(grad)` backward: an operation and its transpose, each
    given whole (a closure over its group and arguments). Every function here is one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd: Op, bwd: Op) -> torch.Tensor:
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.bwd(grad), None, None


def same(x: torch.Tensor) -> torch.Tensor:
    """The identity, as a new tensor object (an autograd function's output is its own)."""
    return x.view_as(x)


def _all_reduce(comm: Comm, group: Group, x: torch.Tensor) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, group)
    return out


def gather_along(x: torch.Tensor, dim: int, comm: Comm, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (the comm layer gathers along dim 0; no
    autograd: a value every rank needs whole)."""
    first = x.movedim(dim, 0).contiguous()  # [x_dim, ...]
    out = first.new_empty((first.shape[0] * group.size, *first.shape[1:]))
    comm.all_gather(out, first, group)
    # one contiguous copy here rather than one per consumer (q, k and v each reshape it)
    return out.movedim(0, dim).contiguous()


@graph_break
def reduce_scatter_along(x: torch.Tensor, dim: int, comm: Comm, group: Group) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's 1/size slice along `dim` (no autograd:
    the split backward's W uses it to place a gathered weight's gradient)."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {group.size}")
    first = x.movedim(dim, 0).contiguous()
    out = first.new_empty((first.shape[0] // group.size, *first.shape[1:]))
    comm.reduce_scatter(out, first, group)
    return out.movedim(0, dim).contiguous()


def once_in_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated computation inside a tp region: every tp rank has the same input
    gradient from it, so only tp rank 0 passes it on and the region's sum counts it once
    (exactly: the others add zeros). No communication."""
    if group.size == 1:
        return x
    return Conjugate.apply(x, same, same if group.rank == 0 else torch.zeros_like)


@graph_break
def copy_to_tp(
    x: torch.Tensor, comm: Comm, group: Group, reduce_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """f: enter the tp region with a replicated input; its gradients are summed over tp,
    in `reduce_dtype` if given (a weight's gradient, summed as the data axis sums it)."""

    def summed(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(comm, group, grad.to(reduce_dtype or grad.dtype)).to(grad.dtype)

    return Conjugate.apply(x, same, summed) if group.size > 1 else x


@graph_break
def reduce_from_tp(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """g: leave the tp region by summing the partial results of every rank."""
    return Conjugate.apply(x, partial(_all_reduce, comm, group), same) if group.size > 1 else x


def _along(x: torch.Tensor, fwd, bwd, comm: Comm, group: Group, dim: int) -> torch.Tensor:
    """`fwd` along `dim` forward and `bwd` backward (gather_along, reduce_scatter_along)."""
    if group.size == 1:
        return x
    along = {"dim": dim, "comm": comm, "group": group}
    return Conjugate.apply(x, partial(fwd, **along), partial(bwd, **along))


@graph_break
def gather_from_tp(x: torch.Tensor, comm: Comm, group: Group, dim: int = 1) -> torch.Tensor:
    """All-gather along `dim` (the sequence, [b, s/tp, h] -> [b, s, h]); reduce-scatter back."""
    return _along(x, gather_along, reduce_scatter_along, comm, group, dim)


@graph_break
def scatter_to_tp(x: torch.Tensor, comm: Comm, group: Group, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along `dim` (partial [b, s, h] -> summed [b, s/tp, h]); all-gather back."""
    return _along(x, reduce_scatter_along, gather_along, comm, group, dim)
