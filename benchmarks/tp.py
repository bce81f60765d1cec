"""tetrad's tensor (+ sequence) parallelism against PyTorch's DTensor tensor parallel.

Same model (tetrad's Llama: 4 layers, dim 128, 8 heads, 4 kv heads, vocab 256), same
batches (16 x 128 tokens of the standard-library corpus per step), same initial weights,
optimizer, LR schedule, clipping and loss semantics, same world (gloo, 1 thread per rank),
in the same processes, at tp = 2 and 4, with and without sequence parallelism.

The peer is the same tetrad `Llama` module, materialised whole and handed to
`parallelize_module` with DTensor's styles, configured as torchtitan does it:
`ColwiseParallel` for wq/wk/wv/w1/w3 and the output head (logits left vocab-sharded for
`loss_parallel`), `RowwiseParallel` for wo/w2 and the vocab-sharded embedding,
`PrepareModuleInput` so attention and the MLP each enter the tp region once, and with SP
`SequenceParallel` for the norms and sequence-sharded (`Shard(1)`) residuals.

Timing: in each round one runner does `--steps` steps, then the other (the order
alternates); tokens/s is the median over rounds, the ratio the median of per-round ratios.
The first step of each runner is untimed and measured instead, by a dispatch mode that
sees every tensor op after DTensor has desugared it: peak live tensor bytes (parameters,
gradients, optimizer states, activations, communication buffers) and the collectives'
bytes. The peer's bytes are counted this way (its functional collectives); tetrad's come
from its comm counters. "bus" bytes use the ring factors (all-reduce 2(n-1)/n,
all-gather / reduce-scatter (n-1)/n).

    .venv/bin/python benchmarks/tp.py            # tp 2 and 4, with and without SP, JSON
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from peer_harness import peer_loader, peer_model, timed_block
from tetrad.config import Config, from_dict
from tetrad.mesh import Mesh
from tetrad.models.flops import param_count
from tetrad.models.llama import Llama
from tetrad.testing import spawn
from tetrad.train.loop import Trainer
from tetrad.train.optim import build_optimizer, lr_at, set_lr

MODEL = {"layers": 4, "dim": 128, "heads": 8, "kv_heads": 4, "vocab": 256}


def bench_config(tp: int, sp: bool, steps: int) -> Config:
    """The benchmark job: the model above, stdlib corpus, global batch 16 x 128, tp = world."""
    return from_dict(
        {
            "model": MODEL,
            "train": {"steps": steps, "global_batch": 16, "seq_len": 128, "progress": False},
            "data": {"source": "stdlib"},
            "parallel": {"tp": tp, "sp": sp},
        }
    )


# --- the peer -----------------------------------------------------------------------------


def dtensor_plan(model: Llama, sp: bool) -> dict[str, Any]:
    """DTensor styles for tetrad's Llama (torchtitan's plan; without SP, replicated residuals)."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for name in model.layers:
        p = f"layers.{name}."
        for region, col, row in (("attention", "wq wk wv", "wo"), ("feed_forward", "w1 w3", "w2")):
            plan[p + region] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            )
            plan.update({f"{p}{region}.{c}": ColwiseParallel() for c in col.split()})
            plan[f"{p}{region}.{row}"] = RowwiseParallel(output_layouts=seq)
        if sp:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return plan


class DTensorRunner:
    """The same training step as tetrad's Trainer, written the usual DTensor TP way."""

    def __init__(self, cfg: Config, tp: int):
        self.cfg = cfg
        model = peer_model(cfg)
        self.model = parallelize_module(
            model, init_device_mesh("cpu", (tp,)), dtensor_plan(model, cfg.parallel.sp)
        )
        self.optimizer = build_optimizer(list(model.named_parameters()), cfg.train)
        self.loader = peer_loader(cfg, 0, 1)  # every tp rank reads the whole batch
        self.step = 0

    def train_step(self) -> float:
        """One optimizer step; returns the mean token loss."""
        (mb,) = self.loader.next()
        with loss_parallel():
            logits = self.model(mb.inputs)  # DTensor [b, s, V], sharded over the vocabulary
            loss = F.cross_entropy(
                logits.flatten(0, 1), mb.targets.flatten(), reduction="sum", ignore_index=-100
            ) / max(mb.tokens, 1)
            loss.backward()
        norm = clip_grads(list(self.model.parameters()), self.cfg.train.grad_clip)
        value = float(loss.detach().full_tensor())
        if math.isfinite(value) and math.isfinite(norm):
            set_lr(self.optimizer, lr_at(self.step, self.cfg.train))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return value


def clip_grads(params: list[torch.Tensor], max_norm: float) -> float:
    """Global-norm clipping as tetrad does it, over DTensor (sharded) and plain (norm) grads."""
    grads = [p.grad for p in params if p.grad is not None]
    dtensors = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]  # the norms' weights without SP
    sq = 0.0
    if dtensors:
        sq += float(torch.nn.utils.get_total_norm(dtensors).full_tensor()) ** 2
    if plain:
        sq += float(torch.nn.utils.get_total_norm(plain)) ** 2
    norm = math.sqrt(sq)
    if max_norm > 0 and norm > max_norm:
        for group in (dtensors, plain):
            if group:
                torch._foreach_mul_(group, max_norm / (norm + 1e-6))
    return norm


# --- measuring one step ---------------------------------------------------------------------


class StepProbe(TorchDispatchMode):
    """Peak live tensor bytes and collective bytes of the ops run under it (local tensors)."""

    def __init__(self, tp: int, state: list[torch.Tensor]):
        super().__init__()
        self.tp, self.live, self.current, self.peak = tp, {}, 0, 0
        self.comm = {"calls": 0, "bytes": 0, "bus_bytes": 0.0}
        self.uncounted: set[str] = set()
        for t in state:  # parameters, gradients, optimizer states held before the step
            self._track(t.to_local() if isinstance(t, DTensor) else t)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live or storage.nbytes() == 0 or t.device.type == "meta":
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def _count(self, name: str, args: tuple, out: Any) -> None:
        n = self.tp
        if name == "all_reduce":
            size, factor = args[0].numel() * args[0].element_size(), 2 * (n - 1) / n
        elif name == "all_gather_into_tensor":
            size, factor = out.numel() * out.element_size(), (n - 1) / n
        elif name == "reduce_scatter_tensor":
            size, factor = args[0].numel() * args[0].element_size(), (n - 1) / n
        else:
            if name not in ("wait_tensor", "_wrap_tensor_autograd"):
                self.uncounted.add(name)  # reported, so a missed collective cannot hide
            return
        self.comm["calls"] += 1
        self.comm["bytes"] += size
        self.comm["bus_bytes"] += factor * size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet.__module__.endswith("_c10d_functional"):
            self._count(packet.__name__, args, out)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def model_state(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list:
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*params, *grads, *states]


def probe_step(step_fn, tp: int, params: list, optimizer) -> tuple[float, StepProbe]:
    probe = StepProbe(tp, model_state(params, optimizer))
    with probe:
        loss = step_fn()
    return loss, probe


def run_pair(rank: int, tp: int, raw: dict, steps: int, rounds: int) -> dict[str, Any]:
    """Both implementations of one layout on this rank: probe step, then alternating rounds."""
    cfg = from_dict(raw)
    mesh = Mesh.build({"pp": 1, "dp": 1, "fsdp": 1, "tp": tp}, rank)
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    peer = DTensorRunner(cfg, tp)
    runners = {"tetrad": lambda: trainer.train_step().loss, "dtensor": peer.train_step}
    tet_params = [p for _, p in trainer.engine.named_parameters()]
    losses: dict[str, list[float]] = {}
    probes: dict[str, StepProbe] = {}
    for name, params, opt in (
        ("tetrad", tet_params, trainer.optimizer),
        ("dtensor", list(peer.model.parameters()), peer.optimizer),
    ):
        trainer.comm.reset()
        loss, probes[name] = probe_step(runners[name], tp, params, opt)
        losses[name] = [loss]
        if name == "tetrad":
            tetrad_comm = trainer.comm.summary()  # every collective of the step
    seconds: dict[str, list[float]] = {"tetrad": [], "dtensor": []}
    for r in range(rounds):
        for name in ("tetrad", "dtensor") if r % 2 == 0 else ("dtensor", "tetrad"):
            seconds[name].append(timed_block(runners[name], steps, losses[name])[0])
    return {"losses": losses, "seconds": seconds, "probes": probes, "tetrad_comm": tetrad_comm}


def worker(rank: int, world: int, raws: list[dict], steps: int, rounds: int) -> list[dict]:
    """Every layout of this world size, one after the other; per-layout raw results."""
    out = []
    for raw in raws:
        res = run_pair(rank, world, raw, steps, rounds)
        peaks = torch.tensor([float(res["probes"][k].peak) for k in ("tetrad", "dtensor")])
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        res["peak_bytes"] = {"tetrad": int(peaks[0]), "dtensor": int(peaks[1])}
        probe = res.pop("probes")["dtensor"]
        res["dtensor_comm"] = {**probe.comm, "uncounted": sorted(probe.uncounted)}
        out.append(res)
    return out


def summarize(cfg: Config, res: dict, steps: int) -> dict[str, Any]:
    """One row: throughput, ratio, bytes per step, peak memory, loss agreement."""
    tokens = cfg.train.global_batch * cfg.train.seq_len
    tps = {k: [tokens * steps / s for s in v] for k, v in res["seconds"].items()}
    ratios = [a / b for a, b in zip(tps["tetrad"], tps["dtensor"])]
    tet = res["tetrad_comm"]
    t_loss, d_loss = res["losses"]["tetrad"], res["losses"]["dtensor"]
    rel = [abs(a - b) / abs(b) for a, b in zip(t_loss, d_loss)]
    peaks = res["peak_bytes"]
    return {
        "tp": cfg.parallel.tp,
        "sp": cfg.parallel.sp,
        "tetrad_tokens_per_s": round(statistics.median(tps["tetrad"]), 1),
        "dtensor_tokens_per_s": round(statistics.median(tps["dtensor"]), 1),
        "ratio_tetrad_over_dtensor": round(statistics.median(ratios), 3),
        "ratio_rounds": [round(x, 3) for x in ratios],
        "tetrad_bytes_per_step": sum(s["bytes"] for s in tet.values()),
        "dtensor_bytes_per_step": res["dtensor_comm"]["bytes"],
        "tetrad_bus_bytes_per_step": sum(s["bus_bytes"] for s in tet.values()),
        "dtensor_bus_bytes_per_step": res["dtensor_comm"]["bus_bytes"],
        "tetrad_collectives_per_step": sum(s["calls"] for s in tet.values()),
        "dtensor_collectives_per_step": res["dtensor_comm"]["calls"],
        "dtensor_uncounted_ops": res["dtensor_comm"]["uncounted"],
        "tetrad_peak_mem_bytes": peaks["tetrad"],
        "dtensor_peak_mem_bytes": peaks["dtensor"],
        "mem_ratio_tetrad_over_dtensor": round(peaks["tetrad"] / peaks["dtensor"], 3),
        "first_losses": {"tetrad": t_loss[:3], "dtensor": d_loss[:3]},
        "losses_max_rel_diff_first_3": max(rel[:3]),
        "losses_max_rel_diff_all": max(rel),
        "numerics_equal": max(rel[:3]) <= 1e-5,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=2, help="timed steps per round and runner")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = []
    for tp in args.tp:
        total = 1 + args.rounds * args.steps
        cfgs = [bench_config(tp, sp, total) for sp in (False, True)]
        raws = [c.to_dict() for c in cfgs]
        results = spawn(worker, tp, raws, args.steps, args.rounds, timeout=1200)[0]
        rows += [summarize(c, r, args.steps) for c, r in zip(cfgs, results)]
    report = {
        "benchmark": "tp",
        "model": MODEL,
        "params": param_count(cfgs[0].model),
        "global_batch": cfgs[0].train.global_batch,
        "seq_len": cfgs[0].train.seq_len,
        "backend": "gloo",
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "peer_bytes": "counted: a dispatch mode sums DTensor's functional collectives",
        "tetrad_bytes": "counted: tetrad's comm layer (every collective of a step)",
        "peak_mem": "peak live tensor bytes over the first step (incl. optimizer states), "
        "max over ranks, from the same dispatch mode for both",
        "wall_s": round(time.perf_counter() - t0, 1),
        "results": rows,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
