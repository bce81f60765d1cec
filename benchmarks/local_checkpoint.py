"""What in-memory checkpoints cost per step, and what they save when a worker dies.

1. Cost: the default job of `tetrad train` (the "small" Llama, stdlib data, global batch
   16 x 128 tokens, two data-parallel CPU processes unless --world says otherwise), one
   trainer per K in --ks (0: off), all in the same processes; `--rounds` rounds, each
   timing a block of `--steps` steps of every trainer back to back, the order rotated
   each round. Reported per K: the median step time with [min, max], and the overhead
   against K = 0 computed per round (the blocks of one round ran back to back), median
   and [min, max]; and the time the training thread itself spends per step in the
   snapshot, the wait for the writer and the commit (less noisy than the difference of two
   step times on a shared machine). A block's time includes the commit of its last
   generation. And the CPU seconds per step, every thread of every rank summed, with their
   overhead against K = 0 per round: on a machine whose cores are all busy (as on this
   shared one) extra CPU is extra time, and it is far less noisy than wall time there.
2. Recovery: `tetrad train` through the launcher with `--max-restarts 1`, rank 1
   SIGKILLed at the start of step --kill-at (benchmarks/faults/sitecustomize.py writes the
   time first); durable checkpoints every --durable-every steps in both runs, in-memory
   ones every K = 5 in one of them. Reported per source: seconds from the kill to the end
   of the first step after the restart, the resumed step, the steps replayed, the load's
   own seconds, and the seconds from the kill until the step the failure interrupted is
   done again (the first new step's end plus the replayed steps' step times).

    .venv/bin/python benchmarks/local_checkpoint.py                  # both; prints JSON
    .venv/bin/python benchmarks/local_checkpoint.py --skip-recovery --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tetrad.config import Config
from tetrad.mesh import Mesh
from tetrad.testing import spawn
from tetrad.train.loop import Trainer

FAULTS = str(Path(__file__).parent / "faults")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def default_job(world: int, local_every: int, out: str) -> Config:
    """`tetrad train`'s defaults, on `world` data ranks, with in-memory checkpoints every K."""
    cfg = Config()
    cfg.parallel.dp = world
    cfg.train.steps, cfg.train.progress, cfg.train.out = 100_000, False, out
    cfg.checkpoint.final = False
    cfg.checkpoint.local_every = local_every  # in /dev/shm, as by default
    return cfg


def cost_worker(rank: int, world: int, ks: list[int], steps: int, rounds: int, tmp: str):
    """Per K, the seconds of each round's block of `steps` steps (slowest rank)."""
    trainers = {}
    for k in ks:
        cfg = default_job(world, k, f"{tmp}/k{k}")
        trainers[k] = Trainer(cfg, Mesh.build(cfg.parallel, rank), torch.device("cpu"))
        trainers[k].fit(stop=max(k, 1) + 2)  # warm-up, one generation written
    seconds: dict[int, list[float]] = {k: [] for k in ks}
    cpu: dict[int, list[float]] = {k: [] for k in ks}
    stalls: dict[int, list[float]] = {k: [] for k in ks}
    waits: dict[int, int] = {}
    for r in range(rounds):
        order = ks[r % len(ks) :] + ks[: r % len(ks)]
        for k in order:
            trainer = trainers[k]
            dist.barrier()
            stalled = trainer.local.stalled_s if trainer.local else 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.fit(stop=trainer.step + steps)
            used = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(used)
            stalled = (trainer.local.stalled_s if trainer.local else 0.0) - stalled
            wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            seconds[k].append(float(wall) / steps)
            cpu[k].append(float(used) / steps)
            stalls[k].append(stalled / steps)
    for k, trainer in trainers.items():
        waits[k] = trainer.local.waits if trainer.local else 0
        if trainer.local:
            trainer.local.close(finished=True)
    return {"seconds": seconds, "cpu": cpu, "stalls": stalls, "waits": waits}


def cost(world: int, ks: list[int], steps: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        got = spawn(cost_worker, world, ks, steps, rounds, tmp, timeout=3600)[0]
    base = got["seconds"][0] if 0 in ks else None
    out = {}
    for k in ks:
        per_step = got["seconds"][k]
        row = {"step_s": spread(per_step), "waits": got["waits"][k]}
        row["training_thread_s_per_step"] = spread(got["stalls"][k])
        row["cpu_s_per_step"] = spread(got["cpu"][k])
        if base is not None and k:
            row["overhead"] = spread([t / b - 1 for t, b in zip(per_step, base)])
            pairs = zip(got["cpu"][k], got["cpu"][0])
            row["cpu_overhead"] = spread([t / b - 1 for t, b in pairs])
        out[f"K={k}"] = row
    return out


def launch(out: Path, kill_at: int, steps: int, durable: int, local: int, world: int) -> dict:
    """One killed-and-restarted run; its recovery figures."""
    stamp = out / "killed_at"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]))
    env["TETRAD_BENCH_KILL"] = f"1:{kill_at}:{stamp}"
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--nproc", str(world), "--no-progress"]
    cmd += ["--steps", str(steps), "--checkpoint-every", str(durable), "--max-restarts", "1"]
    cmd += ["--out", str(out), "--local-checkpoint-every", str(local)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (first,) = [r for r in rows if "resumed_from" in r]
    killed = float(stamp.read_text())
    redone = [r["step_time_s"] for r in rows if first["step"] < r["step"] < kill_at]
    return {
        "source": first["resumed_from"],
        "resumed_step": first["resumed_step"],
        "replayed_steps": first["replayed_steps"],
        "load_s": first["resume_load_s"],
        "to_first_step_s": first["first_step_at"] - killed,
        "to_step_reached_s": first["first_step_at"] + sum(redone) - killed,
    }


def recovery(rounds: int, kill_at: int, durable: int, world: int) -> dict:
    runs: dict[str, list[dict]] = {"memory": [], "durable": []}
    steps = kill_at + 5
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = ["memory", "durable"] if r % 2 == 0 else ["durable", "memory"]
            for name in order:
                out = Path(tmp) / f"{name}{r}"
                out.mkdir()
                local = 5 if name == "memory" else 0
                runs[name].append(launch(out, kill_at, steps, durable, local, world))
    summary = {}
    for name, got in runs.items():
        summary[name] = {"source": sorted({g["source"] for g in got})}
        for key in ("resumed_step", "replayed_steps", "load_s", "to_first_step_s"):
            summary[name][key] = spread([g[key] for g in got])
        summary[name]["to_step_reached_s"] = spread([g["to_step_reached_s"] for g in got])
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ks", default="0,1,5,20")
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--recovery-rounds", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=33)
    p.add_argument("--durable-every", type=int, default=20)
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--skip-recovery", action="store_true")
    a = p.parse_args()
    result: dict = {"world": a.world, "cpus": os.cpu_count(), "load": os.getloadavg()}
    if not a.skip_cost:
        ks = [int(k) for k in a.ks.split(",")]
        result["cost"] = cost(a.world, ks, a.steps, a.rounds)
    if not a.skip_recovery:
        result["recovery"] = recovery(a.recovery_rounds, a.kill_at, a.durable_every, a.world)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
