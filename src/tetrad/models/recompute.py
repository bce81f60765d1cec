"""Activation recomputation: run a function without keeping its insides, redo it in backward.

`recompute(fn, *inputs)` runs `fn` under no_grad and saves only its inputs (through
autograd's saved tensors, so a saved-tensor meter counts exactly them). Its backward runs
`fn` again with gradients on and backpropagates through that fresh graph, which
accumulates the gradients of the parameters `fn` uses, as a plain backward would. The
recomputation therefore happens once per backward of the region: in a split backward
(zero-bubble B and W) the deferred weight gradients are filed during B's recomputation
and W only consumes them.

Modes (`Llama.recompute`): "full" wraps each transformer block (it keeps its input, one
[b, s, d] tensor); "selective" wraps the parts that are cheap to redo and large to keep
(Korthikanti et al.): attention's core (rotary, the repeated k/v heads, softmax(qkᵀ)v) and
the SwiGLU product silu(a)·b, keeping every matmul's output. Inside a tensor-parallel block
a full recomputation repeats the block's forward collectives (as Megatron's does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        torch.autograd.backward(out, grad)
        return (None, *(x.grad if x.requires_grad else None for x in inputs))


def recompute(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs), keeping only `inputs` for backward (where fn runs again). Without
    gradients (evaluation) it is just fn(*inputs)."""
    if not torch.is_grad_enabled():
        return fn(*inputs)
    if not any(x.requires_grad for x in inputs):
        # fn may still use parameters: its output must reach backward to give them grads
        inputs = (inputs[0].detach().requires_grad_(), *inputs[1:])
    return _Recompute.apply(fn, *inputs)
