"""One MoE layer's routed experts: the path tetrad takes against the loop over experts.

    python scripts/gpu_check_moe.py [--json PATH] [--device cuda] [--dtype bf16]
        [--experts 8] [--tokens 4096] [--top-k 2] [--dim 1024] [--ffn 2048] [--rounds 20]

The path is `Experts`' own (`models.moe.grouped_linear`: torch's grouped matmul in bf16 on
CUDA compute capability 9.x, else a loop, announced with its reason: `path` and
`loop_reason` below); the loop is `loop_linear`, installed through `Experts.use_matmul`.
The last expert gets no token (empty groups are where grouped kernels have gone wrong).
Forward and backward of both, against an fp64 loop over the same values: each output and
gradient of the path must lie within twice the loop's distance from fp64 plus one rounding
of the largest value, and the empty expert's weight gradients must be exactly zero; on
9.x in bf16 the path must be the grouped kernel. Times: median milliseconds of one forward
and backward over `--rounds` interleaved rounds after a warm-up, synchronised (the loop's
host reads of the group sizes count). Prints one JSON object (and writes it to --json);
exit status 0 when it passed. scripts/gpu_check.py runs it as its `moe_grouped_mm` part.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tetrad.models.moe import Experts, grouped_linear, loop_linear, loop_reason_of, top_k_stable

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NAMES = ("out", "dx", "dw1", "dw3", "dw2")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check_moe", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="also write the JSON object here")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens routed (before top-k)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    if args.experts < 2 or not 1 <= args.top_k < args.experts or args.rounds < 1:
        raise ValueError(
            f"need --experts >= 2, 1 <= --top-k < --experts (the last expert gets no token) "
            f"and --rounds >= 1, got --experts {args.experts}, --top-k {args.top_k}, "
            f"--rounds {args.rounds}"
        )
    return args


def problem(args: argparse.Namespace):
    """Experts (weights ~ 1/sqrt(fan-in)), token copies grouped by a top-k routing of random
    scores that never picks the last expert, the group sizes, and an output gradient."""
    gen = torch.Generator().manual_seed(0)
    experts = Experts(args.experts, args.dim, args.ffn)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            fan_in = args.ffn if name == "w2" else args.dim
            p.copy_(torch.randn(p.shape, generator=gen) * fan_in**-0.5)
    scores = torch.randn(args.tokens, args.experts, generator=gen)
    scores[:, -1] = float("-inf")
    ids = top_k_stable(scores, args.top_k).reshape(-1)
    counts = torch.bincount(ids, minlength=args.experts)
    x = torch.randn(len(ids), args.dim, generator=gen)
    grad = torch.randn(x.shape, generator=gen)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    return experts.to(device, dtype), x.to(device, dtype), counts.to(device), grad.to(device, dtype)


def forward_backward(experts: Experts, x, counts, grad, matmul) -> list[torch.Tensor]:
    """The output and the gradients (x, w1, w3, w2) of `experts` run with `matmul`."""
    experts.zero_grad(set_to_none=True)
    experts.use_matmul(matmul)
    x = x.detach().requires_grad_()
    out = experts(x, counts)
    out.backward(grad)
    return [out.detach(), x.grad, experts.w1.grad, experts.w3.grad, experts.w2.grad]


def timed(run, device: torch.device) -> float:
    """Seconds of `run()`, the device drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - t0


def judge(path: list, loop: list, ref: list, dtype: torch.dtype) -> dict[str, Any]:
    """Each result of the path within 2 x the loop's distance from fp64 plus one rounding of
    the largest |value| (u: 2^-8 bf16, 2^-24 fp32), and their differences."""
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    out: dict[str, Any] = {"max_abs_diff_vs_loop": {}, "path_vs_fp64": {}, "loop_vs_fp64": {}}
    failed = []
    for name, p, lo, r in zip(NAMES, path, loop, ref):
        err_p, err_l = (float((t.double() - r).abs().max()) for t in (p, lo))
        out["max_abs_diff_vs_loop"][name] = float((p.double() - lo.double()).abs().max())
        out["path_vs_fp64"][name], out["loop_vs_fp64"][name] = err_p, err_l
        bound = 2 * err_l + u * float(r.abs().max())
        if not err_p <= bound:
            failed.append(f"{name}: {err_p:.3g} from fp64, over the bound {bound:.3g}")
    return out | {"failed": failed}


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Run both ways, judge, time: the JSON object."""
    experts, x, counts, grad = problem(args)
    device, dtype = x.device, x.dtype
    why = loop_reason_of(x, experts.w1)  # w3 alike, w2 transposed: the same widths
    reference = copy.deepcopy(experts).double()
    ref = forward_backward(reference, x.double(), counts, grad.double(), loop_linear)
    path = forward_backward(experts, x, counts, grad, grouped_linear)
    empty = max(float(g[-1].abs().max()) for g in path[2:])
    report = judge(path, forward_backward(experts, x, counts, grad, loop_linear), ref, dtype)
    if empty != 0:
        report["failed"].append(f"the empty expert's weight gradients reach {empty:.3g}, not 0")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if why is not None and capability and capability[0] == 9 and dtype == torch.bfloat16:
        report["failed"].append(f"on compute capability 9.x in bf16 the loop ran: {why}")
    ms = median_ms(experts, x, counts, grad, args.rounds)
    return report | {
        "ok": not report["failed"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "capability": list(capability) if capability else None,
        "dtype": args.dtype,
        "shape": {k: getattr(args, k) for k in ("experts", "tokens", "top_k", "dim", "ffn")},
        "group_sizes": counts.tolist(),
        "path": "grouped_mm" if why is None else "loop",
        "loop_reason": why,
        "empty_expert_grad_max": empty,
        "fwd_bwd_ms": ms,
        "speedup_over_loop": ms["loop"] / ms["path"],
    }


def median_ms(experts: Experts, x, counts, grad, rounds: int) -> dict[str, float]:
    """Median milliseconds of a forward and backward, the path's and the loop's, over
    `rounds` interleaved rounds (a busy device slows both alike)."""
    times: dict[str, list[float]] = {"path": [], "loop": []}
    for _ in range(rounds):
        for name, matmul in (("path", grouped_linear), ("loop", loop_linear)):
            run = functools.partial(forward_backward, experts, x, counts, grad, matmul)
            times[name].append(timed(run, x.device))
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"gpu_check_moe: error: {e}", file=sys.stderr)
        return 2
    report = check(args)  # its untimed runs warm both ways up
    text = json.dumps(report, indent=2, sort_keys=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
