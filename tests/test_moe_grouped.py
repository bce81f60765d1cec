"""The experts' grouped matmul (models/moe.py; docs/moe.md, "Which path runs where").

On CPU, `torch._grouped_mm` forward and backward against an fp64 loop over the groups,
each result within the rounding bound of its dot products (any summation order), empty
groups included; the calls a CUDA run makes (the experts' three and their backward,
zero-bubble's deferred input gradient) checked against torch's meta kernels, which carry
the CUDA kernel's checks (bf16, 16-byte strides, int32 offsets); which path each device,
dtype and shape takes, the rule agreeing with the meta kernel on shapes; and the loop
announced once per reason. On a GPU (`-m cuda`, scripts/gpu_check.sh): the same bounds on
CUDA, and the loop announced where the grouped kernel is not used.
"""

from __future__ import annotations

import pytest
import torch

from tetrad.models import moe
from tetrad.models.moe import Experts, grouped_linear, grouped_mm, loop_linear, loop_reason

needs_kernel = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm"
)
BF16 = torch.bfloat16
COUNTS = [0, 7, 0, 12, 5, 0, 8]  # empty groups first, between and last


class GroupedCalls:
    """Inside: each call of `torch._grouped_mm` from Python is recorded, (shape, strides,
    dtype) of its operands (autograd's backward calls the op from C++: `grad_fn` shows it;
    a dispatch mode would see those too, but imports torch._dynamo, seconds of CPU)."""

    def __enter__(self):
        self.calls: list[list[tuple]] = []
        self.backward: list[str] = []  # each output's autograd node
        self.op = torch._grouped_mm

        def call(*args, **kwargs):
            tensors = [*args, *kwargs.values()]
            self.calls.append([(tuple(t.shape), t.stride(), t.dtype) for t in tensors])
            out = self.op(*args, **kwargs)
            self.backward.append(out.grad_fn.name() if out.grad_fn else "")
            return out

        torch._grouped_mm = call
        return self

    def __exit__(self, *exc):
        torch._grouped_mm = self.op


def _draw(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _gamma(k: int, u: float = 2.0**-24) -> float:
    """The bound γ_k = k·u / (1 − k·u) on a k-term dot product's relative error, fp32 sums."""
    return k * u / (1 - k * u)


def _within(got: torch.Tensor, ref: torch.Tensor, absprod: torch.Tensor, k: int) -> float:
    """max of |got − ref| / bound, elementwise: the fp32 sums' γ_k·(|a|·|b|) and the output's
    rounding to its dtype (u: 2⁻²⁴ fp32, 2⁻⁸ bf16). At most 1 on any CPU or GPU kernel
    that accumulates in fp32, whatever its summation order."""
    u_out = 2.0**-8 if got.dtype == BF16 else 2.0**-24
    got, ref = got.detach().double().cpu(), ref.detach()
    bound = u_out * ref.abs() + (1 + u_out) * _gamma(k) * absprod + 1e-300
    return float(((got - ref).abs() / bound).max())


def check_grouped_linear(dtype: torch.dtype, device: str, dim=32, out=48) -> GroupedCalls:
    """grouped_linear's output, input and weight gradients on `device` in `dtype`, each
    within its rounding bound of the fp64 loop over the same values; empty groups' weight
    gradients exactly zero. Returns the grouped kernel's calls."""
    counts = torch.tensor(COUNTS, device=device)
    n = int(sum(COUNTS))
    x = _draw((n, dim), dtype, device, 0).requires_grad_()
    w = _draw((len(COUNTS), out, dim), dtype, device, 1).requires_grad_()
    g = _draw((n, out), dtype, device, 2)
    with GroupedCalls() as seen:
        y = grouped_linear(x, w, counts)
        y.backward(g)
    x64, w64 = (t.detach().double().cpu().requires_grad_() for t in (x, w))
    g64 = g.double().cpu()
    c64 = counts.cpu()
    y64 = loop_linear(x64, w64, c64)
    y64.backward(g64)
    a, b, h = x64.detach().abs(), w64.detach().abs(), g64.abs()
    bounds = {  # each result's dot products: |x|·|w|ᵀ, |g|·|w|, per group |g_e|ᵀ·|x_e|
        "out": _within(y, y64, loop_linear(a, b, c64), dim),
        "dx": _within(x.grad, x64.grad, loop_linear(h, b.transpose(1, 2), c64), out),
        "dw": _within(w.grad, w64.grad, _weight_absprod(h, a, c64), n),
    }
    assert max(bounds.values()) <= 1, bounds
    empty = [e for e, c in enumerate(COUNTS) if c == 0]
    assert not w.grad[empty].any()  # an empty group's gradient: zeros, not a kernel's garbage
    return seen


def _weight_absprod(g, x, counts):
    """Per group e, |g_e|ᵀ·|x_e| [n, out, in] in fp64: the weight gradient's dot products."""
    ends = counts.cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return torch.stack(
        [g[a:b].abs().T.detach() @ x[a:b].abs().detach() for a, b in zip(starts, ends)]
    )


@needs_kernel
@pytest.mark.rounding
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_grouped_matmul_is_the_loop_within_rounding_on_cpu(dtype):
    """The grouped kernel runs (one call, torch's backward of it: what is tested), and
    every output and gradient is within the fp32 sums' bound of fp64's (float64 itself
    has no grouped kernel: it runs the loop, `test_which_path_runs_where`)."""
    seen = check_grouped_linear(dtype, "cpu")
    assert seen.backward == ["GroupedMmBackward0"]


@needs_kernel
@pytest.mark.rounding
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_zero_bubbles_weight_gradient_is_the_loops_within_rounding(dtype):
    """W's expert weight gradient by itself (`grouped_weight_grad`, zero-bubble's deferred
    work): one grouped call, within the bound of the fp64 loop, empty groups exactly zero;
    the call, replayed in bf16 on the meta device at its shapes and strides, passes torch's
    meta kernel (the CUDA kernel's checks: the call an sm90 run makes)."""
    counts, n, dim, out = torch.tensor(COUNTS), sum(COUNTS), 32, 48
    x, g = _draw((n, dim), dtype, "cpu", 0), _draw((n, out), dtype, "cpu", 2)
    with GroupedCalls() as seen:
        dw = moe.grouped_weight_grad(x, g, counts)
    x64, g64 = x.double(), g.double()
    ref = moe.grouped_weight_grad(x64, g64, counts)  # float64: the loop
    assert dw.shape == ref.shape == (len(COUNTS), out, dim)
    assert _within(dw, ref, _weight_absprod(g64, x64, counts), n) <= 1
    assert not dw[[e for e, c in enumerate(COUNTS) if c == 0]].any()
    (call,) = seen.calls
    a, b, offs = (
        torch.empty_strided(
            shape, stride, dtype=BF16 if kind.is_floating_point else kind, device="meta"
        )
        for shape, stride, kind in call
    )
    assert torch._grouped_mm(a, b, offs=offs).shape == (len(COUNTS), out, dim)


@needs_kernel
def test_no_token_launches_nothing():
    x, w = torch.zeros(0, 16), torch.zeros(4, 32, 16)
    with GroupedCalls() as seen:
        y = grouped_linear(x, w, torch.zeros(4, dtype=torch.long))
    assert y.shape == (0, 32) and not seen.calls


# --- the CUDA path's calls, against torch's meta kernels ------------------------------------

SHAPES = {  # name: (experts, dim, expert ffn)
    "moe-small": (8, 128, 128),
    "mixtral-8x7b": (8, 4096, 14336),
    "deepseek-v3": (256, 7168, 2048),
}


@needs_kernel
@pytest.mark.parametrize("name", SHAPES)
def test_the_experts_calls_fit_torchs_meta_kernel(name):
    """The experts' forward and backward as CUDA runs them (bf16, the grouped path that
    `loop_reason` picks on sm90), on the meta device: torch's meta kernel applies the CUDA
    kernel's checks to every call (dtype, 16-byte strides, int32 offsets, shapes), its
    autograd backward's (dx = g·W and W's dW = gᵀ·x per group) included; then zero-bubble's
    deferred input gradient (weightgrad.py: the transposed weight through grouped_linear)."""
    n, dim, ffn = SHAPES[name]
    assert loop_reason("cuda", (9, 0), BF16, BF16, (ffn, dim)) is None
    assert loop_reason("cuda", (9, 0), BF16, BF16, (dim, ffn)) is None
    with torch.device("meta"):
        experts = Experts(n, dim, ffn).to(BF16)
        x = torch.empty(4 * n + 3, dim, dtype=BF16, requires_grad=True)
        counts = torch.empty(n, dtype=torch.long)
    experts.use_matmul(grouped_mm)
    with GroupedCalls() as seen:
        y = experts(x, counts)
        y.sum().backward()  # an expanded gradient, made contiguous for the kernel
        dx = grouped_mm(y.detach(), experts.w2.transpose(-2, -1), counts)
    assert y.shape == x.shape and y.dtype == BF16 and dx.shape == (x.shape[0], ffn)
    assert x.grad.shape == x.shape
    assert all(p.grad.shape == p.shape and p.grad.dtype == BF16 for p in experts.parameters())
    assert seen.backward[:3] == ["GroupedMmBackward0"] * 3 and len(seen.calls) == 3 + 1
    assert all(call[-1] == ((n,), (1,), torch.int32) for call in seen.calls)


@needs_kernel
def test_the_rule_and_the_meta_kernel_agree_on_shapes_and_dtypes():
    """For every pair of widths, the CUDA rule takes the grouped path exactly where torch's
    meta kernel accepts the forward and backward calls; other dtypes it refuses, as the
    meta kernel (CUDA's checks) does."""
    for dim in (8, 12, 16, 20, 24, 40, 64):
        for ffn in (8, 12, 24, 36, 48):
            rule = loop_reason("cuda", (9, 0), BF16, BF16, (ffn, dim)) is None
            assert _meta_call_ok(dim, ffn, BF16) == rule, (dim, ffn)
    for dtype in (torch.float32, torch.float16):
        assert loop_reason("cuda", (9, 0), dtype, dtype, (64, 64)) is not None
        assert not _meta_call_ok(64, 64, dtype)


def _meta_call_ok(dim: int, ffn: int, dtype: torch.dtype) -> bool:
    x = torch.empty(10, dim, device="meta", dtype=dtype, requires_grad=True)
    w = torch.empty(4, ffn, dim, device="meta", dtype=dtype, requires_grad=True)
    try:
        y = grouped_mm(x, w, torch.empty(4, device="meta", dtype=torch.long))
        y.backward(torch.empty_like(y))
    except RuntimeError:
        return False
    return True


# --- which path, where ------------------------------------------------------------------------

CAP90, CPU = (9, 0), ("cpu", None)


@needs_kernel  # else every row loops (`test_without_the_kernel_the_loop_runs`)
@pytest.mark.parametrize(
    "device, capability, dtype, widths, aligned, says",
    [
        ("cuda", CAP90, BF16, (2048, 7168), True, None),
        ("cuda", (9, 0), BF16, (256, 128), False, "not at a 16-byte address"),
        ("cuda", CAP90, BF16, (256, 12), True, "rows of 256/12 torch.bfloat16 elements"),
        ("cuda", CAP90, torch.float32, (256, 128), True, "torch.float32: torch's grouped"),
        ("cuda", (8, 0), BF16, (256, 128), True, "compute capability 8.0"),
        ("cuda", (10, 0), BF16, (256, 128), True, "pytorch#172439"),
        ("cuda", (12, 0), BF16, (256, 128), True, "built for 9.x and 10.x"),
        (*CPU, torch.float32, (12, 8), True, None),
        (*CPU, BF16, (256, 128), True, None),
        (*CPU, torch.float32, (10, 8), True, "not multiples of 16 bytes"),
        (*CPU, torch.float64, (256, 128), True, "float64: the grouped kernel has none"),
        ("mps", None, BF16, (256, 128), True, "device mps"),
    ],
)
def test_which_path_runs_where(device, capability, dtype, widths, aligned, says):
    got = loop_reason(device, capability, dtype, dtype, widths, aligned)
    assert got is None if says is None else says in got
    assert "tokens in torch.bfloat16, weights in torch.float32" in loop_reason(
        *CPU, BF16, torch.float32, (16, 16)
    )


def test_without_the_kernel_the_loop_runs(monkeypatch):
    """Under torch 2.6 (the floor, which has no _grouped_mm) every device loops."""
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert "has no torch._grouped_mm" in loop_reason("cuda", CAP90, BF16, BF16, (64, 64))
    x, w, counts = torch.randn(6, 16), torch.randn(2, 8, 16), torch.tensor([2, 4])
    got = grouped_linear(x, w, counts)  # no kernel to call: the loop ran
    torch.testing.assert_close(got, loop_linear(x, w, counts), rtol=0, atol=0)


def test_a_loop_on_cuda_is_announced_once_per_reason(capsys):
    moe._say_loop.cache_clear()
    for why in ("torch.float32: one", "torch.float32: one", "compute capability 8.0: two"):
        moe._say_loop(why)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "tetrad: MoE experts on cuda: a loop over the experts (torch.float32: one)",
        "tetrad: MoE experts on cuda: a loop over the experts (compute capability 8.0: two)",
    ]


# --- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_on_cuda_the_path_taken_is_within_rounding_and_a_loop_says_why(dtype, capsys, monkeypatch):
    """bf16 on sm90: the grouped kernel and its backward; elsewhere the loop,
    announced once with its reason. Either way within the same bounds as on CPU (fp32 sums:
    cuBLAS's bf16 reductions in bf16, which the loop could take, are turned off), and
    empty groups' weight gradients zero (pytorch#172439 is about them)."""
    matmul = torch.backends.cuda.matmul
    monkeypatch.setattr(matmul, "allow_bf16_reduced_precision_reduction", False)
    moe._say_loop.cache_clear()
    capability = torch.cuda.get_device_capability()
    why = loop_reason("cuda", capability, dtype, dtype, (64, 32))
    seen = check_grouped_linear(dtype, "cuda", dim=32, out=64)
    check_grouped_linear(dtype, "cuda", dim=32, out=64)
    said = [line for line in capsys.readouterr().out.splitlines() if "MoE experts" in line]
    assert seen.backward == (["GroupedMmBackward0"] if why is None else [])
    once = [f"tetrad: MoE experts on cuda: a loop over the experts ({why})"]
    assert said == ([] if why is None else once)
