"""Parameter groups (pure): which group each parameter joins, how ZeRO shards each, and
`GroupedGrads` forwarding every call to its parts in the groups' order."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tetrad.parallel.groups import GroupedGrads, param_groups
from tetrad.parallel.runner import Held

NAMES = ["embed.weight", "layers.0.experts.w1", "layers.0.router.weight", "layers.0.experts.w2"]
EXPERTS = {"layers.0.experts.w1", "layers.0.experts.w2", "layers.1.experts.w1"}


def _shape(groups) -> list[tuple]:
    return [(g.name, sorted(g.names), g.data, g.axis, g.shards, g.stage) for g in groups]


def test_without_zero_every_group_is_whole():
    dense, expert = param_groups(NAMES, EXPERTS, 3, 1, 4)
    assert _shape([dense, expert]) == [
        ("dense", ["embed.weight", "layers.0.router.weight"], "data", "fsdp", 1, 0),
        ("expert", ["layers.0.experts.w1", "layers.0.experts.w2"], "ep_data", "ep_data", 1, 0),
    ]  # the expert group holds only this rank's expert weights
    assert not dense.sharded and not expert.sharded


def test_zero_shards_dense_over_fsdp_and_experts_over_ep_data():
    dense, expert = param_groups(NAMES, EXPERTS, 2, 4, 2)
    assert (dense.sharded, dense.shards, dense.stage) == (True, 4, 2)
    assert (expert.sharded, expert.axis, expert.shards, expert.stage) == (True, "ep_data", 2, 2)


def test_one_rank_per_expert_slice_keeps_the_experts_whole():
    dense, expert = param_groups(NAMES, EXPERTS, 1, 2, 1)
    assert dense.sharded and (expert.sharded, expert.stage) == (False, 0)


def test_no_experts_no_expert_group():
    assert [g.name for g in param_groups(NAMES, set(), 3, 4, 2)] == ["dense"]
    assert [g.name for g in param_groups(["embed.weight"], EXPERTS, 3, 4, 2)] == ["dense"]


def test_of_keeps_order():
    dense, _ = param_groups(NAMES, EXPERTS, 0, 1, 1)
    pairs = [(n, i) for i, n in enumerate(NAMES)]
    assert dense.of(pairs) == [("embed.weight", 0), ("layers.0.router.weight", 2)]


class _Fake:
    """A `GradSync` that notes each call (name, part) in a shared log."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log
        self.p = torch.zeros(1)

    def _note(self, call: str) -> None:
        self.log.append((call, self.name))

    def reduce_in_backward(self, on: bool) -> None:
        self._note("reduce")

    def params(self):
        return [(self.name, self.p)]

    @contextmanager
    def final(self, names):
        self._note("enter")
        yield
        self._note("exit")

    def launch_rest(self) -> None:
        self._note("launch_rest")

    def finish(self) -> None:
        self._note("finish")

    def zero_grad(self) -> None:
        self._note("zero_grad")

    def after_step(self) -> None:
        self._note("after_step")

    def held(self) -> Held:
        return Held([self.p], [None], [])

    def residuals(self) -> dict:
        return {"bucket0.sent": self.name}


def test_grouped_grads_forwards_in_order():
    log: list = []
    grads = GroupedGrads([_Fake("dense", log), _Fake("expert", log)])
    grads.reduce_in_backward(True)
    with grads.final(["x"]):
        log.append(("body", None))
    grads.launch_rest()
    grads.finish()
    grads.zero_grad()
    grads.after_step()
    assert grads.residuals() == {"0.bucket0.sent": "dense", "1.bucket0.sent": "expert"}
    assert log == [
        ("reduce", "dense"), ("reduce", "expert"),
        ("enter", "dense"), ("enter", "expert"), ("body", None),
        ("exit", "expert"), ("exit", "dense"),
        ("launch_rest", "dense"), ("launch_rest", "expert"),
        ("finish", "dense"), ("finish", "expert"),
        ("zero_grad", "dense"), ("zero_grad", "expert"),
        ("after_step", "dense"), ("after_step", "expert"),
    ]  # fmt: skip
    assert [n for n, _ in grads.params()] == ["dense", "expert"]
    held = grads.held()
    assert len(held.params) == 2 and held.grads == [None, None] and held.masters == []
