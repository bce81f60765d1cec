"""Context parallelism's block kernel, fused against unfused: one cp step's time and peak memory.

Run: .venv/bin/python benchmarks/cp_kernel.py [--cp 2] [--seq 8192] [--rounds 3]
                                            [--attention ring]

Both sides are the same cp job (one sequence of --seq tokens per step, a 2-layer Llama of
dim 64 with 4 heads and 2 kv heads, fp32, the embedded corpus), in the same processes,
differing only in `parallel.cp_kernel`: fused (on CPU, torch's flash-attention op and its
backward: tiled, no block of scores kept) or unfused (plain fp32 matmuls that build each
block's whole score matrix, forward and again in backward). Each side is built and runs one
step under the memory instrument (peak live tensor bytes of that step, max over ranks:
harness.start), then timed steps alternate between the sides in rounds: wall seconds per
step (slowest rank) and CPU seconds per step summed over ranks, medians over rounds.

For scale, `score_block_bytes` is one fp32 block of scores the unfused kernel materialises
on the diagonal: b·H·(2c)²·4 bytes for this rank's 2c = S/cp queries against its own keys;
its backward holds several such (probabilities, their gradient) at once.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from harness import race, report, tetrad_trainer
from tetrad.config import Config, from_dict
from tetrad.testing import spawn

MODEL = {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "vocab": 256}
KERNELS = ("fused", "unfused")


def job(cp: int, seq: int, attention: str, kernel: str, steps: int) -> Config:
    """One sequence of `seq` tokens per step, fp32, the embedded corpus."""
    train = {"steps": steps, "global_batch": 1, "seq_len": seq, "progress": False}
    parallel = {"cp": cp, "cp_attention": attention, "cp_kernel": kernel}
    return from_dict({"model": MODEL | {"max_seq_len": seq}, "train": train, "parallel": parallel})


def worker(rank: int, world: int, raws: dict[str, dict], rounds: int) -> dict:
    """Both kernels' step peaks and timed rounds on this rank (results are every rank's)."""
    torch.manual_seed(0)
    cfgs = {name: from_dict(raw) for name, raw in raws.items()}
    makers = {name: (lambda c=cfg: tetrad_trainer(c, rank, cp=world)) for name, cfg in cfgs.items()}
    _, runs = race(makers, warmup=1, steps=1, rounds=rounds)
    return runs


def summarise(runs: dict, cfg: Config) -> dict:
    """Per kernel: step peak, wall and CPU seconds per step (medians, every round); the
    unfused side over the fused one; the two sides' largest loss difference."""
    out: dict = {}
    for name in KERNELS:
        wall = [w for w, _ in runs["seconds"][name]]
        cpu = [c for _, c in runs["seconds"][name]]
        out[name] = {
            "peak_step_tensor_bytes": runs["peaks"][name]["step"],
            "wall_s_per_step": round(statistics.median(wall), 3),
            "cpu_s_per_step": round(statistics.median(cpu), 3),
            "wall_s_rounds": [round(x, 3) for x in wall],
            "cpu_s_rounds": [round(x, 3) for x in cpu],
        }
    fused, unfused = out["fused"], out["unfused"]
    out["unfused_over_fused"] = {
        k: round(unfused[k] / fused[k], 3)
        for k in ("peak_step_tensor_bytes", "wall_s_per_step", "cpu_s_per_step")
    }
    a, b = runs["losses"]["fused"], runs["losses"]["unfused"]
    out["max_rel_loss_diff"] = float(f"{max(abs(x - y) / abs(y) for x, y in zip(a, b)):.2e}")
    m, local = cfg.model, cfg.train.seq_len // cfg.parallel.cp
    out["score_block_bytes"] = cfg.train.global_batch * m.heads * local * local * 4
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention", default="ring", choices=("allgather", "ring"))
    args = p.parse_args()
    steps = args.rounds + 1  # the measured step, then one timed step per round
    cfgs = {k: job(args.cp, args.seq, args.attention, k, steps) for k in KERNELS}
    raws = {k: c.to_dict() for k, c in cfgs.items()}
    runs = spawn(worker, args.cp, raws, args.rounds, timeout=3600)[0]
    report(
        "cp_kernel",
        cfgs["fused"],
        [summarise(runs, cfgs["fused"])],
        cp=args.cp,
        attention=args.attention,
    )


if __name__ == "__main__":
    main()
