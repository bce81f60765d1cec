"""docs/memory.md's tables and picture: measured bytes per rank against the planner.

One model (4 layers, dim 128, vocab 4096: Llama 3's vocabulary-to-width ratio), 8
sequences of 128 tokens per step, 2 ranks as dp, fsdp (ZeRO-3), tp and pp (1F1B, 4
microbatches); for each recompute mode, one step with the chunked loss (the default) and
one with full logits (`--loss-chunk 0`). Measured: the model state live after the
optimizer step, and the peak of saved activations (the saved-tensor meter); predicted:
`parallel/model_state.py` and the planner (`plan/`). Prints markdown tables, writes the PNG.

    .venv/bin/python scripts/memory_figure.py docs/memory.png
"""

from __future__ import annotations

import sys

import torch

from tetrad.config import from_dict
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.parallel.model_state import model_state_bytes
from tetrad.plan.cost import Planner
from tetrad.plan.engines import TETRAD
from tetrad.plan.hardware import cluster_preset
from tetrad.testing import spawn

MODES = ("none", "selective", "full")
LAYOUTS = {
    "dp": {"dp": 2},
    "fsdp": {"fsdp": 2, "zero_stage": 3},
    "tp": {"tp": 2, "sp": True},
    "pp": {"pp": 2, "microbatches": 4},
}
MODEL = {"layers": 4, "dim": 128, "heads": 4, "kv_heads": 2, "vocab": 4096}


def config(layout: str, mode: str, chunk: int) -> dict:
    train = {"steps": 1, "global_batch": 8, "seq_len": 128, "progress": False,
             "recompute": mode, "loss_chunk": chunk}  # fmt: skip
    raw = {"model": MODEL, "train": train, "data": {"source": "synthetic"}}
    return raw | {"parallel": LAYOUTS[layout]}


def measure(rank: int, world: int, raws: list[dict]) -> list[tuple[int, int]]:
    """(model state bytes, peak saved activation bytes) of this rank, per config."""
    from tetrad.train.loop import Trainer

    out = []
    for raw in raws:
        cfg = from_dict(raw)
        trainer = Trainer(cfg, Mesh.build(cfg.parallel, rank), torch.device("cpu"))
        trainer.train_step()
        run = trainer.engine.last_run
        out.append((trainer.measured_state[-1].total, run.peak_activation_bytes))
    return out


def predicted(raw: dict, rank: int) -> tuple[int, float]:
    cfg = from_dict(raw)
    planner = Planner(cluster_preset("cpu"), TETRAD, cfg.train.recompute)
    pp_rank = Mesh.plan(cfg.parallel.degrees, rank).coord["pp"]
    lay = Layout.build(cfg)
    return model_state_bytes(lay, cfg.model, rank).total, planner.rank_activations(
        lay, cfg.model, pp_rank
    )


def main(png: str) -> None:
    keys = [(lay, mode, chunk) for mode in MODES for lay in LAYOUTS for chunk in (1024, 0)]
    raws = [config(*k) for k in keys]
    per_rank = spawn(measure, 2, raws, timeout=1200)
    rows = {}
    for i, key in enumerate(keys):
        rank = max(range(2), key=lambda r: per_rank[r][i][1])  # the rank saving the most
        rows[key] = (per_rank[rank][i], predicted(raws[i], rank), rank)
    mib = 2**20
    for mode in MODES:
        print(f"\n#### --recompute {mode}\n")
        print("| layout | rank | model state, measured / predicted (MiB) | activations, "
              "chunked loss: measured / predicted (MiB) | activations, full logits: "
              "measured / predicted (MiB) |")  # fmt: skip
        print("|---|---|---|---|---|")
        for lay in LAYOUTS:
            (state, acts), (p_state, p_acts), rank = rows[(lay, mode, 1024)]
            (_, full), (_, p_full), _ = rows[(lay, mode, 0)]
            print(f"| {lay} | {rank} | {state / mib:.2f} / {p_state / mib:.2f} | "
                  f"{acts / mib:.2f} / {p_acts / mib:.2f} | {full / mib:.2f} / "
                  f"{p_full / mib:.2f} |")  # fmt: skip
    plot(rows, png)


def plot(rows: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODES), figsize=(12, 4), sharey=True)
    mib = 2**20
    for ax, mode in zip(axes, MODES):
        names = list(LAYOUTS)
        state = [rows[(n, mode, 1024)][0][0] / mib for n in names]
        acts = [rows[(n, mode, 1024)][0][1] / mib for n in names]
        logits = [max(rows[(n, mode, 0)][0][1] / mib - a, 0.0) for n, a in zip(names, acts)]
        pred = [(rows[(n, mode, 1024)][1][0] + rows[(n, mode, 1024)][1][1]) / mib for n in names]
        ax.bar(names, state, label="model state")
        ax.bar(names, acts, bottom=state, label="saved activations (chunked loss)")
        top = [s + a for s, a in zip(state, acts)]
        ax.bar(names, logits, bottom=top, hatch="//", alpha=0.4,
               label="more with full logits (--loss-chunk 0)")  # fmt: skip
        ax.scatter(names, pred, marker="_", s=400, color="black", label="planner: state + acts")
        ax.set_title(f"--recompute {mode}")
    axes[0].set_ylabel("MiB per rank (measured)")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.suptitle("tetrad: measured memory per rank, 2 ranks, 4x128 Llama, vocab 4096, 8x128 tokens")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/memory.png")
