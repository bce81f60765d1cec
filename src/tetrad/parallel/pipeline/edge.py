"""Backward from a stage output whose storage was already freed.

The runtime frees a sent stage output (its storage swapped for an empty tensor, the
autograd node kept), so backward must start from the output's node, not from the tensor:
`torch.autograd.backward`'s Python front end compares the gradient's shape with the
tensor's and would refuse the empty one. Newer torch takes a `GradientEdge` there; torch
2.6 (tetrad's floor) does not (its front end asserts on it). The autograd engine itself
checks the gradient against the shape the node recorded at forward time, never the
tensor's current data, so on an older torch the runtime hands the tensor to the engine
directly, past the front end's check. Which path a torch has is found by trying it once,
not by its version string.
"""

from __future__ import annotations

from functools import cache

import torch


def backward_from(out: torch.Tensor, grad: torch.Tensor, edges: bool | None = None) -> None:
    """Accumulate gradients from `out`'s autograd node given `grad`, d(loss)/d(out), even
    if `out.data` has been freed. `edges`: force a path (tests); None picks the public
    one when this torch has it."""
    if edges is None:
        edges = backward_takes_edges()
    if edges:
        torch.autograd.backward(torch.autograd.graph.get_gradient_edge(out), grad)
        return
    # the engine's entry point: (outputs, their gradients, keep graph, create graph,
    # inputs, allow unreachable, accumulate into .grad)
    torch.autograd.Variable._execution_engine.run_backward(
        (out,), (grad,), False, False, (), True, True
    )


@cache
def backward_takes_edges() -> bool:
    """Whether `torch.autograd.backward` accepts a `GradientEdge` (torch >= 2.7): tried on
    a one-element graph; an older torch raises from its shape check."""
    x = torch.ones(1, requires_grad=True)
    y = x * 2
    try:
        torch.autograd.backward(torch.autograd.graph.get_gradient_edge(y), torch.ones(1))
    except (AssertionError, TypeError, RuntimeError, AttributeError):
        return False
    return x.grad is not None and float(x.grad[0]) == 2.0
