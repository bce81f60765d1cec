"""Activation recomputation: run a function without keeping its insides, redo it in backward.

`recompute(fn, *inputs)` runs `fn` under no_grad and saves only its inputs (through
autograd's saved tensors, so a saved-tensor meter counts exactly them). Its backward runs
`fn` again with gradients on and backpropagates through that fresh graph, which
accumulates the gradients of the parameters `fn` uses, as a plain backward would. The
recomputation therefore happens once per backward of the region: in a split backward
(zero-bubble B and W) the deferred weight gradients are filed during B's recomputation
and W only consumes them.

`recompute(fn, *inputs, keep=Keep(...), root=block)` also keeps the outputs of chosen
kernels, named by the module of `root` that runs them (a linear's matmul, the attention
core's fused kernel): forward saves them beside the inputs, and the rerun takes them from
there instead of computing them again. Only the kernel is skipped: autograd still records
its node, with the inputs the rerun recomputed, so the backward is the one a plain run
builds and the results are bit-equal to no recompute. A module listed in `drop` (the
block's last linear, whose output no backward reads: it only feeds the residual sum) is
not recomputed either: the rerun gives an uninitialised tensor of its shape. Naming
modules, not call indices, keeps a new kernel elsewhere in the block from shifting the
policy onto it; and a dropped module must run exactly one kernel of its kind, or the
forward fails with an error naming it (a second kernel there would get garbage).

Modes (`Llama.recompute`), each wrapping every transformer block: "full" keeps the block's
input, one [b, s, d] tensor. "selective" also keeps what is costly to redo for its size:
the k and v projections, the attention kernel's output and log-sum-exp, the wo projection
(before any tp reduction) and the SwiGLU gate projection (w1); it recomputes the norms,
the q projection, rotary, the repeated k/v heads, the residual sums, the up projection
(w3) and the SwiGLU product, and never w2 (its output only feeds the block's residual
sum). Per token and layer that is 2·h (the input, wo's output) + 2·kv·hd + h + heads
(fp32 log-sum-exp) + f elements, with one q and one w3 matmul redone: less memory and
fewer recomputed FLOPs than torchtitan's per-op policy (every other matmul output kept,
the first of them q, the last w2). Inside a tensor-parallel block the rerun repeats the
block's forward collectives (as a full recomputation, and Megatron's, do). One region per
block, never two: ZeRO takes a unit's gradient accumulation as the end of its backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from tetrad.models.spec import Keep

# the kernel kinds a `Keep` names: "mm" (a linear's matmul, in FP8 too under --fp8) and
# "attention" (the fused kernels of F.scaled_dot_product_attention)
_KINDS = {torch.ops.aten.mm.default: "mm", torch.ops.aten._scaled_mm.default: "mm"} | {
    getattr(torch.ops.aten, name).default: "attention"
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(torch.ops.aten, name)
}


class _Tape(TorchDispatchMode):
    """Forward (`replay` None): runs every kernel, recording the kept outputs (tensors in
    `tensors`, their structure in `trees`) and the dropped outputs' shapes. Rerun: gives
    those back, in the same order, instead of running the kernels. Which module is
    running comes from hooks on the policy's modules, set for the tape's lifetime."""

    def __init__(self, policy: Keep, root: nn.Module, trees: list, replay: tuple | None = None):
        super().__init__()
        self.trees, self.replay = trees, None if replay is None else iter(replay)
        self.given = iter(trees)  # the rerun's: what forward recorded, in its order
        self.modules = policy.modules()  # path -> (kernel kind, "keep" or "drop")
        self.root = root
        self.tensors: list[torch.Tensor] = []
        self.running: list[str] = []  # the policy modules in their forward, innermost last
        self.seen: dict[str, int] = {}  # kernels of its kind each module has run
        self.hooks: list = []

    def __enter__(self):
        found = [(path, _module(self.root, path)) for path in self.modules]  # all, or none
        for path, module in found:
            enter = module.register_forward_pre_hook(lambda *_, p=path: self.running.append(p))
            self.hooks += [enter, module.register_forward_hook(lambda *_: self._leave())]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        out = super().__exit__(*exc)
        if exc[0] is None:
            self._check_drops()
        return out

    def _leave(self) -> None:  # a forward hook's None: the module's output stays its own
        self.running.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        chosen = self._choice(func)
        if chosen is not None and self.replay is not None:
            return self._give_back(*chosen)
        out = func(*args, **(kwargs or {}))
        if chosen is not None and chosen[1] == "keep":
            leaves, spec = tree_flatten(out)
            self.tensors += [x for x in leaves if isinstance(x, torch.Tensor)]
            kept = [None if isinstance(x, torch.Tensor) else x for x in leaves]  # None: a tensor
            self.trees.append((chosen[0], spec, kept))
        elif chosen is not None:
            self.trees.append((chosen[0], out.shape, out.dtype, out.device))
        return out

    def _choice(self, func) -> tuple[str, str] | None:
        """(module, "keep" or "drop") when this kernel is the one the policy names."""
        kind = _KINDS.get(func)
        if kind is None or not self.running:
            return None
        path = self.running[-1]
        want, choice = self.modules[path]
        if kind != want:
            return None
        self.seen[path] = self.seen.get(path, 0) + 1
        return (path, choice) if self.seen[path] == 1 else None

    def _check_drops(self) -> None:
        """A dropped module ran exactly one kernel of its kind: the forward fails here, before
        any rerun could compute from the uninitialised output of a second."""
        for path, (kind, choice) in self.modules.items():
            ran = self.seen.get(path, 0)
            if choice == "drop" and ran != 1:
                raise RuntimeError(
                    f"selective recomputation drops the output of {path!r}'s {kind} kernel, "
                    f"but that module ran {'none' if ran == 0 else 'more than one'}: its model "
                    f"family's ModelSpec.selective no longer matches the block"
                )

    def _give_back(self, path: str, choice: str):
        entry = next(self.given)
        if entry[0] != path:
            raise RuntimeError(f"recomputation diverged: {path!r} ran where {entry[0]!r} did")
        if choice == "drop":
            _, shape, dtype, device = entry
            return torch.empty(shape, dtype=dtype, device=device)
        _, spec, leaves = entry
        # each tensor a fresh alias: autograd gives the kernel's output its own history
        return tree_unflatten(
            [next(self.replay).detach() if x is None else x for x in leaves], spec
        )


def _module(root: nn.Module, path: str) -> nn.Module:
    """The policy's module at `path` of `root`, or an error naming it."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise ValueError(
            f"selective recomputation names module {path!r}, which "
            f"{type(root).__name__} does not have (its model family's ModelSpec.selective)"
        ) from None


def _taped(policy: Keep | None, root: nn.Module, trees: list, replay: tuple | None = None):
    """The tape of a selective policy (`_Tape`), or no tape at all (full recomputation)."""
    return contextlib.nullcontext() if policy is None else _Tape(policy, root, trees, replay)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, policy, root, *inputs):
        ctx.fn, ctx.policy, ctx.trees, ctx.inputs = fn, policy, [], len(inputs)
        ctx.root = root
        with torch.no_grad(), _taped(policy, root, ctx.trees) as tape:
            out = fn(*inputs)
        ctx.save_for_backward(*inputs, *(tape.tensors if tape else ()))
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        n = ctx.inputs
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in saved[:n]]
        with torch.enable_grad(), _taped(ctx.policy, ctx.root, ctx.trees, saved[n:]):
            out = ctx.fn(*inputs)
        _release(out, inputs)
        torch.autograd.backward(out, grad)
        return (None, None, None, *(x.grad if x.requires_grad else None for x in inputs))


def _release(out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Free the rerun's output values before its backward: only its graph is needed (a
    block ends in a residual sum, whose backward reads no values), and the outer backward
    already holds the incoming gradient of that size. Only a fresh tensor from an op
    that saves nothing of its output is released."""
    if out._base is not None or type(out.grad_fn).__name__ != "AddBackward0":
        return
    storage = out.untyped_storage()
    if all(storage.data_ptr() != x.untyped_storage().data_ptr() for x in inputs):
        storage.resize_(0)


def recompute(
    fn: Callable[..., torch.Tensor],
    *inputs: torch.Tensor,
    keep: Keep | None = None,
    root: nn.Module | None = None,
) -> torch.Tensor:
    """fn(*inputs), keeping only `inputs` (and the outputs of the kernels of `root`'s
    modules `keep` names) for backward, where fn runs again. Without gradients
    (evaluation) it is just fn(*inputs)."""
    if keep is not None and root is None:
        raise ValueError("a recompute policy names modules: pass the module they are in (root)")
    if not torch.is_grad_enabled():
        return fn(*inputs)
    if not any(x.requires_grad for x in inputs):
        # fn may still use parameters: its output must reach backward to give them grads
        inputs = (inputs[0].detach().requires_grad_(), *inputs[1:])
    return _Recompute.apply(fn, keep, root, *inputs)
