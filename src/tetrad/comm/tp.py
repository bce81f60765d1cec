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

import torch

from tetrad.comm import Comm
from tetrad.compiling import graph_break
from tetrad.mesh import Group


def _all_reduce(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, group)
    return out


def _all_gather(x: torch.Tensor, dim: int, comm: Comm, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (the comm layer gathers along dim 0)."""
    first = x.movedim(dim, 0).contiguous()  # [x_dim, ...]
    out = first.new_empty((first.shape[0] * group.size, *first.shape[1:]))
    comm.all_gather(out, first, group)
    # one contiguous copy here rather than one per consumer (q, k and v each reshape it)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Comm, group: Group) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's 1/size slice along `dim`."""
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {group.size}")
    first = x.movedim(dim, 0).contiguous()
    out = first.new_empty((first.shape[0] // group.size, *first.shape[1:]))
    comm.reduce_scatter(out, first, group)
    return out.movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, group, reduce_dtype):
        ctx.comm, ctx.group, ctx.reduce_dtype = comm, group, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dtype = ctx.reduce_dtype or grad.dtype
        return _all_reduce(grad.to(dtype), ctx.comm, ctx.group).to(grad.dtype), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, group):
        return _all_reduce(x, comm, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, group):
        ctx.dim, ctx.comm, ctx.group = dim, comm, group
        return _all_gather(x, dim, comm, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.comm, ctx.group), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, group):
        ctx.dim, ctx.comm, ctx.group = dim, comm, group
        return _reduce_scatter(x, dim, comm, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.comm, ctx.group), None, None, None


class _OnceInTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.keep = group.rank == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.keep else torch.zeros_like(grad)), None


def once_in_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated computation inside a tp region: every tp rank has the same input
    gradient from it, so only tp rank 0 passes it on and the region's sum counts it once
    (exactly: the others add zeros). No communication."""
    return _OnceInTP.apply(x, group) if group.size > 1 else x


@graph_break
def copy_to_tp(
    x: torch.Tensor, comm: Comm, group: Group, reduce_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """f: enter the tp region with a replicated input; its gradients are summed over tp,
    in `reduce_dtype` if given (a weight's gradient, summed as the data axis sums it)."""
    return _CopyToTP.apply(x, comm, group, reduce_dtype) if group.size > 1 else x


@graph_break
def reduce_from_tp(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """g: leave the tp region by summing the partial results of every rank."""
    return _ReduceFromTP.apply(x, comm, group) if group.size > 1 else x


@graph_break
def gather_from_tp(x: torch.Tensor, comm: Comm, group: Group, dim: int = 1) -> torch.Tensor:
    """All-gather along `dim` (the sequence, [b, s/tp, h] -> [b, s, h]); reduce-scatter back."""
    return _GatherFromTP.apply(x, dim, comm, group) if group.size > 1 else x


@graph_break
def reduce_scatter_along(x: torch.Tensor, dim: int, comm: Comm, group: Group) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's slice along `dim` (no autograd: the
    split backward's W uses it to place a gathered weight's gradient)."""
    return _reduce_scatter(x, dim, comm, group) if group.size > 1 else x


@graph_break
def scatter_to_tp(x: torch.Tensor, comm: Comm, group: Group, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along `dim` (partial [b, s, h] -> summed [b, s/tp, h]); all-gather back."""
    return _ScatterToTP.apply(x, dim, comm, group) if group.size > 1 else x
