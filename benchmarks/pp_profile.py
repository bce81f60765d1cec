"""Where a pipeline step's CPU time goes, tetrad's 1F1B against torch's `Schedule1F1B`.

The small shape of `benchmarks/pp.py` (8 layers, dim 128; 8 microbatches of 2 x 128
tokens), pp ranks, one thread each. Both runners' steps alternate; every function below is
wrapped so that its main-thread CPU time (`time.thread_time`, which load on a shared
machine does not inflate as it does wall time) is charged to its category, exclusive of
the categories it calls (a stack: forward's time excludes the loss inside it, the
schedule's excludes every compute and transfer inside it). What is left of the step is
"trainer": data, gradient norm and clipping, the step's all-reduces.

  forward      the model's stage forward (`Llama.forward_span`), both sides
  loss         `F.cross_entropy`, both sides
  backward     the autograd engine (`_engine_run_backward`), both sides
  post         handing a batch of sends/receives to gloo (tetrad `Comm.batch_p2p`,
               torch `schedules._batch_p2p`)
  wait         waiting for transfers (tetrad `Work.wait`, torch `_wait_batch_p2p`)
  optimizer    `AdamW.step` (fused, both sides)
  schedule     the runtime's own Python around the above: tetrad `PipelineRuntime.run`,
               torch `PipelineScheduleSingle.step` (their per-action overhead)
  trainer      the rest of the step

Per action: the category's CPU per step over the rank's computes per step (2 x 8).
"calls_per_step" also holds the bytes `dist.isend` posted in the step and its sends.

    .venv/bin/python benchmarks/pp_profile.py --steps 20      # prints JSON
    .venv/bin/python benchmarks/pp_profile.py --shape overhead   # dim 16: overhead alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pp
from tetrad.comm import Comm, Work
from tetrad.models.llama import Llama
from tetrad.parallel.pipeline.runtime import PipelineRuntime
from tetrad.testing import spawn

# the small shape's schedule and microbatches on a model so small that its computes cost
# little: what is left of a step is the two runtimes' own overhead
pp.SHAPES["overhead"] = ({"layers": 8, "dim": 16, "heads": 2, "kv_heads": 1, "vocab": 64}, 16)
CATEGORIES = ("forward", "loss", "backward", "post", "wait", "optimizer", "schedule")


class CpuLedger:
    """Main-thread CPU seconds per category, each charged exclusively (a call's time less
    that of the wrapped calls inside it)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [category, start, time of wrapped calls inside]

    @contextmanager
    def charge(self, category: str):
        frame = [category, time.thread_time(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            spent = time.thread_time() - frame[1]
            self._stack.pop()
            self.seconds[category] += spent - frame[2]
            self.calls[category] += 1
            if self._stack:
                self._stack[-1][2] += spent

    def wrap(self, owner, name: str, category: str) -> None:
        """Charge every call of `owner.name` (a class or module attribute) to `category`."""
        fn = getattr(owner, name)

        def charged(*args, **kwargs):
            with self.charge(category):
                return fn(*args, **kwargs)

        setattr(owner, name, charged)

    def count_sends(self) -> None:
        """Count the bytes every `dist.isend` posts (both sides post through it: torch's
        batches hold it, tetrad calls it on gloo), as the calls of "sent"."""
        isend = dist.isend

        def counted(tensor, *args, **kwargs):
            self.calls["sent bytes"] += tensor.numel() * tensor.element_size()
            self.calls["sends"] += 1
            return isend(tensor, *args, **kwargs)

        # torch's P2POp checks its op against the module's own isend: patch both names
        dist.isend = dist.distributed_c10d.isend = counted

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = dict(self.seconds), dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return out


def instrument(ledger: CpuLedger) -> None:
    """Wrap both sides' forward, loss, backward, transfers, optimizer and schedule."""
    from torch.distributed.pipelining import schedules

    ledger.wrap(Llama, "forward_span", "forward")
    ledger.wrap(F, "cross_entropy", "loss")
    ledger.wrap(torch.autograd, "_engine_run_backward", "backward")
    ledger.wrap(torch.optim.AdamW, "step", "optimizer")
    ledger.wrap(Comm, "batch_p2p", "post")
    ledger.wrap(Work, "wait", "wait")
    ledger.wrap(schedules, "_batch_p2p", "post")
    ledger.wrap(schedules, "_wait_batch_p2p", "wait")
    ledger.wrap(PipelineRuntime, "run", "schedule")
    ledger.wrap(schedules.PipelineScheduleSingle, "step", "schedule")
    ledger.count_sends()


def worker(rank: int, world: int, steps: int, shape: str) -> dict:
    """Alternate the two runners' steps; per step, each category's CPU on this rank."""
    torch.manual_seed(0)
    ledger = CpuLedger()
    instrument(ledger)
    cfg = pp.bench_config(world, "1f1b", shape=shape)
    runners = {
        "tetrad": pp.TetradRunner(cfg, rank),
        "torch": pp.PeerRunner(cfg, rank, world, "1f1b"),
    }
    rows: dict[str, list[dict]] = {name: [] for name in runners}
    order = list(runners)
    for k in range(steps + 1):  # step 0 warms up (and meters), dropped
        for name in order if k % 2 else order[::-1]:
            dist.barrier()
            ledger.take()
            c0 = time.thread_time()
            runners[name].train_step()
            total = time.thread_time() - c0
            if name == "torch":
                runners[name].after_step()  # its meter, in the warm-up step only
            seconds, calls = ledger.take()
            if k:
                rows[name].append({"total": total, "seconds": seconds, "calls": calls})
    return rows


def _median(steps: list[dict], f) -> float:
    return statistics.median(f(s) for s in steps)


def summarize(ranks: list[dict], per_rank_computes: int) -> dict:
    """Medians over steps, per rank: CPU ms per step and per action, by category."""
    out = {}
    for rank, rows in enumerate(ranks):
        table = {}
        for name, steps in rows.items():
            med = partial(_median, steps)
            total = med(lambda s: s["total"])
            cats = {c: med(lambda s, c=c: s["seconds"].get(c, 0.0)) for c in CATEGORIES}
            cats["trainer"] = med(
                lambda s: s["total"] - sum(s["seconds"].get(c, 0.0) for c in CATEGORIES)
            )
            table[name] = {
                "cpu_ms_per_step": round(1e3 * total, 2),
                "ms_per_step": {c: round(1e3 * v, 3) for c, v in cats.items()},
                "us_per_action": {
                    c: round(1e6 * v / per_rank_computes, 1) for c, v in cats.items()
                },
                "calls_per_step": {c: n for c, n in steps[-1]["calls"].items()},
            }
        t, p = table["tetrad"], table["torch"]
        table["torch - tetrad, ms per step"] = {
            c: round(p["ms_per_step"][c] - t["ms_per_step"][c], 3) for c in t["ms_per_step"]
        }
        table["torch / tetrad, cpu per step"] = round(
            p["cpu_ms_per_step"] / t["cpu_ms_per_step"], 3
        )
        out[f"rank {rank}"] = table
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--shape", default="small", choices=("small", "overhead"))
    args = p.parse_args()
    ranks = spawn(worker, args.pp, args.steps, args.shape, timeout=3600)
    computes = 2 * pp.MICROBATCHES
    report = {"pp": args.pp, "steps": args.steps, "shape": pp.SHAPES[args.shape][0]}
    report |= summarize(ranks, computes)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
