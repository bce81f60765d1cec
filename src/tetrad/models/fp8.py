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
which is what the equivalence tests hold. Tensor and context parallelism split a scale's
values across ranks: `split_over` makes each scale the max over them (one all-reduce of
the amax, given by the caller, who alone knows the group), so every rank scales as the
single process does: `parallelize` splits every FP8 matmul's tokens over cp (`use_fp8`'s
`tokens`), and the tp linears (parallel/tensor.py) run theirs through a `Float8Matmul`
split along what tp splits of them.

Under ZeRO-3 with `--fp8-all-gather` a linear's weight arrives already in FP8 with its
tensorwise scale (parallel/compress.py, `Float8Gather`: the same values `scaled` would give
of the whole weight); `Float8Linear.cast_from` hands it those, which its forward and its
input gradient then use as they are.

On CUDA, `_scaled_mm` wants its first operand row-major, its second column-major, and
dimensions that are multiples of 16 (checked by reading torch's kernels; this machine runs
the CPU kernel, which takes any layout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from tetrad.compiling import graph_break

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
Reduce = Callable[[torch.Tensor], torch.Tensor]  # an amax -> the max over the ranks sharing it


def scaled(
    t: torch.Tensor, dtype: torch.dtype, dim: int | None, reduce: Reduce | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` in `dtype` and the fp32 scale that multiplies it back: the largest magnitude over
    all of `t` (dim None) or along `dim` (one per row kept, keepdim) over `dtype`'s largest;
    `reduce` makes it the largest over the ranks holding the rest of those values."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    scale = scale_of(amax if reduce is None else reduce(amax), dtype)
    return quantize(t, scale, dtype), scale


def scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 scale that puts a largest magnitude `amax` on `dtype`'s largest value."""
    return amax.float().clamp(min=1e-12) / torch.finfo(dtype).max


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` over `scale` (broadcast), rounded into `dtype`, saturating at its largest value."""
    top = torch.finfo(dtype).max
    return (t.float() / scale).clamp(-top, top).to(dtype)


Operand = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # high precision, or (FP8, scale)
# each matmul's operands by their logical dimensions (x [M, K], weight [N, K], grad [M, N]):
# the forward's, the input gradient's, the weight gradient's
FORWARD, GRAD_X, GRAD_W = ("MK", "KN"), ("MN", "NK"), ("NM", "MK")


def _reducer(dims: str, dim: int | None, splits: dict[str, Reduce]) -> Reduce | None:
    """The max over ranks an operand's amax needs: over every group that splits one of
    the dimensions it is taken along (all of them tensorwise; the contracted one rowwise).
    A kept dimension split (a rowwise scale per row this rank holds) needs none."""
    fns = [splits[d] for d in (dims if dim is None else dims[dim]) if d in splits]
    return None if not fns else lambda amax: functools.reduce(lambda a, f: f(a), fns, amax)


def _operand(t: Operand, dtype, dim, names: str, splits) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, scale) of one operand: as it came, or scaled (see `_mm`)."""
    return t if isinstance(t, tuple) else scaled(t, dtype, dim, _reducer(names, dim, splits))


def _mm(a: Operand, b: Operand, dtypes, dims, out_dtype, names, splits):
    """a [M, K] @ b [K, N] with each operand scaled into its FP8 dtype along its `dims`
    entry (None: one scale; else the contracted dimension, so the scale is per kept row),
    unless it comes cast already, as (FP8 values, scale). `names`: the operands' logical
    dimensions, `splits` the max over the ranks holding the rest of a split one."""
    a8, sa = _operand(a, dtypes[0], dims[0], names[0], splits)
    b8, sb = _operand(b, dtypes[1], dims[1], names[1], splits)
    b8 = b8.t().contiguous().t()  # column-major, as CUDA's kernels want their second operand
    return torch._scaled_mm(a8.contiguous(), b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, rowwise: bool, cast, splits):
        """`cast`: the weight's tensorwise (FP8 values, scale), gathered so; else None.
        `splits`: logical dimension -> the max over the ranks that split it."""
        ctx.save_for_backward(x, weight)
        ctx.rowwise, ctx.cast, ctx.splits = rowwise, cast, splits  # cast: refilled by ZeRO
        ctx.dims = dims = (1, 0) if rowwise else (None, None)  # per token, per output feature
        b = weight.t() if cast is None else (cast[0].t(), cast[1])
        return _mm(x, b, (E4M3, E4M3), dims, x.dtype, FORWARD, splits)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dims, splits = ctx.dims, ctx.splits
        g = E4M3 if ctx.rowwise else E5M2
        w = weight if ctx.cast is None else ctx.cast
        grad_x = _mm(grad, w, (g, E4M3), dims, grad.dtype, GRAD_X, splits)  # [M,N] @ [N,K]
        grad_w = _mm(grad.t(), x, (g, E4M3), dims, weight.dtype, GRAD_W, splits)  # [N,M] @ [M,K]
        return grad_x, grad_w, None, None, None


# Under --compile a split matmul is a graph break: its scales' all-reduces run eagerly
_split_matmul = graph_break(_Float8Matmul.apply)


class Float8Matmul:
    """A linear's FP8 matmul x [.., K] @ weight [N, K]ᵀ (`recipe`: "tensorwise" or
    "rowwise"), its scales' reductions over the ranks splitting it (`split_over`) and an
    FP8-gathered weight (`cast_from`); a tensor-parallel layer holds one for its matmul."""

    def __init__(self, recipe: str):
        self.recipe = recipe
        self.cast: tuple[torch.Tensor, torch.Tensor] | None = None
        self.splits: dict[str, Reduce] = {}

    def split_over(self, dim: str, reduce: Reduce) -> None:
        """The ranks of a group hold other parts of this linear's `dim` ("M": its tokens,
        under cp, or under sp before a tp region; "N": its output features, a
        column-parallel weight under tp; "K": its input features, a row-parallel one): each
        scale taken along it becomes the max over them (`reduce(amax)`, an all-reduce with
        max), so every rank scales as the single process does. A rowwise scale per row this
        rank holds needs none. A dimension split twice (tokens over cp and tp) takes both."""
        if dim not in "MNK" or len(dim) != 1:
            raise ValueError(f"split dimension {dim!r} is not one of 'M', 'N', 'K'")
        first = self.splits.get(dim)
        self.splits[dim] = reduce if first is None else lambda amax: reduce(first(amax))

    def cast_from(self, weight8: torch.Tensor, scale: torch.Tensor) -> None:
        """Take the weight as these FP8 values [out, in] and tensorwise scale from now on
        (buffers a ZeRO-3 FP8 gather fills before each use), not by quantizing it."""
        if self.recipe != "tensorwise":
            raise ValueError(f"an FP8-gathered weight is tensorwise, not {self.recipe!r}")
        self.cast = (weight8, scale)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [.., K] @ weight [N, K]ᵀ -> [.., N], in FP8."""
        flat = x.reshape(-1, x.shape[-1])
        rowwise = self.recipe == "rowwise"
        apply = _split_matmul if self.splits else _Float8Matmul.apply
        out = apply(flat, weight, rowwise, self.cast, self.splits)
        return out.view(*x.shape[:-1], -1)


class Float8Linear(Float8Matmul, nn.Module):
    """A linear layer's parameters (the same tensors, the same names) with its matmuls in
    FP8 (`recipe`: "tensorwise" or "rowwise")."""

    def __init__(self, linear: nn.Linear, recipe: str):
        nn.Module.__init__(self)
        Float8Matmul.__init__(self, recipe)
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.weight)
        return out if self.bias is None else out + self.bias


def use_fp8(model: nn.Module, blocks: str, recipe: str, tokens: Reduce | None = None) -> list[str]:
    """Make every `nn.Linear` inside the blocks (the `ModuleDict` at path `blocks`) a
    `Float8Linear`, and give every layer there that takes a `Float8Matmul` (`use_float8`:
    the tensor-parallel linears) one; returns their paths. `tokens`: the max over the
    ranks holding a microbatch's other tokens (cp), which every one of them splits."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {RECIPES}")
    root = model.get_submodule(blocks)
    swapped = []
    for name, module in list(root.named_modules()):
        path = f"{blocks}.{name}"
        if type(module) is nn.Linear:
            model.set_submodule(path, fp8 := Float8Linear(module, recipe))
        elif callable(getattr(module, "use_float8", None)):
            module.use_float8(fp8 := Float8Matmul(recipe))
        else:
            continue
        if tokens is not None:
            fp8.split_over("M", tokens)
        swapped.append(path)
    return swapped
