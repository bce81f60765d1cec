"""Expert parallelism's collectives: tokens to the ranks of their experts and back.

An all-to-all with uneven splits: each rank sends a different number of token rows to
each rank of the ep group, so the counts go first (`exchange_counts`, an all-to-all of
one integer per rank pair), then the rows (`all_to_all`, an autograd function whose
backward is the reverse all-to-all: the gradient of each received row goes back to the
rank that sent it). Both go through `Comm`, counted and under its watchdog.
"""

from __future__ import annotations

import torch

from tetrad.comm import Comm, Work
from tetrad.comm.tp import Conjugate, gather_along
from tetrad.compiling import graph_break
from tetrad.mesh import Group


@graph_break
def exchange_counts(send: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """send[i]: how many rows this rank sends to group rank i; returns recv[i], how many
    it receives from rank i (int64, on the device). The shapes of the next all-to-all."""
    recv = torch.empty_like(send)
    ones = [1] * group.size
    comm.all_to_all(recv, send.contiguous(), ones, ones, group, op="all_to_all_counts")
    return recv


class _Sending:
    """An async all-to-all's work and the rows it sends: the rows stay alive until the
    transfer is waited for, then are released. (Kept on the autograd context instead,
    they would live until the layer's backward: the dispatched copies of every MoE
    layer, held through the rest of the forward and the loss.)"""

    def __init__(self, work: Work, sent: torch.Tensor):
        self.work, self.sent = work, sent

    def wait(self) -> None:
        self.work.wait()
        self.sent = None


def _all_to_all(x, out_splits, in_splits, comm: Comm, group: Group, started=None):
    """`x`'s rows exchanged (launched only when `started` is a list, which gets the
    `_Sending`); backward, synchronously, the reverse exchange."""
    out_splits, in_splits = list(out_splits), list(in_splits)

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        sent = x.contiguous()
        work = comm.all_to_all(
            out, sent, out_splits, in_splits, group, async_op=started is not None
        )
        if started is not None:  # the rows stay alive until the work is waited for
            started.append(_Sending(work, sent))
        return out

    def backward(grad: torch.Tensor) -> torch.Tensor:
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all(back, grad.contiguous(), in_splits, out_splits, group)
        return back

    return Conjugate.apply(x, forward, backward)


@graph_break
def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: Comm, group: Group
) -> torch.Tensor:
    """Rows of `x` split by `in_splits` to each rank of `group`; what arrives, by
    `out_splits`, concatenated in rank order. Backward sends the gradients back."""
    return _all_to_all(x, out_splits, in_splits, comm, group)


@graph_break
def all_to_all_start(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: Comm, group: Group
) -> tuple[torch.Tensor, _Sending]:
    """`all_to_all`, launched and not waited for: what arrives (to read only after the
    returned work's `wait()`), and that work, which holds the sent rows until then.
    Backward is the same synchronous reverse."""
    started: list[_Sending] = []
    out = _all_to_all(x, out_splits, in_splits, comm, group, started)
    return out, started[0]


def tp_share(rows: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of `rows` that tp rank `rank` dispatches: near-equal runs in order."""
    base, extra = divmod(rows, tp)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


@graph_break
def share_of_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This tp rank's share of rows that every tp rank holds alike. Backward gives the
    rows of the share their gradient and the others zeros: a partial gradient, for inside
    a tp region, whose backward sums the tp ranks' partial gradients (no communication)."""
    rows = x.shape[0]
    lo, hi = tp_share(rows, group.size, group.rank)

    def spread(grad: torch.Tensor) -> torch.Tensor:
        out = grad.new_zeros((rows, *grad.shape[1:]))
        out[lo:hi] = grad
        return out

    return Conjugate.apply(x, lambda t: t[lo:hi].clone(), spread)


@graph_break
def join_over_tp(x: torch.Tensor, rows: int, comm: Comm, group: Group) -> torch.Tensor:
    """Every tp rank's share joined into the `rows` rows (the inverse of `share_of_tp`).
    Backward keeps this rank's share of the gradient: downstream of a tp-replicated
    activation every tp rank holds the same gradient, so nothing is summed."""
    shares = [tp_share(rows, group.size, r) for r in range(group.size)]
    width = shares[0][1]  # the largest: every share is padded to it for the all-gather

    def join(x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = gather_along(padded, 0, comm, group)  # the padding dropped after
        return torch.cat(
            [out[r * width : r * width + hi - lo] for r, (lo, hi) in enumerate(shares)]
        )

    lo, hi = shares[group.rank]
    return Conjugate.apply(x, join, lambda grad: grad[lo:hi].clone())
