"""Helpers for multi-process tests and benchmarks: spawn N gloo ranks, fail fast, name the rank.

`spawn(fn, world, *args)` starts `world` processes on loopback, runs `fn(rank, world, *args)`
in each, and returns their results in rank order. A rank that raises, dies or outlives the
timeout fails the whole call with an error naming it; every process is killed on the way
out, so a hang never outlives its test.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tetrad.comm import Comm
from tetrad.comm.watchdog import Watchdog
from tetrad.launch import free_port
from tetrad.mesh import Group


class _ByValue(pickle.Pickler):
    """Pickles every tensor detached, on the CPU and by value (torch's queues would share
    its memory with a dying process)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.detach().cpu().clone().__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return NotImplemented


def _entry(rank, fn, world, port, results, threads, timeout, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(threads)
    try:
        if world > 1:  # env://: the variables above
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        out = fn(rank, world, *args)
        if world > 1:
            _leave_together(rank, world, timeout)
        buffer = io.BytesIO()
        _ByValue(buffer).dump(out)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave_together(rank: int, world: int, timeout: float) -> None:
    """The closing barrier, through `Comm` (counted and watched: a rank that never
    arrives is named by the others' watchdogs)."""
    watchdog = Watchdog(timeout)
    try:
        Comm("cpu", watchdog).barrier(Group("world", list(range(world)), rank, dist.group.WORLD))
    finally:
        watchdog.close()


# What every rank imports before its first line of work: torch, tetrad's training modules,
# and two that torch imports lazily on every rank's first step (about 800 modules, 1.4 s of
# CPU per rank): torch._dynamo, from the optimizer's constructor, and the symbolic shapes
# (with sympy), from materialising the meta-initialised model
PRELOAD = [
    "torch", "torch.distributed", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
    "tetrad.train.loop",
]  # fmt: skip


def spawn(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0, threads: int = 1
) -> list[Any]:
    """Run fn(rank, world, *args) on `world` gloo ranks; results in rank order."""
    # New ranks fork from a server process that has imported torch and tetrad's training
    # modules (PRELOAD): starting a rank then takes milliseconds, not the ~2 s of CPU that
    # importing torch costs, which is most of a small test's time. The server imports only
    # (no parallel op, so no thread pool that a fork would copy half-made); a rank starts
    # from that state, and from nothing of the calling process.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first spawn)
    results = ctx.Queue()
    job = (fn, world, free_port(), results, threads, timeout, args)  # the same for every rank
    procs = [ctx.Process(target=_entry, args=(r, *job), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return [pickle.loads(out) for out in _collect(procs, results, world, timeout)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


EXIT_GRACE_S = 10.0  # how long a result may trail its rank's exit (a loaded machine)


def _collect(procs, results, world: int, timeout: float) -> list[Any]:
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world:
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(out))
            raise TimeoutError(f"ranks {missing} of {world} did not finish within {timeout:.0f}s")
        gone = [
            (r, p.exitcode) for r, p in enumerate(procs) if r not in out and p.exitcode is not None
        ]
        try:  # a rank exits once its result is in the pipe: it may not be read yet
            rank, ok, payload = results.get(timeout=EXIT_GRACE_S if gone else 0.5)
        except queue.Empty:
            if not gone:
                continue
            r, code = gone[0]
            raise RuntimeError(f"rank {r} exited with code {code} without a result") from None
        if not ok:
            raise RuntimeError(f"rank {rank} of {world} failed:\n{payload}")
        out[rank] = payload
    return [out[r] for r in range(world)]
