"""Split backward for zero-bubble schedules: B computes input gradients, W the weights'.

Every bias-free linear gets a deferrable matmul: plain `nn.Linear`s are swapped for
`DeferredLinear`, and the tensor-parallel layers (column, row, vocabulary head and the
gathered kv projection of `parallel/tensor.py`) are `SplitLinear`s already, armed in
place. Under a B action the matmul's backward returns the input gradient at once (the
layer's tp collectives, around the matmul, run in B as they would) and files (input,
output gradient) under the running (stage, microbatch); the W action later turns them into
weight gradients. The matmuls of W are those of a plain backward, so the split costs
nothing but memory: B ≈ W ≈ F in FLOPs, which is what lets ZB-H1 fill the cool-down
bubble. Norm gains and the embedding (cheap) keep their gradient in B.

A mixture-of-experts layer's router and routed experts (the classes its family's spec
names, `ModelSpec.moe`) are deferred too (their seams, the router's `logits` and the
experts' `matmul`, are rewired): the router's logits are a linear like any other, and each
expert weight is a grouped matmul, whose W is one grouped matmul of the output gradients'
transposes with the inputs (`dW[e] = g_e^T x_e`, group by group).

W needs no weight values, only where the gradient goes (`accumulate`): a parameter's
`.grad`, or, for a view of a flat parameter (ZeRO's units), the matching slice of the flat
gradient. So ZeRO-3 neither holds nor re-gathers a unit for W; the unit's full gradient,
which ZeRO keeps through the step's accumulation anyway, receives it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.compiling import graph_break
from tetrad.models.spec import ModelSpec, MoEParts
from tetrad.parallel.pipeline.schedules import StageMb
from tetrad.precision import widen

Sink = Callable[[torch.Tensor], None]  # takes one weight gradient and accumulates it
# a family's grouped linear (`MoEParts.grouped_linear`): x [N, in] grouped by `counts`,
# weight [n, out, in] -> [N, out]; and its weight's gradient by itself
# (`MoEParts.grouped_weight_grad`): x [N, in], grad [N, out], counts -> [n, out, in]
GroupedLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def accumulate(weight: torch.Tensor, g: torch.Tensor) -> None:
    """Add `g` to the gradient of `weight`: a leaf's `.grad`, or, for a view of a leaf (a
    ZeRO unit's flat buffer, whose storage may be freed by now), the same range of that
    leaf's `.grad`, created as zeros if backward has not made it yet."""
    if weight.is_leaf:
        if weight.grad is None:
            weight.grad = g.to(weight.dtype)
        else:
            weight.grad.add_(g)
        return
    base = weight._base
    if base is None or not base.is_leaf or not weight.is_contiguous():
        raise RuntimeError("a deferred weight must be a parameter or a contiguous view of one")
    if base.grad is None:
        base.grad = torch.zeros(base.shape, dtype=base.dtype, device=g.device)
    start = weight.storage_offset() - base.storage_offset()
    base.grad.view(-1)[start : start + weight.numel()].view_as(g).add_(g)


class Filed(NamedTuple):
    """One weight gradient W owes: where it goes, the layer's input and output gradient,
    and, for a grouped matmul (experts), the rows of each group and the family's
    `grouped_weight_grad` (None: a plain linear)."""

    sink: Sink
    x: torch.Tensor
    grad: torch.Tensor
    counts: torch.Tensor | None = None
    weight_grad: GroupedLinear | None = None


class WeightGradStore:
    """Pending weight-gradient matmuls per (stage, microbatch)."""

    def __init__(self) -> None:
        self.key: StageMb | None = None
        self.pending: dict[StageMb, list[Filed]] = defaultdict(list)
        self.flops = 0  # the matmul FLOPs W has run (tests assert W does the work)

    @contextmanager
    def filing(self, key: StageMb) -> Iterator[None]:
        """Inside: deferred linears file their weight-gradient matmuls under `key` (the B
        action running); outside, a deferred backward is an error."""
        self.key = key
        try:
            yield
        finally:
            self.key = None

    def defer(self, filed: Filed) -> None:
        if self.key is None:
            raise RuntimeError("a deferred linear ran backward outside a B action")
        self.pending[self.key].append(filed)

    @torch.no_grad()
    def flush(self, key: StageMb) -> None:
        """Run W for (stage, microbatch): accumulate every filed weight gradient. Without
        grad: the filed inputs require it, so each weight gradient would otherwise record
        a graph holding every microbatch's inputs until zero_grad (and DP's bucket views
        refuse in-place adds of such tensors)."""
        for sink, x, grad, counts, weight_grad in self.pending.pop(key, []):
            g2, x2 = grad.flatten(0, -2), x.flatten(0, -2)
            if weight_grad is None:
                sink(g2.t() @ x2)  # [out, in]
            else:
                sink(weight_grad(x2, g2, counts))  # [n, out, in]
            self.flops += 2 * g2.shape[0] * g2.shape[1] * x2.shape[1]


class _DeferredMatmul(torch.autograd.Function):
    """`F.linear(x, weight)`, or a family's `grouped(x, weight, counts)` (experts, whose
    weight gradient `weight_grad` computes), whose backward returns the input gradient and
    files the weight's for W."""

    @staticmethod
    def forward(ctx, x, weight, store, sink, counts=None, grouped=None, weight_grad=None):
        ctx.save_for_backward(x, counts)
        # the weight itself, not a saved tensor: under saved-tensor hooks (activation
        # meters, checkpointing) autograd unpacks an alias, and W accumulates by identity
        ctx.weight, ctx.store, ctx.grouped, ctx.weight_grad = weight, store, grouped, weight_grad
        ctx.sink = sink or (lambda g: accumulate(weight, g))
        return F.linear(x, weight) if grouped is None else grouped(x, weight, counts)

    @staticmethod
    def backward(ctx, grad):
        x, counts = ctx.saved_tensors
        if ctx.grouped is None:
            dx = grad @ ctx.weight
        else:
            grad = grad.contiguous()
            dx = ctx.grouped(grad, ctx.weight.transpose(-2, -1), counts)
        ctx.store.defer(Filed(ctx.sink, x, grad, counts, ctx.weight_grad))
        return dx, None, None, None, None, None, None


def split_matmul(
    x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore | None, sink: Sink | None = None
) -> torch.Tensor:
    """`F.linear(x, weight)`, whose weight gradient waits for W when a store is given
    (`sink` says where it goes; by default into `weight`'s gradient)."""
    if store is None or not torch.is_grad_enabled():
        return F.linear(x, weight)
    return _deferred_matmul(x, weight, store, sink)


# Under --compile a graph break: its backward files work into the store, a side effect
# a compiled backward cannot keep, so the matmul and its B run eagerly, W as always
_deferred_matmul = graph_break(_DeferredMatmul.apply)


def defer_router(router: nn.Module, store: WeightGradStore) -> None:
    """The router's logits (fp32) with their weight gradient waiting for W. Under bf16 the
    fp32 copy is what meets the tokens; W's gradient goes to the parameter. Logits that
    are a `Deferrable` already (sequence parallelism's, parallel/tensor.py) are armed."""
    if isinstance(router.logits_fn, Deferrable):
        router.logits_fn.store = store
        return

    def logits(x: torch.Tensor) -> torch.Tensor:
        weight = router.weight  # W's gradient goes to the parameter, not its fp32 copy
        return split_matmul(widen(x), widen(weight), store, lambda g: accumulate(weight, g))

    router.use_logits(logits)


def defer_experts(experts: nn.Module, store: WeightGradStore, moe: MoEParts) -> None:
    """Each expert weight's grouped matmul (`moe.grouped_linear`, what the experts'
    `matmul` computes: an expert weight [n, out, in] over its token groups) with its
    gradient (`moe.grouped_weight_grad`) waiting for W."""
    grouped, weight_grad = moe.grouped_linear, moe.grouped_weight_grad

    def matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return grouped(x, weight, counts)
        return _DeferredMatmul.apply(x, weight, store, None, counts, grouped, weight_grad)

    experts.use_matmul(matmul)


class Deferrable:
    """A layer whose weight gradient can wait for the W action: its `store` is None (an
    ordinary backward) until `defer_weight_grads` arms it."""

    store: WeightGradStore | None = None


class SplitLinear(nn.Linear, Deferrable):
    """A bias-free linear with a deferrable weight gradient: a base, whose subclasses' forwards
    (the tp layers') call `matmul` between their collectives."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return split_matmul(x, self.weight, self.store)


class DeferredLinear(nn.Module):
    """A plain bias-free linear, its weight gradient waiting for the W action."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore):
        super().__init__()
        self.weight = linear.weight  # same Parameter, same name at the same path
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_matmul(x, self.weight, self.store)


def defer_weight_grads(model: nn.Module, store: WeightGradStore, spec: ModelSpec) -> list[str]:
    """Swap every plain bias-free nn.Linear under `model` for a DeferredLinear, arm
    every `Deferrable` layer (the tp layers) and rewire MoE routers and experts (of the
    classes its family's `spec` names); return the names of the weights whose gradient W
    now computes."""
    moe = spec.moe
    deferred = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            path = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and child.bias is None:
                setattr(parent, name, DeferredLinear(child, store))
            elif isinstance(child, Deferrable):
                child.store = store
            elif moe is not None and isinstance(child, moe.router):
                defer_router(child, store)
            elif moe is not None and isinstance(child, moe.experts):
                defer_experts(child, store, moe)
                deferred += [f"{path}.{w}" for w, _ in child.named_parameters()]
                continue
            else:
                continue
            deferred.append(f"{path}.weight")
    return deferred
