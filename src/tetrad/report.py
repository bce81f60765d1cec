"""`tetrad report RUN`: PNG plots of a run's metrics.jsonl and a short text summary."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

MIB = 2**-20
# figure file -> (title, panels); a panel: (y label, [(metrics key, legend, scale)])
FIGURES = {
    "loss.png": ("loss", [("loss", [("loss", "train", 1.0), ("eval_loss", "held-out", 1.0)])]),
    "optim.png": (
        "optimizer",
        [("learning rate", [("lr", "lr", 1.0)]), ("grad norm", [("grad_norm", "norm", 1.0)])],
    ),
    "throughput.png": (
        "throughput",
        [("tokens/s", [("tokens_per_s", "tokens/s", 1.0)]), ("MFU (%)", [("mfu", "MFU", 100.0)])],
    ),
    "memory.png": (
        "memory (max over ranks)",
        [("MiB", [("peak_mem_bytes", "peak", MIB), ("model_state_bytes", "model state", MIB)])],
    ),
    "comm.png": ("communication", [("MiB per step", [("comm_bytes", "bus bytes", MIB)])]),
}


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run} is not a run directory: {path.name} is missing")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not JSON: {e}") from e
    if not rows:
        raise ValueError(f"{path} has no rows")
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """Median tokens/s and MFU (the first step, which warms up, excluded when there are
    more), peak memory, skipped steps, final and best held-out loss."""
    timed = rows[1:] if len(rows) > 1 else rows
    skipped = [r["step"] for r in rows if r.get("skipped")]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    lines = [
        f"steps                {rows[0]['step']}..{rows[-1]['step']} ({len(rows)} rows)",
        f"loss                 {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}",
        f"tokens               {sum(r['tokens'] for r in rows):,}",
        f"median tokens/s      {statistics.median(r['tokens_per_s'] for r in timed):,.0f}",
        f"median MFU           {100 * statistics.median(r['mfu'] for r in timed):.2f}%",
        f"median step time     {statistics.median(r['step_time_s'] for r in timed) * 1e3:.1f} ms",
        f"peak memory          {max(r['peak_mem_bytes'] for r in rows) / 2**20:,.1f} MiB"
        " (max over ranks and steps)",
        f"skipped steps        {len(skipped)}" + (f" (steps {skipped[:10]})" if skipped else ""),
    ]
    if evals:
        best = min(evals, key=lambda e: e[1])
        lines.append(
            f"eval loss            {evals[-1][1]:.4f} at step {evals[-1][0]}"
            f" (best {best[1]:.4f} at step {best[0]})"
        )
    if "epoch" in rows[-1]:
        lines.append(f"epochs               {rows[-1]['epoch']:.3f}")
    if "moe_layers" in rows[-1]:
        first, last = _worst_load(rows[0]), _worst_load(rows[-1])
        lines += [
            f"moe aux loss         {rows[0]['moe_aux_loss']:.4f} -> {rows[-1]['moe_aux_loss']:.4f}",
            f"expert load max/mean {first:.2f} -> {last:.2f} (the most imbalanced layer)",
        ]
    return "\n".join(lines) + "\n"


def _worst_load(row: dict[str, Any]) -> float:
    """The largest max/mean tokens-per-expert ratio over a row's MoE layers."""
    return max(v["load_max"] / v["load_mean"] for v in row["moe_layers"].values())


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """One PNG per figure, one panel per quantity, the series present in the rows."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no backend, no figure registry
    except ImportError as e:
        raise ValueError("tetrad report needs matplotlib: pip install 'tetrad[plot]'") from e
    written = []
    for fname, (title, panels) in FIGURES.items():
        panels = [(y, [s for s in ss if any(s[0] in r for r in rows)]) for y, ss in panels]
        panels = [(y, ss) for y, ss in panels if ss]
        if not panels:
            continue
        fig = Figure(figsize=(7, 2.8 * len(panels)))
        axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
        for ax, (ylabel, series) in zip(axes, panels):
            for key, legend, scale in series:
                pts = [(r["step"], r[key] * scale) for r in rows if key in r]
                sparse = len(pts) < 0.5 * len(rows) or len(pts) < 30
                ax.plot(*zip(*pts), label=legend, marker="o" if sparse else None, markersize=3)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if len(series) > 1:
                ax.legend()
        written.append(_save(fig, axes, title, out / fname))
    return written


def plot_experts(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """experts.png, for a mixture of experts: per MoE layer over the steps, the busiest
    expert's tokens over the mean (1: balanced), the auxiliary loss and router entropy."""
    rows = [r for r in rows if "moe_layers" in r]
    if not rows:
        return []
    from matplotlib.figure import Figure  # plot() has checked it is there

    layers = list(rows[-1]["moe_layers"])
    quantities = [
        ("max / mean tokens per expert", lambda v: v["load_max"] / v["load_mean"]),
        ("auxiliary loss", lambda v: v["aux_loss"]),
        ("router entropy (nats)", lambda v: v["router_entropy"]),
    ]
    fig = Figure(figsize=(7, 2.8 * len(quantities)))
    axes = fig.subplots(len(quantities), 1)
    for ax, (ylabel, value) in zip(axes, quantities):
        for layer in layers:
            pts = [(r["step"], value(r["moe_layers"][layer])) for r in rows]
            ax.plot(*zip(*pts), label=f"layer {layer}")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small", ncol=4)
    return [_save(fig, axes, "expert load", out / "experts.png")]


def _save(fig, axes, title: str, path: Path) -> Path:
    """Title the panels (one above the other, over the steps), write `path`."""
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def report(run: str | Path, out: str | Path | None = None) -> tuple[str, list[Path]]:
    """Write RUN/report/ (or `out`): the PNGs and summary.txt; return the summary text."""
    rows = read_metrics(run)
    out = Path(out) if out else Path(run) / "report"
    out.mkdir(parents=True, exist_ok=True)
    text = summary(rows)
    (out / "summary.txt").write_text(text)
    return text, [*plot(rows, out), *plot_experts(rows, out), out / "summary.txt"]
