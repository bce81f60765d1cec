"""How a batch of point-to-point transfers reaches the transport (`Comm.batch_p2p`).

gloo cannot group transfers, so on the CPU each is posted on its own, in the batch's order,
without `batch_isend_irecv`'s per-operation checks; the pipeline's equivalence tests and
context parallelism's ring run the real transfers. Here the transport is replaced by a
recorder, so the test sees which calls were made (single process, no group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tetrad.comm import Comm
from tetrad.mesh import Group


class _Handle:
    def __init__(self, log: list, what: tuple):
        self.log, self.what = log, what

    def wait(self) -> None:
        self.log.append(("wait",) + self.what)

    def is_completed(self) -> bool:
        return False


def _record(monkeypatch) -> list:
    log: list = []

    def post(kind):
        def call(t, peer, group=None, **kwargs):
            log.append((kind, peer, t.data_ptr(), group))
            return _Handle(log, (kind, peer))

        return call

    def batch(ops):
        raise AssertionError("gloo transfers went through batch_isend_irecv")

    monkeypatch.setattr(dist, "isend", post("isend"))
    monkeypatch.setattr(dist, "irecv", post("irecv"))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    return log


def test_gloo_posts_each_transfer_directly_in_the_batch_order(monkeypatch):
    log = _record(monkeypatch)
    comm, pg = Comm("cpu"), object()
    group = Group("pp", [0, 1, 2], 1, pg)
    a, b, c = torch.zeros(4), torch.zeros(2, 3), torch.zeros(5)
    works = comm.batch_p2p([("recv", a, 0), ("send", b, 2), ("recv", c, 2)], group)
    assert log == [
        ("irecv", 0, a.data_ptr(), pg),
        ("isend", 2, b.data_ptr(), pg),
        ("irecv", 2, c.data_ptr(), pg),
    ]
    # one work per transfer, each waiting for its own
    assert len(works) == 3
    works[1].wait()
    assert log[-1] == ("wait", "isend", 2)
    # counted as before: a send's bytes, a receive's call
    stats = comm.summary()
    assert stats["pp/send"]["calls"] == 1 and stats["pp/send"]["bytes"] == 6 * 4
    assert stats["pp/recv"]["calls"] == 2


def test_an_empty_batch_posts_nothing(monkeypatch):
    log = _record(monkeypatch)
    assert Comm("cpu").batch_p2p([], Group("pp", [0, 1], 0, object())) == []
    assert log == []
