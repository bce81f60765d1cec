"""Convergence of low-precision variants against their baseline, measured by training.

`tetrad train` on its defaults (the small Llama, the standard-library corpus, dp over 2
CPU ranks), once per (variant, seed). Gradient reductions (`--variants reduce`, the
default): fp32 reduction, int8 and fp8 blocks with error feedback, and both without it
(the ablation), each against fp32. FP8 matmuls (`--variants fp8`): bf16 compute, and the
blocks' linears in FP8 tensorwise and rowwise, each against bf16. Each run's final loss
is the mean of its last `--tail` steps' losses; a variant's difference is its final loss
minus its baseline's of the same seed (same weights, same batches: only the variant
differs), given as the mean over seeds with [min, max]. Prints JSON; `--plot PATH` draws
the curves.

    .venv/bin/python benchmarks/convergence.py                        # 600 steps, 3 seeds
    .venv/bin/python benchmarks/convergence.py --variants fp8         # FP8 matmuls
    .venv/bin/python benchmarks/convergence.py --steps 100 --seeds 1  # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# each set: its baseline first, then the variants compared with it
SETS = {
    "reduce": {
        "fp32": [],
        "int8": ["--reduce-dtype", "int8"],
        "fp8": ["--reduce-dtype", "fp8"],
        "int8-no-feedback": ["--reduce-dtype", "int8", "--no-error-feedback"],
        "fp8-no-feedback": ["--reduce-dtype", "fp8", "--no-error-feedback"],
    },
    "fp8": {
        "bf16": ["--dtype", "bf16"],
        "fp8-tensorwise": ["--dtype", "bf16", "--fp8", "tensorwise"],
        "fp8-rowwise": ["--dtype", "bf16", "--fp8", "rowwise"],
    },
}


TITLES = {"reduce": "gradient reduction dtype", "fp8": "FP8 matmuls (bf16 compute)"}


def train(out: Path, steps: int, seed: int, flags: list[str]) -> list[float]:
    """One run's per-step losses."""
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--steps", str(steps), "--seed"]
    cmd += [str(seed), "--out", str(out), "--no-progress", "--no-final-checkpoint", *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def summary(values: list[float]) -> list[float]:
    return [statistics.mean(values), min(values), max(values)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tail", type=int, default=50, help="steps averaged for the final loss")
    ap.add_argument("--variants", default="reduce", choices=list(SETS))
    ap.add_argument("--plot", type=Path, help="write the loss curves (seed 0) to this PNG")
    args = ap.parse_args()
    variants = SETS[args.variants]
    base = next(iter(variants))
    curves: dict[str, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for name, flags in variants.items():
                out = Path(tmp) / f"{name}-{seed}"
                curves.setdefault(name, []).append(train(out, args.steps, seed, flags))
    final = {n: [statistics.mean(c[-args.tail :]) for c in runs] for n, runs in curves.items()}
    report = {
        "benchmark": "convergence",
        "variants": args.variants,
        "steps": args.steps,
        "seeds": args.seeds,
        "tail": args.tail,
        "final_loss": {n: summary(f) for n, f in final.items()},
        f"minus_{base}": {
            n: summary([a - b for a, b in zip(f, final[base])])
            for n, f in final.items()
            if n != base
        },
    }
    print(json.dumps(report, indent=2))
    if args.plot:
        plot(curves, args.plot, args.variants)


def plot(curves: dict[str, list[list[float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in curves.items():
        losses, k = runs[0], 20  # seed 0, a moving mean over k steps
        smooth = [statistics.mean(losses[max(0, i - k + 1) : i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=name, linewidth=1)
    ax.set(xlabel="step", ylabel=f"loss (mean of {k} steps)", title=TITLES[title])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
