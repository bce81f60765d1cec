"""Split backward for zero-bubble schedules: B computes input gradients, W the weights'.

Linear layers are swapped for `DeferredLinear`, whose backward returns the input gradient
at once and files (input, output gradient) under the running (stage, microbatch); the W
action later turns them into weight gradients. The matmuls of W are the same as in a plain
backward, so the split costs nothing but memory: B ≈ W ≈ F in FLOPs, which is what lets
ZB-H1 fill the cool-down bubble. Norm gains and the embedding (cheap) keep their gradient in B.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

Key = tuple[int, int]  # (stage, microbatch)


class WeightGradStore:
    """Pending weight-gradient matmuls per (stage, microbatch)."""

    def __init__(self) -> None:
        self.key: Key | None = None
        self.pending: dict[Key, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = (
            defaultdict(list)
        )

    def defer(self, weight: nn.Parameter, x: torch.Tensor, grad: torch.Tensor) -> None:
        if self.key is None:
            raise RuntimeError("a deferred linear ran backward outside a B action")
        self.pending[self.key].append((weight, x, grad))

    def flush(self, key: Key) -> None:
        """Run W for (stage, microbatch): accumulate every filed weight gradient."""
        for weight, x, grad in self.pending.pop(key, []):
            g = grad.flatten(0, -2).t() @ x.flatten(0, -2)  # [out, in]
            if weight.grad is None:
                weight.grad = g.to(weight.dtype)
            else:
                weight.grad.add_(g)


class _DeferredMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x)
        # the Parameter itself, not a saved tensor: under saved-tensor hooks (activation
        # meters, checkpointing) autograd unpacks an alias, and W files by identity
        ctx.weight, ctx.store = weight, store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        ctx.store.defer(weight, x, grad)
        return grad @ weight, None, None


class DeferredLinear(nn.Module):
    """A bias-free linear whose weight gradient waits for the W action."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore):
        super().__init__()
        self.weight = linear.weight  # same Parameter, same name at the same path
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeferredMatmul.apply(x, self.weight, self.store)


def defer_weight_grads(model: nn.Module, store: WeightGradStore) -> int:
    """Swap every plain bias-free nn.Linear under `model` for a DeferredLinear; count them."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None:
                setattr(parent, name, DeferredLinear(child, store))
                swapped += 1
    return swapped
