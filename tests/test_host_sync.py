"""Host syncs on the step's path, caught without a GPU: on CUDA an op whose output size
depends on values (nonzero, bincount, masked indexing, `.item()`) makes the host wait for
the stream, and the kernels queued behind it stop overlapping the Python that issues them.
A dispatch mode records the aten ops a region runs; the ones that sync must not be there."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tetrad.models.loss import linear_cross_entropy

# ops whose output shape, or whose result on the host, comes from the values on the device
SYNCING = {"nonzero", "bincount", "_local_scalar_dense", "masked_select", "unique", "item"}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_chunked_loss_runs_without_a_host_sync():
    torch.manual_seed(0)
    h = torch.randn(2, 6, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    targets = torch.randint(0, 11, (2, 6))
    targets[0, 2] = -100  # padding, and a target another vocabulary block owns
    ops = Ops()
    with ops:
        loss = linear_cross_entropy(h, weight, targets, chunk=4, start=3)
        loss.backward()
    assert ops.seen and not SYNCING & set(ops.seen), sorted(SYNCING & set(ops.seen))
    # the same gradients as the unfused loss over this block's columns
    h2, w2 = h.detach().requires_grad_(), weight.detach().requires_grad_()
    z = h2 @ w2.t()
    local = targets - 3
    mine = (targets != -100) & (local >= 0) & (local < 11)
    lse = torch.logsumexp(z, -1)
    picked = torch.where(mine, z.gather(-1, local.clamp(0, 10)[..., None])[..., 0], 0.0)
    torch.where(targets != -100, lse - picked, 0.0).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-5, atol=1e-6)
