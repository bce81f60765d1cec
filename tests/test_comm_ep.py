"""Expert parallelism's all-to-all (`comm/ep.py`) on one process: what it keeps alive."""

from __future__ import annotations

import gc
import weakref

import torch

from tetrad.comm import Comm
from tetrad.comm.ep import all_to_all_start
from tetrad.mesh import Group


def test_sent_rows_are_released_once_the_transfer_is_waited_for():
    """The rows a dispatch sends are held until its transfer is waited for and no longer:
    not to the layer's backward (the autograd graph of what arrived keeps no copy of
    them); the backward still sends each row's gradient home."""
    comm, solo = Comm("cpu"), Group("ep", [0], 0)
    x = torch.randn(4, 6, requires_grad=True)
    arrived, travel = all_to_all_start(x.t(), [6], [6], comm, solo)  # a contiguous copy sent
    sent = weakref.ref(travel.sent)
    assert sent() is not None  # in flight: held
    travel.wait()
    gc.collect()
    assert sent() is None and arrived.grad_fn is not None
    arrived.backward(torch.arange(24.0).view(6, 4))
    assert torch.equal(x.grad, torch.arange(24.0).view(6, 4).t())
