"""Context parallelism's collectives: keys and values between the ranks of one sequence.

| function          | what it does                                                          |
|-------------------|-----------------------------------------------------------------------|
| `gather_from_cp`  | all-gather along a sequence dim; backward: reduce-scatter (sum)       |
| `ring_pass`       | one ring step: a block to the next cp rank, the previous one's in     |

`ring_pass` is not differentiable by itself: the ring attention's own autograd function
(parallel/context.py) drives it, forward and backward.

Every call goes through `Comm` over the `cp` group, so the bytes are counted: an
all-gather of the full buffer, bus factor (n-1)/n; a ring step, one send of the block.
"""

from __future__ import annotations

import torch

from tetrad.comm import Comm, Work
from tetrad.comm.tp import _all_gather, _reduce_scatter
from tetrad.mesh import Group


class _GatherFromCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, group):
        ctx.dim, ctx.comm, ctx.group = dim, comm, group
        return _all_gather(x, dim, comm, group)

    @staticmethod
    def backward(ctx, grad):
        # every rank used every gathered position: its gradient is the sum over ranks
        return _reduce_scatter(grad, ctx.dim, ctx.comm, ctx.group), None, None, None


def gather_from_cp(x: torch.Tensor, comm: Comm, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every cp rank's `x` along `dim`, rank 0 first; the backward sums the
    gradient over the ranks and keeps this rank's part."""
    return _GatherFromCP.apply(x, dim, comm, group) if group.size > 1 else x


def ring_pass(send: torch.Tensor, recv: torch.Tensor, comm: Comm, group: Group) -> list[Work]:
    """Post one ring step: `send` to the next cp rank, the previous rank's block into
    `recv` (same shape). Returns the works to wait for; both are posted at once so the
    caller computes while they travel."""
    nxt = group.ranks[(group.rank + 1) % group.size]
    prev = group.ranks[(group.rank - 1) % group.size]
    return comm.batch_p2p([("send", send.contiguous(), nxt), ("recv", recv, prev)], group)
