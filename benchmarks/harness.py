"""What the side-by-side benchmarks share: the job, the peer's model, data and optimizer
step, the alternating timed rounds, the memory and collective instruments, the report.

The peer (DDP, FSDP2, DTensor TP, pipelining) starts from tetrad's exact initial weights,
reads the same batches and takes the same optimizer step, so the two runs are numerically
comparable step by step. Timed blocks of the two alternate in rounds; a ratio is the median
of the rounds' ratios (each compares blocks run back to back, so load that comes and goes
on a shared machine hits both of its sides alike), reported with its spread over rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tetrad.comm import bus_factor
from tetrad.config import Config, TrainConfig, from_dict
from tetrad.mesh import Mesh
from tetrad.models.flops import param_count
from tetrad.models.init import materialize
from tetrad.models.llama import Llama, cross_entropy_sum
from tetrad.train.data import Loader, source_of
from tetrad.train.loop import Trainer
from tetrad.train.optim import build_optimizer, lr_at, set_lr

Step = Callable[[], float]  # one optimizer step; returns the step's loss
T = TypeVar("T")


def job(model: dict, parallel: dict, steps: int, batch: int = 16, data: str = "stdlib") -> Config:
    """A benchmark's job: `batch` sequences of 128 tokens per step (`steps` of them: the LR
    schedule's length)."""
    train = {"steps": steps, "global_batch": batch, "seq_len": 128, "progress": False}
    raw = {"model": model, "train": train, "data": {"source": data}, "parallel": parallel}
    return from_dict(raw)


def arguments(
    doc: str, sizes: str, steps: int, rounds: int, warmup: int = 0
) -> argparse.ArgumentParser:
    """The command line every benchmark shares: sizes to run, steps per timed block (none
    if 0), measured warm-up steps (none if 0), rounds."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument(sizes, type=int, nargs="+", default=[2, 4], help="world sizes")
    if steps:
        p.add_argument("--steps", type=int, default=steps, help="timed steps per round and side")
    if warmup:
        p.add_argument("--warmup", type=int, default=warmup, help="measured, untimed steps")
    p.add_argument("--rounds", type=int, default=rounds)
    return p


# --- the two sides ------------------------------------------------------------------------


def tetrad_trainer(cfg: Config, rank: int, **degrees: int) -> tuple[Trainer, Step]:
    """tetrad's Trainer on this rank (axes not given have degree 1) and its step, after
    which the trainer's comm counters hold that step's collectives alone."""
    mesh = Mesh.build(replace(cfg.parallel, **degrees), rank)
    trainer = Trainer(cfg, mesh, torch.device("cpu"))

    def step() -> float:
        trainer.comm.reset()
        return trainer.train_step().loss

    return trainer, step


def peer_model(cfg: Config) -> Llama:
    """The full model on CPU with tetrad's layout-invariant initial weights."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    return materialize(model, cfg.model, cfg.train.seed, "cpu")


def peer_loader(cfg: Config, data_rank: int = 0, data_ranks: int = 1) -> Loader:
    """The loader tetrad's trainer would give this data rank (one microbatch per step)."""
    source = source_of(cfg)
    t = cfg.train
    return Loader(source, t.global_batch, t.seq_len, data_rank, data_ranks, 1)


def global_tokens(micro: list) -> float:
    """Target tokens of the whole global batch: the loss denominator, as tetrad uses it."""
    count = torch.tensor([float(sum(mb.tokens for mb in micro))], dtype=torch.float64)
    dist.all_reduce(count)
    return float(count.item())


def peer_adamw(named: list[tuple[str, nn.Parameter]], train: TrainConfig) -> torch.optim.AdamW:
    """tetrad's AdamW groups (decay or not, same hyperparameters), run fused as torchtitan
    configures it (also the fastest here); a fused kernel takes DTensors and plain tensors
    in separate groups."""
    groups = []
    for dtensor in (True, False):
        part = [(n, p) for n, p in named if isinstance(p, DTensor) == dtensor]
        if part:
            groups += build_optimizer(part, train).param_groups
    settings = [{k: v for k, v in g.items() if k not in ("foreach", "fused")} for g in groups]
    return torch.optim.AdamW(settings, fused=True)


class PeerOptimizer:
    """The peer's optimizer step, taken as tetrad's Trainer takes its own: tetrad's LR
    schedule, global-norm clipping with the norm summed in float64, no update when the
    loss or the norm is not finite, and one all-reduce that agrees on both.

    The squared norm sums, over ranks, what each rank holds alone (DTensor shards, and
    plain gradients when `plain_sharded`, as in a pipeline stage); replicated gradients
    count on rank 0 only, as tetrad counts them on one coordinate. Partial DTensor
    gradients are reduced to their parameter's placement first. With `whole_grads`
    (DDP: every rank holds the whole reduced gradient) each rank takes the whole norm
    itself, as `clip_grad_norm_` does under DDP, while the loss is all-reduced alone,
    asynchronously: tetrad's step with data parallelism alone.
    """

    def __init__(
        self,
        model: nn.Module,
        train: TrainConfig,
        plain_sharded: bool = False,
        whole_grads: bool = False,
    ):
        self.params = list(model.parameters())
        self.optimizer = peer_adamw(list(model.named_parameters()), train)
        self.train, self.plain_sharded, self.count = train, plain_sharded, 0
        self.whole_grads = whole_grads

    def step(self, loss: torch.Tensor, replicated_loss: bool = False) -> float:
        """Clip, update, zero the gradients; return the step's loss. `loss` is this rank's
        part of it (summed over ranks), or all of it on every rank if `replicated_loss`."""
        first = dist.get_rank() == 0
        own = loss.detach() if first or not replicated_loss else torch.zeros(())
        for p in self.params:
            if isinstance(p.grad, DTensor) and any(x.is_partial() for x in p.grad.placements):
                # pending sums (SP's norm weights): done once, here, not again in the update
                p.grad = p.grad.redistribute(placements=p.placements)
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.whole_grads:
            summed = own.double().reshape(())
            pending = dist.all_reduce(summed, async_op=True)
            sq = self._own_sq(grads, True)
            pending.wait()
            agreed = torch.stack([summed, sq])
        else:
            agreed = torch.stack([own.double().reshape(()), self._own_sq(grads, first)])
            dist.all_reduce(agreed)
        total, norm = float(agreed[0]), math.sqrt(float(agreed[1]))
        if math.isfinite(total) and math.isfinite(norm):
            clip = self.train.grad_clip
            if clip > 0 and norm > clip:
                dtensors = [g for g in grads if isinstance(g, DTensor)]
                for group in (dtensors, [g for g in grads if not isinstance(g, DTensor)]):
                    if group:  # a foreach kernel takes one kind of tensor per list
                        torch._foreach_mul_(group, clip / (norm + 1e-6))
            set_lr(self.optimizer, lr_at(self.count, self.train))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.count += 1
        return total

    def _own_sq(self, grads: list[torch.Tensor], first: bool) -> torch.Tensor:
        """The squared norm of what this rank counts, in one foreach kernel with each
        tensor's norm in float64 (as tetrad's engine takes it, and as torch's
        `clip_grad_norm_` takes its norms: foreach)."""
        own = []
        for g in grads:
            if isinstance(g, DTensor):
                alone = any(p.is_shard() for p in g.placements)
                g = g.to_local()
            else:
                alone = self.plain_sharded
            if alone or first:
                own.append(g)
        if not own:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(torch._foreach_norm(own, 2, dtype=torch.float64)).square().sum()


# --- timing -------------------------------------------------------------------------------


def timed_block(step_fn: Step, steps: int, losses: list[float]) -> tuple[float, float]:
    """(wall seconds on the slowest rank, CPU seconds summed over ranks) of `steps` steps."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        losses.append(step_fn())
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall), float(cpu)


def alternate(blocks: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Run every block once per round, the order rotated by one each round (with two:
    alternating), so each round compares blocks run back to back; results per block."""
    out: dict[str, list[T]] = {name: [] for name in blocks}
    names = list(blocks)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(blocks[name]())
    return out


def race(
    makers: dict[str, Callable[[], tuple[Any, Step]]],
    warmup: int,
    steps: int,
    rounds: int,
    around: dict[str, AbstractContextManager] | None = None,
) -> tuple[dict[str, Any], dict[str, dict]]:
    """Each side built and warmed up under the memory instrument (`start`), one after the
    other, then `rounds` alternating timed blocks of `steps` steps each. Returns the built
    objects and {"losses", "peaks", "seconds": [(wall, cpu) per round]}, each by side."""
    objects, step_of, losses, peaks = {}, {}, {}, {}
    for name, make in makers.items():
        losses[name] = []
        ctx = (around or {}).get(name)
        objects[name], step_of[name], peaks[name] = start(make, warmup, losses[name], ctx)
    blocks = {n: partial(timed_block, f, steps, losses[n]) for n, f in step_of.items()}
    seconds = alternate(blocks, rounds)
    return objects, {"losses": losses, "peaks": peaks, "seconds": seconds}


def side(runner: Any) -> tuple[Any, Step]:
    """A peer runner as `race` takes it: the object and its step."""
    return runner, runner.train_step


# --- instruments --------------------------------------------------------------------------


def start(
    make: Callable[[], tuple[Any, Step]],
    warmup: int,
    losses: list[float],
    around: AbstractContextManager | None = None,
) -> tuple[Any, Step, dict[str, int]]:
    """Build with `make()` (the object and its step) and run `warmup` steps, the last one
    inside `around`, under the memory instrument: peak live tensor bytes in the c10 CPU
    allocator, as torch.profiler (profile_memory=True) sees every allocation and free,
    counted from the start of construction (so model state is included). Returns the
    object, its step, and the peaks over construction and steps ("build") and over the
    steps ("step"), max over ranks. Not RSS: libtorch's code, Python objects and gloo's
    non-tensor buffers are out. The instrument sums the allocations and frees it sees, so
    garbage made earlier is collected first: freed inside the window, it would count
    negative and hide part of the peak."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        obj, step = make()
        with record_function("steps"):
            for i in range(warmup):
                with around if around and i == warmup - 1 else nullcontext():
                    losses.append(step())
    peaks = torch.tensor(_peaks(prof.profiler.kineto_results.events()), dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return obj, step, {"build": int(peaks[0]), "step": int(peaks[1])}


def _peaks(events: list) -> tuple[int, int]:
    steps = next(e for e in events if e.name() == "steps")
    lo, hi = steps.start_ns(), steps.start_ns() + steps.duration_ns()
    live = peak_all = peak_steps = 0
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    for e in memory:
        live += e.nbytes()
        peak_all = max(peak_all, live)
        if lo <= e.start_ns() <= hi:
            peak_steps = max(peak_steps, live)
    return peak_all, peak_steps


class CollectiveCounter(TorchDispatchMode):
    """Each rank's buffer bytes (all-gather: the gathered output; others: the input) and
    ring bus bytes of the collectives run under this mode, eager (torch.distributed's) or
    functional (what DTensor desugars into), by kind; any other collective is named in
    `uncounted`, so a missed one cannot hide."""

    BUFFER = {  # op -> (kind, which tensor is the buffer: from args and the output)
        "allreduce_": ("all_reduce", lambda args, out: args[0][0]),
        "all_reduce": ("all_reduce", lambda args, out: args[0]),
        "_allgather_base_": ("all_gather", lambda args, out: args[0]),
        "all_gather_into_tensor": ("all_gather", lambda args, out: out),
        "_reduce_scatter_base_": ("reduce_scatter", lambda args, out: args[1]),
        "reduce_scatter_tensor": ("reduce_scatter", lambda args, out: args[0]),
    }
    SILENT = ("wait_tensor", "_wrap_tensor_autograd")

    def __init__(self, world: int):
        super().__init__()
        self.world, self.uncounted = world, set()
        self.counts: dict[str, dict[str, float]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet.__module__.endswith(("_c10d_functional", ".c10d")):
            self._count(packet.__name__, args, out)
        return out

    def _count(self, name: str, args: tuple, out: Any) -> None:
        if name not in self.BUFFER:
            if name not in self.SILENT:
                self.uncounted.add(name)
            return
        kind, buffer = self.BUFFER[name]
        t = buffer(args, out)
        size = t.numel() * t.element_size()
        c = self.counts.setdefault(kind, {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
        c["calls"] += 1
        c["bytes"] += size
        c["bus_bytes"] += bus_factor(kind, self.world) * size

    def summary(self) -> dict[str, Any]:
        """{kind: {calls, bytes, bus_bytes}} and the uncounted collectives' names."""
        return {"by_kind": self.counts, "uncounted": sorted(self.uncounted)}


# --- the report ---------------------------------------------------------------------------


def spread(ratios: list[float]) -> dict[str, list[float]]:
    """Every round's ratio, their interquartile range, and a 95% bootstrap interval of
    their median (2000 resamples of the rounds, a fixed seed)."""
    if len(ratios) > 1:
        iqr = statistics.quantiles(ratios, n=4, method="inclusive")[::2]
    else:
        iqr = ratios * 2
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return {
        "rounds": [round(x, 3) for x in ratios],
        "iqr": [round(x, 3) for x in iqr],
        "ci95": [round(boot[50], 3), round(boot[1949], 3)],
    }


def ratio_fields(key: str, ratios: list[float], stem: str = "ratio") -> dict[str, Any]:
    """`key`: the median of the rounds' ratios; `<stem>_rounds`, `_iqr`, `_ci95` its spread."""
    fields: dict[str, Any] = {key: round(statistics.median(ratios), 3)}
    return fields | {f"{stem}_{k}": v for k, v in spread(ratios).items()}


def timing(seconds: dict[str, list[tuple[float, float]]], cfg: Config, steps: int) -> dict:
    """tokens/s and CPU seconds per step (summed over ranks: what other jobs on a shared
    machine disturb least) of tetrad and its peer, medians over rounds, and their ratios
    with spreads. `seconds`: (wall, cpu) of each round's `steps` steps."""
    (peer,) = set(seconds) - {"tetrad"}
    tokens = cfg.train.global_batch * cfg.train.seq_len * steps
    tps = {k: [tokens / wall for wall, _ in v] for k, v in seconds.items()}
    cpu = {k: [c / steps for _, c in v] for k, v in seconds.items()}
    return {
        "tetrad_tokens_per_s": round(statistics.median(tps["tetrad"]), 1),
        f"{peer}_tokens_per_s": round(statistics.median(tps[peer]), 1),
        **ratio_fields(f"ratio_tetrad_over_{peer}", _ratios(tps["tetrad"], tps[peer])),
        "tetrad_tokens_per_s_rounds": [round(x, 1) for x in tps["tetrad"]],
        f"{peer}_tokens_per_s_rounds": [round(x, 1) for x in tps[peer]],
        "tetrad_cpu_s_per_step": round(statistics.median(cpu["tetrad"]), 4),
        f"{peer}_cpu_s_per_step": round(statistics.median(cpu[peer]), 4),
        **ratio_fields(
            f"cpu_ratio_{peer}_over_tetrad", _ratios(cpu[peer], cpu["tetrad"]), "cpu_ratio"
        ),
    }


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def memory(peaks: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Peak tensor bytes of both sides (see `start`) and the ratio of the step peaks."""
    (peer,) = set(peaks) - {"tetrad"}
    fields: dict[str, Any] = {f"{k}_peak_step_bytes": v["step"] for k, v in peaks.items()}
    fields[f"peak_step_ratio_tetrad_over_{peer}"] = round(
        peaks["tetrad"]["step"] / peaks[peer]["step"], 3
    )
    return fields | {f"{k}_peak_build_bytes": v["build"] for k, v in peaks.items()}


def rel_diffs(a: list[float], b: list[float]) -> list[float]:
    """Relative differences of two loss curves, step by step."""
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def report(benchmark: str, cfg: Config, results: list, **fields: Any) -> None:
    """Print the JSON report: what ran, on what, then `fields` and the result rows."""
    m = cfg.model
    out = {
        "benchmark": benchmark,
        "model": {k: getattr(m, k) for k in ("layers", "dim", "heads", "kv_heads", "vocab")},
        "params": param_count(m),
        "global_batch": cfg.train.global_batch,
        "seq_len": cfg.train.seq_len,
        "backend": "gloo",
        "threads_per_rank": 1,
        "torch": torch.__version__,
    }
    print(json.dumps(out | fields | {"results": results}, indent=2))


class FSDP2Runner:
    """tetrad's training step written the usual FSDP2 way: `fully_shard` on each block and
    the root. `wrap(model)`, if given, rewraps the blocks first (activation checkpointing,
    as torchtitan applies it before sharding)."""

    def __init__(self, cfg: Config, rank: int, world: int, wrap: Callable | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.world = world
        model = peer_model(cfg)
        if wrap is not None:
            wrap(model)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = PeerOptimizer(model, cfg.train)
        self.loader = peer_loader(cfg, rank, world)

    def train_step(self) -> float:
        """One optimizer step; returns the global mean token loss."""
        (mb,) = self.loader.next()
        loss = cross_entropy_sum(self.model(mb.inputs), mb.targets) / global_tokens([mb])
        # FSDP2 averages gradients over the world; tetrad sums with a global denominator
        (loss * self.world).backward()
        return self.optimizer.step(loss)
