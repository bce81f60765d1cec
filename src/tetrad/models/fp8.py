"""FP8 matmuls for a block's linear layers, with dynamic scales (`--fp8`).

Each of a block's `nn.Linear`s (attention's q, k, v, o; the SwiGLU's three) becomes a
`Float8Linear` holding the same parameters: its three matmuls (forward, input gradient,
weight gradient) run as `torch._scaled_mm` on FP8 operands, each scaled just before the
matmul so that its largest magnitude lands on the format's largest value:
- "tensorwise": one scale per operand; e4m3 for weights and activations, e5m2 (wider
  range, fewer digits) for gradients, as torchao's tensorwise recipe;
- "rowwise": a scale per row of each operand along the dimension the matmul keeps (per
  token, per output feature, ...), every operand in e4m3, as torchao's rowwise recipe:
  torch's CUDA rowwise kernel (f8f8bf16_rowwise) takes e4m3 operands and a bf16 output.
The embedding, the head, the norms and an MoE layer's router and routed experts stay in
the compute dtype. What is saved for backward is the high-precision input and weight
(each backward matmul scales its operands along its own kept dimensions).

Scales depend on the values they cover: a scale over a microbatch's tokens is the same in
every layout that gives a rank the same microbatch (data parallelism, ZeRO, pipelines),
which is what the equivalence tests hold; tensor and context parallelism split a scale's
values across ranks (refused for now, see layout.py).

On CUDA, `_scaled_mm` wants its first operand row-major, its second column-major, and
dimensions that are multiples of 16 (checked by reading torch's kernels; this machine runs
the CPU kernel, which takes any layout).
"""

from __future__ import annotations

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")


def scaled(
    t: torch.Tensor, dtype: torch.dtype, dim: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` in `dtype` and the fp32 scale that multiplies it back: the largest magnitude over
    all of `t` (dim None) or along `dim` (one per row kept, keepdim) over `dtype`'s largest."""
    top = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    scale = amax.float().clamp(min=1e-12) / top
    return (t.float() / scale).clamp(-top, top).to(dtype), scale


def _mm(a: torch.Tensor, b: torch.Tensor, dtypes, dims, out_dtype) -> torch.Tensor:
    """a [M, K] @ b [K, N] with each operand scaled into its FP8 dtype along its `dims`
    entry (None: one scale; else the contracted dimension, so the scale is per kept row)."""
    a8, sa = scaled(a, dtypes[0], dims[0])
    b8, sb = scaled(b, dtypes[1], dims[1])
    b8 = b8.t().contiguous().t()  # column-major, as CUDA's kernels want their second operand
    return torch._scaled_mm(a8.contiguous(), b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, rowwise: bool):
        ctx.save_for_backward(x, weight)
        ctx.rowwise = rowwise
        dims = (1, 0) if rowwise else (None, None)  # per token, per output feature
        return _mm(x, weight.t(), (E4M3, E4M3), dims, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rowwise = ctx.rowwise
        g = E4M3 if rowwise else E5M2
        dims = (1, 0) if rowwise else (None, None)
        grad_x = _mm(grad, weight, (g, E4M3), dims, grad.dtype)  # [M, N] @ [N, K]
        grad_w = _mm(grad.t(), x, (g, E4M3), dims, weight.dtype)  # [N, M] @ [M, K]
        return grad_x, grad_w, None


class Float8Linear(nn.Module):
    """A linear layer's parameters (the same tensors, the same names) with its matmuls in
    FP8 (`recipe`: "tensorwise" or "rowwise")."""

    def __init__(self, linear: nn.Linear, recipe: str):
        super().__init__()
        self.weight, self.bias, self.recipe = linear.weight, linear.bias, recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = _Float8Matmul.apply(flat, self.weight, self.recipe == "rowwise")
        out = out.view(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


def use_fp8(model: nn.Module, blocks: str, recipe: str) -> list[str]:
    """Make every `nn.Linear` inside the blocks (the `ModuleDict` at path `blocks`) a
    `Float8Linear`; returns their paths."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {RECIPES}")
    root = model.get_submodule(blocks)
    swapped = []
    for name, module in list(root.named_modules()):
        if type(module) is nn.Linear:
            path = f"{blocks}.{name}"
            model.set_submodule(path, Float8Linear(module, recipe))
            swapped.append(path)
    return swapped
