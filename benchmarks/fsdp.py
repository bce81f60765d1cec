"""tetrad's ZeRO-3 against PyTorch's FSDP2 (`fully_shard`), side by side.

Same model (tetrad's Llama: 8 layers, dim 128, 4 heads, 2 kv heads, vocab 256), same
batches (16 x 128 tokens of the standard-library corpus per step), same optimizer, LR
schedule, clipping and loss semantics, same world (gloo, 1 thread per rank), in the same
processes. FSDP2 shards each transformer block and then the root, as torchtitan does,
with its defaults (reshard after forward, implicit prefetching); tetrad runs its ZeRO-3
with its defaults (the same policy). Both start from the same weights, so their losses
must agree.

Throughput: timed rounds alternate between the two (`--steps` steps each); tokens/s is the
median over rounds and the ratio the median of the rounds' ratios, which keeps it
meaningful on a shared machine whose load changes.

Peak memory per rank: the peak of live tensor bytes in the c10 CPU allocator, as
torch.profiler (profile_memory=True) reports every allocation and free, counted from
the start of the implementation's construction (so its model state is included) and
maximised over the warm-up steps (`peak_step_bytes`) and over construction too
(`peak_build_bytes`); max over ranks. It is not RSS: it excludes libtorch's code, Python
objects and gloo's non-tensor buffers, which both sides share.

Bytes per step: the buffer bytes each rank hands to collectives in one steady step
(all-gather: the gathered output; reduce-scatter: the full input), and the ring's bus
bytes ((n-1)/n of those). tetrad's come from its comm counters; FSDP2's from wrapping
`torch.distributed`'s collectives while its steps run.

    .venv/bin/python benchmarks/fsdp.py            # fsdp 2 and 4, prints JSON
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from peer_harness import global_tokens, peer_loader, peer_model, timed_block
from tetrad.comm import bus_factor
from tetrad.config import Config, from_dict, model_preset
from tetrad.mesh import Mesh
from tetrad.models.flops import param_count
from tetrad.models.llama import cross_entropy_sum
from tetrad.parallel.memory import measure_at_each_step, model_state_bytes, zero_formula_bytes
from tetrad.testing import spawn
from tetrad.train.loop import Trainer
from tetrad.train.optim import build_optimizer, lr_at, set_lr


def bench_config(world: int, steps: int) -> Config:
    """The benchmark job: 8-layer small Llama, stdlib corpus, 16 x 128 tokens, fsdp = world."""
    cfg = from_dict(
        {
            "train": {"steps": steps, "global_batch": 16, "seq_len": 128, "progress": False},
            "data": {"source": "stdlib"},
            "parallel": {"fsdp": world, "zero_stage": 3},
        }
    )
    cfg.model = model_preset("small")
    cfg.model.layers = 8
    return cfg


class CommCounter:
    """Counts FSDP2's collectives by wrapping torch.distributed's (only while enabled)."""

    # the tensor whose size is the buffer: (positional index, keyword)
    OPS = {
        "all_gather_single": (0, "output"),
        "reduce_scatter_single": (1, "input"),
        "all_reduce": (0, "tensor"),
    }

    def __init__(self, world: int):
        self.world, self.enabled = world, False
        self.bytes: dict[str, float] = defaultdict(float)
        self.bus: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for name, where in self.OPS.items():
            setattr(dist, name, self._wrap(name, getattr(dist, name), *where))

    def _wrap(self, name: str, fn, index: int, keyword: str):
        op = name.replace("_single", "")

        def counted(*args, **kwargs):
            if self.enabled:
                t = args[index] if len(args) > index else kwargs[keyword]
                nbytes = t.numel() * t.element_size()
                self.calls[op] += 1
                self.bytes[op] += nbytes
                self.bus[op] += bus_factor(op, self.world) * nbytes
            return fn(*args, **kwargs)

        return counted


class FSDP2Runner:
    """The same training step as tetrad's Trainer, written the usual FSDP2 way."""

    def __init__(self, cfg: Config, rank: int, world: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.cfg, self.world = cfg, world
        model = peer_model(cfg)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = build_optimizer(list(model.named_parameters()), cfg.train)
        self.loader = peer_loader(cfg, rank, world)
        self.step = 0

    def train_step(self) -> float:
        """One optimizer step; returns the global mean token loss."""
        micro = self.loader.next()
        tokens = global_tokens(micro)
        total = torch.zeros((), dtype=torch.float64)
        for mb in micro:
            # FSDP2 averages gradients over the world; tetrad sums with a global denominator
            loss = cross_entropy_sum(self.model(mb.inputs), mb.targets) / tokens
            (loss * self.world).backward()
            total += loss.detach().double()
        agreed = torch.stack([total, self._local_sq_norm()])
        dist.all_reduce(agreed)
        norm = math.sqrt(float(agreed[1]))
        if math.isfinite(float(agreed[0])) and math.isfinite(norm):
            clip = self.cfg.train.grad_clip
            if clip > 0 and norm > clip:
                for p in self.model.parameters():
                    p.grad.mul_(clip / (norm + 1e-6))
            set_lr(self.optimizer, lr_at(self.step, self.cfg.train))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(agreed[0])

    def _local_sq_norm(self) -> torch.Tensor:
        grads = [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]
        return sum(g.double().pow(2).sum() for g in grads)


def peak_tensor_bytes(prof) -> tuple[int, int]:
    """(peak over everything profiled, peak inside the "steps" range) of live tensor bytes."""
    events = prof.profiler.kineto_results.events()
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


def build_profiled(make, warmup: int, losses: list[float]):
    """Construct with `make()` and run `warmup` steps under the memory profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner, step = make()
        with record_function("steps"):
            for _ in range(warmup):
                losses.append(step())
    return runner, step, peak_tensor_bytes(prof)


def memory_table(rank: int, world: int, cfg: Config) -> list[dict[str, Any]]:
    """Model state per rank, measured at the optimizer step vs predicted, for every stage
    and dtype (one step each), with the ZeRO paper's formula beside it."""
    rows = []
    for dtype, (p, g, k) in (("fp32", (4, 4, 8)), ("bf16", (2, 2, 12))):
        for stage in (1, 2, 3):
            job = from_dict(cfg.to_dict())
            job.parallel.zero_stage, job.train.dtype = stage, dtype
            mesh = Mesh.build({"pp": 1, "dp": 1, "fsdp": world, "tp": 1}, rank)
            trainer = Trainer(job, mesh, torch.device("cpu"))
            found = measure_at_each_step(trainer.engine, trainer.optimizer)
            trainer.train_step()
            predicted = model_state_bytes(job, rank)
            formula = zero_formula_bytes(param_count(job.model), world, stage, p, g, k)
            same = torch.tensor([float(found[-1] == predicted)])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)  # exact on every rank
            rows.append(
                {
                    "stage": stage,
                    "dtype": dtype,
                    "measured_rank0": vars(found[-1]),
                    "predicted_rank0": vars(predicted),
                    "formula": {k: int(v) for k, v in vars(formula).items()},
                    "measured_equals_predicted_on_every_rank": bool(same.item()),
                }
            )
    return rows


def worker(rank: int, world: int, cfg_dict: dict, steps: int, warmup: int, rounds: int) -> dict:
    """Both implementations on this rank: profiled warm-up, then alternating timed rounds."""
    cfg = from_dict(cfg_dict)
    counter = CommCounter(world)
    losses: dict[str, list[float]] = {"tetrad": [], "fsdp2": []}
    states: list = []  # tetrad's model state, measured at each optimizer step

    def make_tetrad():
        mesh = Mesh.build({"pp": 1, "dp": 1, "fsdp": world, "tp": 1}, rank)
        trainer = Trainer(cfg, mesh, torch.device("cpu"))
        states.extend([measure_at_each_step(trainer.engine, trainer.optimizer)])
        return trainer, lambda: trainer.train_step().loss

    def make_fsdp2():
        runner = FSDP2Runner(cfg, rank, world)
        return runner, runner.train_step

    trainer, tetrad_step, tetrad_mem = build_profiled(make_tetrad, warmup, losses["tetrad"])
    _, fsdp2_step, fsdp2_mem = build_profiled(make_fsdp2, warmup, losses["fsdp2"])
    runners = {"tetrad": tetrad_step, "fsdp2": fsdp2_step}
    seconds: dict[str, list[float]] = {"tetrad": [], "fsdp2": []}
    for r in range(rounds):
        for name in ["tetrad", "fsdp2"] if r % 2 == 0 else ["fsdp2", "tetrad"]:
            if name == "tetrad":
                trainer.comm.reset()  # so its counters hold its last round
            counter.enabled = name == "fsdp2"
            seconds[name].append(timed_block(runners[name], steps, losses[name])[0])
            counter.enabled = False
    peaks = torch.tensor([*tetrad_mem, *fsdp2_mem], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return {
        "losses": losses,
        "seconds": seconds,
        "peaks": peaks.tolist(),
        "tetrad_comm": trainer.comm.summary(),  # the last tetrad round
        "fsdp2_comm": {"bytes": dict(counter.bytes), "bus": dict(counter.bus)},
        "model_state": states[0][-1].total,
        "memory_table": memory_table(rank, world, cfg),
    }


def summarize(world: int, cfg: Config, out: dict, steps: int, rounds: int) -> dict[str, Any]:
    """One row of the result: throughput, ratio, peak memory, bytes per step, losses."""
    tokens = cfg.train.global_batch * cfg.train.seq_len
    tps = {k: [tokens * steps / s for s in v] for k, v in out["seconds"].items()}
    med = {k: statistics.median(v) for k, v in tps.items()}
    ratios = [a / b for a, b in zip(tps["tetrad"], tps["fsdp2"])]
    tet = out["tetrad_comm"]
    fsdp_ops = ("fsdp/all_gather", "fsdp/reduce_scatter")
    fs = out["fsdp2_comm"]
    fs_steps = steps * rounds  # FSDP2's counter spans all its timed rounds
    t_loss, f_loss = out["losses"]["tetrad"], out["losses"]["fsdp2"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(t_loss, f_loss))
    t_all, t_step, f_all, f_step = (int(x) for x in out["peaks"])
    return {
        "fsdp": world,
        "tetrad_tokens_per_s": round(med["tetrad"], 1),
        "fsdp2_tokens_per_s": round(med["fsdp2"], 1),
        "ratio_tetrad_over_fsdp2": round(statistics.median(ratios), 3),
        "ratio_rounds": [round(x, 3) for x in ratios],
        "tetrad_peak_step_bytes": t_step,
        "fsdp2_peak_step_bytes": f_step,
        "peak_step_ratio_tetrad_over_fsdp2": round(t_step / f_step, 3),
        "tetrad_peak_build_bytes": t_all,
        "fsdp2_peak_build_bytes": f_all,
        "tetrad_model_state_bytes": out["model_state"],
        "tetrad_bytes_per_step": sum(tet[k]["bytes"] for k in fsdp_ops) / steps,
        "fsdp2_bytes_per_step": (
            fs["bytes"].get("all_gather", 0) + fs["bytes"].get("reduce_scatter", 0)
        )
        / fs_steps,
        "tetrad_bus_bytes_per_step": sum(tet[k]["bus_bytes"] for k in fsdp_ops) / steps,
        "fsdp2_bus_bytes_per_step": (
            fs["bus"].get("all_gather", 0) + fs["bus"].get("reduce_scatter", 0)
        )
        / fs_steps,
        "losses_max_rel_diff": rel,
        "final_loss": t_loss[-1],
        "memory_table": out["memory_table"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=3, help="timed steps per round and runner")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    rows = []
    for world in args.worlds:
        total = args.warmup + args.rounds * args.steps
        cfg = bench_config(world, total)
        out = spawn(worker, world, cfg.to_dict(), args.steps, args.warmup, args.rounds,
                    timeout=1200)[0]  # fmt: skip
        rows.append(summarize(world, cfg, out, args.steps, args.rounds))
    report = {
        "benchmark": "fsdp",
        "model": "small, 8 layers (dim 128, 4 heads, 2 kv heads, vocab 256)",
        "params": param_count(cfg.model),
        "global_batch": cfg.train.global_batch,
        "seq_len": cfg.train.seq_len,
        "backend": "gloo",
        "threads_per_rank": 1,
        "zero_stage": 3,
        "dtype": "fp32",
        "torch": torch.__version__,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "memory_measure": "peak live tensor bytes, c10 CPU allocator via torch.profiler",
        "results": rows,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
