"""One block of attention and its log-sum-exp: the kernels context parallelism's cores run.

A cp core attends its queries to one rank's keys and values at a time and merges the
blocks by log-sum-exp (parallel/context.py); its backward recomputes each block given the
*merged* output and log-sum-exp, and gets back exactly that block's share of dq, dk, dv.
torch's fused attention ops do both halves tiled, never holding a block of scores, so
the cores call them where they exist; the unfused twin (plain fp32 matmuls, a whole
n x m block of scores at a time) is the reference they are tested against and the
fallback everywhere else.

| device | dtype                    | kernel           | torch op (`_scaled_dot_product_…`) |
|--------|--------------------------|------------------|------------------------------------|
| cpu    | any                      | `cpu-flash`      | `flash_attention_for_cpu`          |
| cuda   | bf16, fp16 on sm80+      | `cuda-flash`     | `flash_attention`                  |
| cuda   | fp32, or half below sm80 | `cuda-efficient` | `efficient_attention`              |
| others | any                      | `unfused`        | none: plain fp32 matmuls           |

Also unfused: on CUDA, a head size not a multiple of 8 or over 256 (the fused kernels'
limits); a kernel whose ops this torch lacks; `parallel.cp_kernel = "unfused"`.

Every kernel takes q, k [b, H, n or m, hd] and v [b, H, m, v_hd] (kv heads already
repeated to the query heads; v_hd may differ from hd: latent attention's) and returns the
output [b, H, n, v_hd] in q's dtype and the log-sum-exp in fp32 [b, H, n]. A causal block
is a diagonal one (n = m), masked top-left. torch's flash ops take one head size for q, k
and v: given another v, the narrower side is zero-padded to the wider for the call
(`_one_head_size`; zero channels add nothing to a score or an output) and the padding cut
from what comes back. The memory-efficient op takes v's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tetrad.config import CP_KERNELS
from tetrad.precision import widen


@dataclass(frozen=True)
class BlockKernel:
    """A block's forward (q, k, v, causal, scale) -> (out, lse) and its backward
    (dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), given the merged out and lse;
    `op`: the torch op it calls, `_scaled_dot_product_{op}`, with its backward (none: the
    unfused kernel)."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    op: str = ""

    @property
    def ops(self) -> tuple[str, ...]:
        """The aten ops it calls (it is used only where this torch has them all)."""
        fwd = f"_scaled_dot_product_{self.op}"
        return (fwd, fwd + "_backward") if self.op else ()


# --- unfused: plain fp32 matmuls, any device (the reference) ---------------------------------


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """fp32 scores [..., n, m] of a block; masked causally (top-left) on the diagonal."""
    s = torch.matmul(widen(q), widen(k).transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def unfused_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(qkᵀ·scale)v of one block and its fp32 log-sum-exp, from the whole score block."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), widen(v)).to(q.dtype), lse


def unfused_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """dq, dk, dv of one block given the *merged* output and log-sum-exp of all blocks:
    P = exp(qkᵀ·scale − lse) is then the block's share of the whole softmax, and
    dS = P ∘ (dO·vᵀ − rowsum(dO ∘ O)) the exact gradient of its scores."""
    d, qf, kf = widen(dout), widen(q), widen(k)
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    ds = p * (torch.matmul(d, widen(v).transpose(-1, -2)) - (d * widen(out)).sum(-1)[..., None])
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dv = torch.matmul(p.transpose(-1, -2), d)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- fused: torch's attention ops, tiled ----------------------------------------------------


def _cpu_flash_forward(q, k, v, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def _cpu_flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _no_dropout_state(q: torch.Tensor) -> torch.Tensor:
    """The random-state argument the CUDA backwards take: read only with dropout, so any."""
    return torch.zeros((), dtype=torch.int64, device=q.device)


def _cuda_flash_forward(q, k, v, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse


def _cuda_flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    n, m, rng = q.shape[2], k.shape[2], _no_dropout_state(q)
    # no cumulative lengths: dense batches, as torch's own derivative passes them
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, n, m, 0.0, causal, rng, rng, scale=scale
    )


# the memory-efficient kernel pads its log-sum-exp's rows to a multiple of this
_LSE_ROWS = 32


def _cuda_efficient_forward(q, k, v, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]  # the merge wants one row per query


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    lse = F.pad(lse, (0, -q.shape[2] % _LSE_ROWS))  # back to the shape its forward returned
    rng = _no_dropout_state(q)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, rng, rng, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _one_head_size(forward: Callable, backward: Callable) -> tuple[Callable, Callable]:
    """A (forward, backward) that takes q, k and v of one head size, made to take v of
    another: every side zero-padded to the widest for the call (where it is narrower),
    the padding cut after."""

    def padded_forward(q, k, v, causal: bool, scale: float):
        d = max(q.shape[-1], v.shape[-1])
        out, lse = forward(_pad(q, d), _pad(k, d), _pad(v, d), causal, scale)
        return out[..., : v.shape[-1]], lse

    def padded_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        d, hd, v_hd = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
        wide_args = (_pad(t, d) for t in (dout, q, k, v, out))
        dq, dk, dv = backward(*wide_args, lse, causal, scale)
        return dq[..., :hd], dk[..., :hd], dv[..., :v_hd]

    return padded_forward, padded_backward


KERNELS = {
    k.name: k
    for k in (
        BlockKernel("unfused", unfused_forward, unfused_backward),
        BlockKernel(
            "cpu-flash",
            *_one_head_size(_cpu_flash_forward, _cpu_flash_backward),
            "flash_attention_for_cpu",
        ),
        BlockKernel(
            "cuda-flash",
            *_one_head_size(_cuda_flash_forward, _cuda_flash_backward),
            "flash_attention",
        ),
        BlockKernel(
            "cuda-efficient",
            _cuda_efficient_forward,
            _cuda_efficient_backward,
            "efficient_attention",
        ),
    )
}


def has_op(name: str) -> bool:
    """Whether this torch registers aten op `name` (a build may lack a fused kernel)."""
    return hasattr(torch.ops.aten, name)


def kernel_name(
    kind: str,
    device: str,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int] | None = None,
    v_head_dim: int | None = None,
) -> str:
    """Which kernel (a key of KERNELS) runs a block (pure): `kind` is parallel.cp_kernel,
    `device` the device type, `capability` a CUDA device's compute capability, `v_head_dim`
    the values' head size when it is not `head_dim` (CUDA's fused kernels check the wider)."""
    if kind not in CP_KERNELS:
        raise ValueError(f"cp_kernel={kind!r} is not one of {CP_KERNELS}")
    name = "unfused"
    if kind == "unfused":
        return name
    if device == "cpu":
        name = "cpu-flash"
    elif device == "cuda" and all(
        d % 8 == 0 and d <= 256 for d in (head_dim, v_head_dim or head_dim)
    ):
        half = dtype in (torch.float16, torch.bfloat16)
        name = "cuda-flash" if half and (capability or (0, 0)) >= (8, 0) else "cuda-efficient"
    return name if all(has_op(op) for op in KERNELS[name].ops) else "unfused"


def pick_kernel(kind: str, q: torch.Tensor, v_head_dim: int | None = None) -> BlockKernel:
    """The kernel for blocks of queries like `q` [b, H, n, hd] and values of `v_head_dim`
    (None: hd) (kind: parallel.cp_kernel)."""
    cuda = q.device.type == "cuda"
    capability = torch.cuda.get_device_capability(q.device) if cuda else None
    name = kernel_name(kind, q.device.type, q.dtype, q.shape[-1], capability, v_head_dim)
    return KERNELS[name]
