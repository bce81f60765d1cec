"""tetrad's sharded checkpoints against torch.distributed.checkpoint (DCP), side by side.

The same state in the same processes: a "base" Llama (8 layers, dim 256, about 6.3 M
parameters) under ZeRO-3 over the world (one process: plain), after two AdamW steps, so
each rank holds 1/world of the fp32 weights and both moments. tetrad saves it with its
own format (each rank's boxes in one safetensors file, manifest last, atomic rename,
sha256); DCP saves the very same tensors, as each rank's distinct entries of one state
dict, with `dcp.save` and `dcp.async_save`, and loads them back into preallocated
tensors. tetrad's load reads its boxes back into the engine (resharding path included).

Per round, in alternating order: tetrad sync save, tetrad async save, DCP save, DCP async
save, tetrad load, DCP load. Reported, as the median over rounds with [min, max]:
- save and load MB/s: the state's bytes over the wall time of the slowest rank;
- the training stall per save: the time the training thread is blocked (sync: the whole
  save; async: tetrad's snapshot and collectives, plus its commit once the writer is done;
  DCP's `async_save` until it returns, its commit being in the background);
- ratios tetrad ÷ DCP, computed per round (each round runs both back to back).

    .venv/bin/python benchmarks/checkpoint.py                 # worlds 1, 2, 4; prints JSON
    .venv/bin/python benchmarks/checkpoint.py --worlds 2 --rounds 5 --dim 384
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tetrad.config import from_dict, model_preset
from tetrad.mesh import Mesh
from tetrad.testing import spawn
from tetrad.train import checkpoint
from tetrad.train.loop import Trainer


def timed(fn) -> tuple[float, Any]:
    """(seconds on the slowest rank, fn's result), between barriers."""
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    if dist.is_initialized():
        dist.barrier()
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds), out


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def tetrad_round(trainer, root: Path, r: int) -> dict[str, float]:
    e, opt, loader, cfg = trainer.engine, trainer.optimizer, trainer.loader, trainer.cfg
    out = {}
    out["save_s"], _ = timed(lambda: checkpoint.save(root / "sync", r + 1, e, opt, loader, cfg))
    saver = checkpoint.Saver(asynchronous=True)
    t0 = time.perf_counter()
    stall, _ = timed(lambda: saver.save(root / "async", r + 1, e, opt, loader, cfg))
    saver.pending[3].join()  # the writer: training would run meanwhile; the trainer commits after
    commit, _ = timed(lambda: saver.finish(e, cfg))
    out["async_stall_s"] = stall
    out["async_total_s"] = max_over_ranks(time.perf_counter() - t0)
    out["async_commit_s"] = commit
    path = root / "sync" / f"step_{r + 1:08d}"
    out["load_s"], _ = timed(lambda: checkpoint.restore(path, e, opt, loader, cfg))
    return out


def dcp_round(state: dict[str, torch.Tensor], root: Path, r: int, group) -> dict[str, float]:
    """DCP's save, async_save (its collectives on their own gloo group, as its docs ask:
    the training thread keeps the default one) and load."""
    out = {}
    sync_dir, async_dir = root / f"dcp-sync-{r}", root / f"dcp-async-{r}"
    out["save_s"], _ = timed(lambda: dcp.save(state, checkpoint_id=str(sync_dir)))
    t0 = time.perf_counter()
    stall, future = timed(
        lambda: dcp.async_save(state, checkpoint_id=str(async_dir), process_group=group)
    )
    future.result()  # DCP commits (its metadata) in the background itself
    out["async_stall_s"] = stall
    out["async_total_s"] = max_over_ranks(time.perf_counter() - t0)
    out["async_commit_s"] = 0.0
    target = {k: torch.empty_like(v) for k, v in state.items()}
    out["load_s"], _ = timed(lambda: dcp.load(target, checkpoint_id=str(sync_dir)))
    if not all(torch.equal(target[k], state[k]) for k in state):
        raise RuntimeError("DCP loaded different values")
    return out


def worker(rank: int, world: int, raw: dict, root: str, rounds: int) -> dict[str, Any]:
    cfg = from_dict(raw)
    trainer = Trainer(cfg, Mesh.build(cfg.parallel, rank), torch.device("cpu"))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(stop=2)  # AdamW state exists
        owned, _ = trainer.engine.owned_slices(trainer.optimizer)
        # DCP gets the same tensors: this rank's boxes, distinct keys (nothing to dedupe)
        state = {f"{k}@{list(box)}": t for k, box, t in owned}
        nbytes = torch.tensor([float(sum(t.numel() * 4 for t in state.values()))])
        if world > 1:
            dist.all_reduce(nbytes)
        sides = {"tetrad": [], "dcp": []}
        group = dist.new_group(backend="gloo") if world > 1 else None
        for r in range(rounds):
            here = Path(root) / f"round{r}"
            order = ("tetrad", "dcp") if r % 2 == 0 else ("dcp", "tetrad")
            for side in order:
                if side == "tetrad":
                    sides[side].append(tetrad_round(trainer, here / "tetrad", r))
                else:
                    sides[side].append(dcp_round(state, here, r, group))
            if rank == 0:
                shutil.rmtree(here, ignore_errors=True)
    return {"state_bytes": float(nbytes), **sides}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    mb = result["state_bytes"] / 1e6

    def stat(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out: dict[str, Any] = {"state_mb": round(mb, 2)}
    for side in ("tetrad", "dcp"):
        rows = result[side]
        out[side] = {
            "save_mb_s": stat([mb / r["save_s"] for r in rows]),
            "load_mb_s": stat([mb / r["load_s"] for r in rows]),
            "async_save_mb_s": stat([mb / r["async_total_s"] for r in rows]),
            "stall_sync_s": stat([r["save_s"] for r in rows]),
            "stall_async_s": stat([r["async_stall_s"] + r["async_commit_s"] for r in rows]),
        }
    pairs = list(zip(result["tetrad"], result["dcp"]))
    out["ratio_tetrad_over_dcp"] = {
        "save_mb_s": stat([d["save_s"] / t["save_s"] for t, d in pairs]),
        "load_mb_s": stat([d["load_s"] / t["load_s"] for t, d in pairs]),
        "async_stall": stat(
            [
                (t["async_stall_s"] + t["async_commit_s"])
                / (d["async_stall_s"] + d["async_commit_s"])
                for t, d in pairs
            ]
        ),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    model = model_preset("base")
    model.dim, model.layers = args.dim, args.layers
    report = {"model": {"layers": model.layers, "dim": model.dim, "vocab": model.vocab}}
    report["rounds"] = args.rounds
    for world in (int(w) for w in args.worlds.split(",")):
        parallel = {"fsdp": world, "zero_stage": 3} if world > 1 else {}
        raw = {
            "model": model.__dict__,
            "parallel": parallel,
            "train": {"steps": 2, "global_batch": 4 * world, "seq_len": 64, "progress": False},
            "data": {"source": "synthetic"},
        }
        with tempfile.TemporaryDirectory(prefix="tetrad-ckpt-bench-") as root:
            raw["train"]["out"] = root
            cfg_dict = from_dict(raw).to_dict()
            result = spawn(worker, world, cfg_dict, root, args.rounds, timeout=900)[0]
        report[f"world{world}"] = summarise(result)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
