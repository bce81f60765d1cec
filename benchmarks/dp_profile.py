"""Where a data-parallel step's CPU time goes, tetrad's and DDP's, at dp.py's shape.

Each rank builds both sides (benchmarks/dp.py's), warms them up, then runs `--steps`
steps of each under cProfile, `--rounds` times alternating; the profiler's clock is the
process's CPU time, so gloo's threads count too, charged to whatever the main thread
was running. Each function's own time (not its callees') is put in one bin:

- forward: Python of the model and of torch.nn, and torch's operators it calls;
- backward: autograd's engine (tetrad's gradient hooks are Python: framework);
- comm: torch.distributed's Python and its operators (all-reduce, wait), tetrad's comm/;
- optimizer: torch.optim and the fused AdamW kernel;
- framework: the rest of tetrad (parallel/, train/) and of the benchmark's peer step
  (benchmarks/), with the tensor operators they call (the norm, clipping, flags).

Per side: ms of CPU per step and rank, median over rounds and ranks. cProfile's own cost
per Python call inflates the Python-heavy bins; compare the sides bin by bin. So tetrad's
bookkeeping is also timed directly, without the profiler (`tetrad_parts`: ms of CPU per
call on the rank where it costs most, which the step waits for, after one more step's
backward): the gradient norm, clipping's scaling, the per-step model-state measurement,
zeroing the gradient buckets.

    .venv/bin/python benchmarks/dp_profile.py --worlds 2 4
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

import dp
import harness
from tetrad.config import from_dict, model_preset
from tetrad.parallel.model_state import measured_model_state
from tetrad.parallel.runner import Denominator
from tetrad.testing import spawn

BINS = ("forward", "backward", "comm", "optimizer", "framework")


def bin_of(file: str, func: str, caller_bins: set[str]) -> str:
    """The bin of one profiled function; a C operator (`file` "~") takes its callers'."""
    if file == "~":
        if "run_backward" in func:
            return "backward"
        if "_distributed_c10d" in func:
            return "comm"
        if "_fused_adam" in func:
            return "optimizer"
        for b in ("comm", "optimizer", "forward", "framework"):
            if b in caller_bins:
                return b
        return "framework"
    if _within(file, "torch.distributed", "tetrad.comm"):
        return "comm"
    if _within(file, "torch.optim"):
        return "optimizer"
    if _within(file, "tetrad.models", "torch.nn.modules", "torch.nn.functional"):
        return "forward"
    return "framework"


def _within(file: str, *packages: str) -> bool:
    """Whether the source file `file` is one of `packages`' modules (dotted names), wherever
    the packages are installed."""
    names = tuple(Path(part).stem for part in Path(file).parts)
    for package in packages:
        want = tuple(package.split("."))
        if any(names[i : i + len(want)] == want for i in range(len(names))):
            return True
    return False


def split(profile: cProfile.Profile, steps: int) -> dict[str, float]:
    """ms per step in each bin, from the functions' own times."""
    raw = pstats.Stats(profile).stats  # (file, line, func) -> (cc, nc, own, cum, callers)
    python = {k: bin_of(k[0], k[2], set()) for k in raw if k[0] != "~"}
    out = dict.fromkeys(BINS, 0.0)
    for key, (_, _, own, _, callers) in raw.items():
        b = python.get(key) or bin_of(key[0], key[2], {python.get(c, "") for c in callers})
        out[b] += own
    return {b: 1e3 * s / steps for b, s in out.items()}


def cpu_ms(fn, calls: int = 100) -> float:
    """CPU ms per call of `fn`."""
    c0 = time.process_time()
    for _ in range(calls):
        fn()
    return 1e3 * (time.process_time() - c0) / calls


def parts(trainer) -> dict[str, float]:
    """tetrad's per-step bookkeeping, each piece timed alone on the gradients of a step."""
    engine = trainer.engine
    engine.forward_backward(trainer.loader.next(), Denominator(torch.tensor(4096.0)))
    engine.sync_grads()
    return {
        "grad_sq_norm": cpu_ms(engine.grad_sq_norm),
        "scale_grads": cpu_ms(lambda: engine.scale_grads(1.0)),
        "model_state": cpu_ms(lambda: measured_model_state(engine, trainer.optimizer)),
        "zero_grad": cpu_ms(engine.zero_grad),
    }


def worker(rank: int, world: int, cfg_dict: dict, steps: int, warmup: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    cfg = from_dict(cfg_dict)
    trainer, tetrad_step = harness.tetrad_trainer(cfg, rank, dp=world)
    ddp = dp.DDPRunner(cfg, rank, world)
    sides = {"tetrad": tetrad_step, "ddp": ddp.train_step}
    for _ in range(warmup):
        for step in sides.values():
            step()
    found: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in list(sides)[r % 2 :] + list(sides)[: r % 2]:
            profile = cProfile.Profile(time.process_time)
            c0 = time.process_time()
            profile.enable()
            for _ in range(steps):
                sides[name]()
            profile.disable()
            row = split(profile, steps)
            found[name].append(row | {"total": 1e3 * (time.process_time() - c0) / steps})
    return found | {"parts": parts(trainer)}


def main() -> None:
    p = harness.arguments(__doc__, "--worlds", steps=5, rounds=4, warmup=3)
    args = p.parse_args()
    rows = []
    for world in args.worlds:
        cfg = harness.job(asdict(model_preset("small")), {"dp": world}, 1000)
        cfg.train.loss_chunk = 0
        per_rank = spawn(worker, world, cfg.to_dict(), args.steps, args.warmup, args.rounds,
                         timeout=1200)  # fmt: skip
        for side in ("tetrad", "ddp"):
            runs = [run for rank in per_rank for run in rank[side]]
            med = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
            rows.append({"world": world, "side": side, "ms_cpu_per_step_and_rank": med})
        timed = {k: round(max(r["parts"][k] for r in per_rank), 3)
                 for k in per_rank[0]["parts"]}  # fmt: skip
        rows.append({"world": world, "tetrad_parts_ms_cpu_per_call": timed})
    print(json.dumps({"benchmark": "dp_profile", "steps": args.steps, "rounds": args.rounds,
                      "results": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
