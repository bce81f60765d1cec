"""Calibrate the planner on a machine from tetrad's own runs there (`--from-run`).

A run directory holds `config.json` (the whole Config) and `metrics.jsonl` (one row per
step, `step_time_s` among them). Its measured step is the fastest of the steps after the
first quarter (warm-up: allocator, caches, the first collectives' setup): on a machine
shared with other work, the least disturbed step is the most reproducible estimate.

Two things are fitted, the rest of the model is kept:
- the GEMM efficiency of the device: for each run, the efficiency at which the planner
  reproduces its measured step (bisection; the step falls monotonically as it rises);
  the fitted value is the median over the runs;
- with two runs or more, a scale on the links (bandwidth up, latency down, together):
  the one, on a grid from 1/32 to 4x, that makes the runs' implied efficiencies
  agree best, so a run that communicates more than another tells the links apart from
  the compute. A `tetrad bench comm` JSON, when given, fixes the links instead.

The spread of the runs' implied efficiencies around the fitted one is the prediction's
uncertainty (`Cluster.spread`), as the development rows' spread is for the presets.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tetrad.config import Config, from_dict
from tetrad.plan.hardware import Cluster, Link

LINK_SCALES = tuple(2.0 ** (k / 2) for k in range(-10, 5))  # 1/32 to 4, by sqrt(2)


@dataclass
class Run:
    """One measured run: its Config and its steady step time (seconds)."""

    path: str
    cfg: Config
    step_time_s: float


def read_run(path: str | Path) -> Run:
    """A run directory's config and fastest steady step time; ValueError if unusable."""
    path = Path(path)
    cfg_file, metrics = path / "config.json", path / "metrics.jsonl"
    if not cfg_file.is_file() or not metrics.is_file():
        raise ValueError(f"{path}: not a run directory (needs config.json and metrics.jsonl)")
    raw = json.loads(cfg_file.read_text())
    cfg = from_dict({k: v for k, v in raw.items() if isinstance(v, dict)})
    times = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("step_time_s") and not row.get("skipped"):
            times.append(float(row["step_time_s"]))
    if len(times) < 2:
        raise ValueError(f"{metrics}: {len(times)} timed steps; need at least 2")
    steady = times[len(times) // 4 :]
    return Run(str(path), cfg, min(steady))


def with_efficiency(cluster: Cluster, efficiency: float) -> Cluster:
    """`cluster` with its device's GEMM efficiency replaced."""
    return replace(cluster, device=replace(cluster.device, efficiency=efficiency))


def with_link_scale(cluster: Cluster, scale: float) -> Cluster:
    """`cluster` with links `scale` times faster (bandwidth x scale, latency / scale)."""

    def scaled(link: Link) -> Link:
        measured = {op: (a / scale, bw * scale) for op, (a, bw) in link.measured.items()}
        return replace(link, alpha_s=link.alpha_s / scale, base_s=link.base_s / scale,
                       bw_Bps=link.bw_Bps * scale, measured=measured)  # fmt: skip

    return replace(cluster, intra=scaled(cluster.intra), inter=scaled(cluster.inter))


def implied_efficiency(cluster: Cluster, engine: Any, cfg: Config, step_s: float) -> float:
    """The GEMM efficiency at which the planner predicts `step_s` for `cfg`."""
    from tetrad.plan.cost import Planner

    lo, hi = 1e-3, 1.0
    for _ in range(20):
        mid = math.sqrt(lo * hi)
        got = Planner(with_efficiency(cluster, mid), engine).predict(cfg, detail=False)
        lo, hi = (mid, hi) if got.step_time_s > step_s else (lo, mid)
    return math.sqrt(lo * hi)


@dataclass
class Calibration:
    """What `calibrate` fitted, and from what."""

    efficiency: float
    link_scale: float
    spread: tuple[float, float]
    runs: list[dict[str, Any]]


def calibrate(
    cluster: Cluster, engine: Any, runs: list[Run], fit_links: bool = True
) -> tuple[Cluster, Calibration]:
    """`cluster` fitted to `runs` (efficiency; links too with two runs or more)."""
    if not runs:
        raise ValueError("calibrate needs at least one run")
    scales = LINK_SCALES if fit_links and len(runs) > 1 else (1.0,)
    best = None
    for scale in scales:
        linked = with_link_scale(cluster, scale)
        implied = [implied_efficiency(linked, engine, r.cfg, r.step_time_s) for r in runs]
        spread = max(implied) / min(implied)
        if best is None or spread < best[0] - 1e-9:
            best = (spread, scale, implied)
    _, scale, implied = best
    eff = statistics.median(implied)
    fitted = with_efficiency(with_link_scale(cluster, scale), eff)
    ratios = (min(implied) / eff, max(implied) / eff)
    fitted = replace(fitted, spread=ratios)
    table = [
        {"run": r.path, "layout": _layout(r.cfg), "step_time_s": r.step_time_s,
         "implied_efficiency": e}
        for r, e in zip(runs, implied)
    ]  # fmt: skip
    return fitted, Calibration(eff, scale, ratios, table)


def _layout(cfg: Config) -> dict[str, Any]:
    p = cfg.parallel
    keys = ("dp", "fsdp", "tp", "pp", "zero_stage", "pp_schedule", "microbatches")
    return {k: getattr(p, k) for k in keys}


def to_dict(cal: Calibration) -> dict[str, Any]:
    """JSON-ready form of a calibration."""
    return dataclasses.asdict(cal)
