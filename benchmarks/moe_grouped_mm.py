"""The routed experts' grouped SwiGLU on this machine: which implementation to keep.

One MoE layer's experts, forward and backward, over token copies sorted by expert with
uneven group sizes (drawn from a softmax router's top-k of random scores), three ways:
- `loop`: a Python loop over the groups, three matmuls each (`Experts._loop`);
- `grouped_mm`: `torch._grouped_mm` over the groups (`Experts`' choice on CPU; its CPU
  kernel needs rows of a multiple of 16 bytes);
- `padded_bmm`: each group gathered into a [experts, max group, dim] batch, zero-padded,
  and one `bmm` per matrix.
Each is checked against `loop` (max |difference| of outputs and gradients) and timed as
the median of `--rounds` rounds, with [min, max]; prints JSON.

    .venv/bin/python benchmarks/moe_grouped_mm.py                  # moe-small's layer
    .venv/bin/python benchmarks/moe_grouped_mm.py --experts 64 --tokens 8192 --dim 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tetrad.models.moe import Experts, top_k_stable


def loop(experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return experts._loop(x, counts)


def grouped_mm(experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    offs = counts.cumsum(0).to(torch.int32)
    gate = torch._grouped_mm(x, experts.w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, experts.w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, experts.w2.transpose(-2, -1), offs=offs)


def padded_bmm(experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    width = int(counts.max())
    starts = counts.cumsum(0) - counts
    slot = torch.arange(width)[None, :]  # [1, width]
    valid = slot < counts[:, None]  # [n, width]
    index = (starts[:, None] + slot).clamp(max=x.shape[0] - 1)
    batch = x[index] * valid[..., None]  # [n, width, dim], zero padding
    h = F.silu(batch @ experts.w1.transpose(1, 2)) * (batch @ experts.w3.transpose(1, 2))
    out = h @ experts.w2.transpose(1, 2)  # [n, width, dim]
    return out[valid]  # the groups back in order


IMPLEMENTATIONS = {"loop": loop, "grouped_mm": grouped_mm, "padded_bmm": padded_bmm}


def problem(experts: int, tokens: int, top_k: int, dim: int, ffn: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    module = Experts(experts, dim, ffn)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    scores = torch.randn(tokens, experts, generator=gen).softmax(-1)
    ids = top_k_stable(scores, top_k).reshape(-1)
    counts = torch.bincount(ids, minlength=experts)
    x = torch.randn(tokens * top_k, dim, generator=gen)
    return module, x, counts


def run(fn, module, x, counts, grad):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = fn(module, x, counts)
    out.backward(grad)
    return out.detach(), [x.grad, *(p.grad for p in module.parameters())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens routed (before top-k)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module, x, counts = problem(args.experts, args.tokens, args.top_k, args.dim, args.ffn, 0)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = run(loop, module, x, counts, grad)
    report = {"shape": vars(args), "group_sizes": counts.tolist(), "implementations": {}}
    usable, times = {}, {}
    for name, fn in IMPLEMENTATIONS.items():
        try:
            out, grads = run(fn, module, x, counts, grad)
        except RuntimeError as e:  # not in this build, or not on this device
            report["implementations"][name] = {"error": str(e).splitlines()[0]}
            continue
        pairs = zip([out, *grads], [ref_out, *ref_grads])
        usable[name] = max(float((a - b).abs().max()) for a, b in pairs)
        times[name] = []
    for _ in range(args.rounds):  # interleaved: a busy machine slows every one alike
        for name in usable:
            t0 = time.perf_counter()
            run(IMPLEMENTATIONS[name], module, x, counts, grad)
            times[name].append(time.perf_counter() - t0)
    for name, diff in usable.items():
        report["implementations"][name] = {
            "fwd_bwd_ms": 1e3 * statistics.median(times[name]),
            "min_max_ms": [1e3 * min(times[name]), 1e3 * max(times[name])],
            "max_abs_diff_vs_loop": diff,
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
