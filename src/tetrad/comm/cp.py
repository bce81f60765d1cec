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
from tetrad.comm.tp import gather_from_tp
from tetrad.compiling import graph_break
from tetrad.mesh import Group

# every cp rank's `x` along `dim`, rank 0 first; the backward sums the gradient over the
# ranks and keeps this rank's part: SP's gather, the same operator over another group
gather_from_cp = gather_from_tp


@graph_break
def ring_pass(send: torch.Tensor, recv: torch.Tensor, comm: Comm, group: Group) -> list[Work]:
    """Post one ring step: `send` to the next cp rank, the previous rank's block into
    `recv` (same shape). Returns the works to wait for; both are posted at once so the
    caller computes while they travel."""
    nxt = group.ranks[(group.rank + 1) % group.size]
    prev = group.ranks[(group.rank - 1) % group.size]
    return comm.batch_p2p([("send", send.contiguous(), nxt), ("recv", recv, prev)], group)
