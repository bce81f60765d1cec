"""`tetrad bench comm`: what each collective costs on this backend, nccl-tests style.

For every operation and buffer size it reports the time per call (the slowest rank's
mean), the algorithm bandwidth `size / time` and the bus bandwidth `algbw * factor`, the
factor being what a ring makes each rank send per buffer byte (all-reduce 2(n-1)/n,
all-gather and reduce-scatter (n-1)/n, broadcast and send/recv 1). "size" is the full
buffer: the all-reduced tensor, the all-gather output, the reduce-scatter input.

It also fits the alpha-beta model `time = alpha + size / beta` per operation, by least
squares on relative error (so the small, latency-bound sizes weigh as much as the large,
bandwidth-bound ones); the planner calibrates its communication costs from that fit.

Each point runs at most `--iters` timed calls and stops early past `--seconds`, so the
large, slow sizes (256 MB on gloo) cost a call or two each and a default run at 2 to 4 CPU
ranks takes well under a minute. The ranks are started through torchrun, like `tetrad
train`; under an existing torchrun (several nodes) it just runs. Every measured call goes
through `tetrad.comm.Comm`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tetrad.comm import Comm, bus_factor
from tetrad.comm.watchdog import Watchdog, nccl_environment
from tetrad.devices import Clock
from tetrad.launch import launch, under_torchrun
from tetrad.mesh import Group

TIMEOUT_S = 600.0  # the process group's, and the closing barrier's watchdog

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Buffer sizes min, min*factor, ... up to max (inclusive when it falls on the grid)."""
    if min_bytes < 4 or max_bytes < min_bytes or factor < 2:
        raise ValueError(
            f"need 4 <= min_bytes <= max_bytes and factor >= 2, got min_bytes={min_bytes}, "
            f"max_bytes={max_bytes}, factor={factor}"
        )
    out = [min_bytes]
    while out[-1] * factor <= max_bytes:
        out.append(out[-1] * factor)
    return out


def parse_ops(text: str) -> list[str]:
    """A comma-separated subset of OPS ('all' for every one)."""
    ops = list(OPS) if text == "all" else [o.strip() for o in text.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise ValueError(f"unknown ops {unknown or text!r}; choose from {OPS} or 'all'")
    return ops


# --- measuring (one rank) ----------------------------------------------------------------


def _numel(nbytes: int, n: int) -> int:
    """float32 elements of a buffer of about `nbytes`, divisible by the group for the shards."""
    return max(n, nbytes // 4 // n * n)


def _operation(op: str, nbytes: int, comm: Comm, group: Group, device) -> Callable[[], None]:
    """A closure running one `op` on a buffer of about `nbytes`, through `comm`."""
    n, rank = group.size, group.rank
    numel = _numel(nbytes, n)
    full, shard = torch.ones(numel, device=device), torch.ones(numel // n, device=device)
    if op != "send_recv":
        return {
            "all_reduce": lambda: comm.all_reduce(full, group),
            "all_gather": lambda: comm.all_gather(full, shard, group),
            "reduce_scatter": lambda: comm.reduce_scatter(shard, full, group),
            "broadcast": lambda: comm.broadcast(full, 0, group),
        }[op]
    recv = torch.empty_like(full)
    # a ring: every rank sends to the next and receives from the previous, at once
    ops = [("send", full, group.ranks[(rank + 1) % n]), ("recv", recv, group.ranks[rank - 1])]

    def send_recv() -> None:
        for work in comm.batch_p2p(ops, group):
            work.wait()

    return send_recv


def _slowest(seconds: float, comm: Comm, group: Group) -> float:
    """The maximum of a per-rank time over the group (so every rank agrees on it)."""
    slowest = torch.tensor([seconds], dtype=torch.float64, device=comm.device)
    comm.all_reduce(slowest, group, op="max")
    return float(slowest)


def _timed(run: Callable[[], None], iters: int, clock: Clock) -> float:
    """Mean seconds per call. On a GPU the calls only enqueue work, so, as nccl-tests
    does, time them with events on the stream around all `iters` of them."""
    clock.drain()  # the device's queue empty before the first timed call
    t0 = clock.mark()
    for _ in range(iters):
        run()
    return clock.interval(t0, clock.mark()) / iters


def measure(
    op: str, nbytes: int, iters: int, seconds: float, comm: Comm, group: Group, device
) -> dict[str, Any]:
    """One row of the table: warm up, pick an iteration count that fits `seconds`, time it."""
    control = Comm(device)  # agreements between ranks are not part of the measured traffic
    run = _operation(op, nbytes, comm, group, device)
    clock = Clock(device)
    warm = _slowest(_timed(run, 1, clock), control, group)
    count = max(1, min(iters, int(seconds / max(warm, 1e-9))))
    _timed(run, max(1, count // 4), clock)  # more warm-up where it is cheap
    control.barrier(group)
    t = _slowest(_timed(run, count, clock), control, group)
    size = _numel(nbytes, group.size) * 4
    algbw = size / t
    return {
        "op": op,
        "bytes": size,
        "iters": count,
        "time_s": t,
        "algbw_GBps": algbw / 1e9,
        "busbw_GBps": algbw * bus_factor(op, group.size) / 1e9,
    }


def fit_alpha_beta(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """time = alpha + bytes / beta by least squares on relative error, alpha >= 0.

    beta is None when time does not grow with size over the measured range (all latency).
    """
    s = np.array([r["bytes"] for r in rows], dtype=np.float64)
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    # dividing each equation by t_i minimises the relative residual (alpha + s/beta - t) / t
    a = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones_like(s), rcond=None)
    if alpha < 0:  # latency cannot be negative: refit through the origin
        alpha, inv_beta = 0.0, float(np.sum(s / t) / np.sum((s / t) ** 2))
    if inv_beta <= 0:  # bandwidth cannot be negative: a constant time
        alpha, inv_beta = float(np.sum(1 / t) / np.sum(1 / t**2)), 0.0
    return {
        "alpha_s": float(alpha),
        "beta_Bps": 1.0 / inv_beta if inv_beta > 0 else None,
        "max_rel_err": float(np.max(np.abs(alpha + s * inv_beta - t) / t)),  # of the fit
        "points": len(rows),
    }


def run_bench(args: argparse.Namespace, group: Group, device) -> dict[str, Any]:
    """Every (op, size) row and each op's alpha-beta fit, identical on every rank."""
    comm = Comm(device)
    grid = sizes(args.min_bytes, args.max_bytes, args.factor)
    rows, fits = [], {}
    for op in parse_ops(args.ops):
        mine = [measure(op, n, args.iters, args.seconds, comm, group, device) for n in grid]
        fit = fit_alpha_beta(mine)
        fit["bus_factor"] = bus_factor(op, group.size)
        beta = fit["beta_Bps"]
        fit["busbw_beta_Bps"] = beta * fit["bus_factor"] if beta is not None else None
        rows += mine
        fits[op] = fit
    return {
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "world": group.size,
        "device": str(device.type),
        "dtype": "float32",
        "results": rows,
        "alpha_beta": fits,
    }


# --- reporting ----------------------------------------------------------------------------


def _human(nbytes: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _gbps(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / 1e9:.3f}"


def print_table(report: dict[str, Any]) -> None:
    """The human view, on stderr (stdout carries the JSON)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tetrad bench comm: {report['backend']}, {report['world']} ranks, float32")
    for col in ("op", "size", "iters", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for r in report["results"]:
        table.add_row(
            r["op"], _human(r["bytes"]), str(r["iters"]), f"{r['time_s'] * 1e6:,.1f}",
            f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}",
        )  # fmt: skip
    fit = Table(title="alpha-beta fit: time = alpha + size / beta")
    for col in ("op", "alpha (us)", "beta algbw (GB/s)", "beta busbw (GB/s)", "max rel err"):
        fit.add_column(col, justify="left" if col == "op" else "right")
    for op, f in report["alpha_beta"].items():
        fit.add_row(
            op, f"{f['alpha_s'] * 1e6:,.1f}", _gbps(f["beta_Bps"]), _gbps(f["busbw_beta_Bps"]),
            f"{f['max_rel_err']:.2f}",
        )  # fmt: skip
    Console(stderr=True).print(table, fit)


# --- processes ----------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    """One rank under torchrun: join, measure, rank 0 reports, leave cleanly."""
    if threads := int(os.environ.get("TETRAD_THREADS", "0")):
        torch.set_num_threads(threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # NCCL needs one GPU per local rank; with fewer, measure gloo on the CPU instead
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
        nccl_environment()  # before the process group: async error handling, flight recorder
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=TIMEOUT_S))
    watchdog = Watchdog(TIMEOUT_S)
    try:
        group = Group("world", list(range(world)), rank, dist.group.WORLD)
        report = run_bench(args, group, device)
        if rank == 0:
            emit(report, args.json)
        Comm(device, watchdog).barrier(group)  # counted, numbered and watched
    finally:
        watchdog.close()
        dist.destroy_process_group()
    return 0


def emit(report: dict[str, Any], path: str | None) -> None:
    """Table on stderr, JSON on stdout and in `path` if given."""
    print_table(report)
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if path:
        with open(path, "w") as fh:
            fh.write(text + "\n")


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """`tetrad bench comm`: validate the flags, then launch the ranks (or be one)."""
    sizes(args.min_bytes, args.max_bytes, args.factor)  # fail here, not in every rank
    parse_ops(args.ops)
    if args.iters < 1 or args.seconds <= 0:
        raise ValueError(f"need iters >= 1 and seconds > 0, got {args.iters}, {args.seconds}")
    if under_torchrun():
        return worker(args)
    if args.nproc < 2:
        raise ValueError(f"--nproc must be >= 2 to measure collectives, got {args.nproc}")
    return launch(args.nproc, argv)
