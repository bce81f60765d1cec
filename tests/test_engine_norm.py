"""The engine's gradient norm and clipping: the same values as the plain float64 sum, in
a number of operations that does not grow with the parameter count (a per-parameter
Python loop of small kernels was the largest piece of tetrad's per-step bookkeeping)."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import tiny_config
from tetrad.mesh import Mesh
from tetrad.parallel.runner import Denominator
from tetrad.train.loop import Trainer


class OpCounter(TorchDispatchMode):
    """The names of the aten operations run inside it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def trainer_with_grads() -> Trainer:
    """A single-process trainer of the tiny model, one backward done (gradients held)."""
    torch.manual_seed(0)
    cfg = tiny_config()
    trainer = Trainer(cfg, Mesh.build(cfg.parallel, 0), torch.device("cpu"))
    trainer.engine.forward_backward(trainer.loader.next(), Denominator(torch.tensor(100.0)))
    trainer.engine.sync_grads()
    return trainer


def test_grad_norm_is_the_float64_sum_in_a_few_operations():
    engine = trainer_with_grads().engine
    grads = [p.grad for _, p in engine.named_parameters()]
    assert len(grads) > 10
    plain = math.fsum(float(g.double().pow(2).sum()) for g in grads)
    with OpCounter() as ops:
        got = engine.grad_sq_norm()
    assert got.dtype == torch.float64
    assert math.isclose(float(got), plain, rel_tol=1e-12)
    assert "_foreach_norm" in ops.ops
    assert len(ops.ops) <= 5, ops.ops  # not one cast, square and sum per parameter


def test_clipping_scales_every_gradient_in_one_operation():
    engine = trainer_with_grads().engine
    before = [p.grad.clone() for _, p in engine.named_parameters()]
    with OpCounter() as ops:
        engine.scale_grads(0.25)
    assert ops.ops == ["_foreach_mul_"]
    for b, (_, p) in zip(before, engine.named_parameters()):
        torch.testing.assert_close(p.grad, b * 0.25, rtol=0, atol=0)
