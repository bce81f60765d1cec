"""Calibrate the planner on a machine from tetrad's own runs there (`--from-run`).

A run directory holds `config.json` (the whole Config) and `metrics.jsonl` (one row per
step, `step_time_s` among them). Its measured step is the median of the steps after
warm-up (the first quarter, at least two steps: allocator, caches, the first
collectives' setup): on a machine shared with other work the median is what a step
costs at that load, where the fastest step is one lucky sample. The steps' own spread
(median absolute deviation over the median) says how far that figure can be trusted.

The planner's model of the machine has two physical unknowns, both fitted, the rest of
the model kept:
- `e`, the share of the device's declared peak its GEMMs reach (compute efficiency);
- `k`, a scale on the links (bandwidth x k, latency / k: gloo over loopback is slower
  or faster than its preset, or the `tetrad bench comm` fit, by one factor).

The fit is least squares on log step time, each run weighted by its own noise (its
steps' spread, at least `MODEL_NOISE`), with a log-normal prior on k around the preset
(`LINK_PRIOR`: a factor of 2 is one standard deviation): with runs whose communication
is a small share of the step, their differences say little about the links, and a
prior keeps one noisy run from moving k to a bound. For each k on a grid from 1/16 to
16 the best e is found (each run's implied efficiency, the e that reproduces it
exactly, combined as the weighted geometric mean), then the k with the lowest
objective is kept. A `tetrad bench comm` JSON, when given, fixes the links (k = 1 on
the measured ones) and only e is fitted.

The spread of the runs' implied efficiencies around the fitted one (at the fitted k)
is the prediction's uncertainty (`Cluster.spread`), as the development rows' spread is
for the presets.

A run may be timed in CPU seconds instead (`Run.cpu`: its busiest rank's, all of its
process's threads), which other work on the machine does not inflate the way it does
the wall step; it is then fitted to the planner's work of the busiest rank
(`busy_time`), without the pipeline's idle time, which uses no CPU.
`tests/test_plan_from_run.py` times its runs so; `tetrad train` writes wall steps.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tetrad.config import ModelConfig, from_dict
from tetrad.layout import Layout
from tetrad.plan.hardware import Cluster, Link, at_efficiency

LINK_SCALES = tuple(2.0 ** (k / 2) for k in range(-8, 9))  # 1/16 to 16, by sqrt(2)
LINK_PRIOR = math.log(2.0)  # one standard deviation of log k around the preset's links
MODEL_NOISE = 0.05  # the least relative error a run is trusted to (the model's own)
EFFICIENCY_BOUNDS = (1e-3, 1.0)


@dataclass
class Run:
    """One measured run: its Layout and model, its steady step time (seconds, the median
    after warm-up) and that figure's relative noise (the steps' spread over the median)."""

    path: str
    layout: Layout
    model: ModelConfig
    step_time_s: float
    noise: float = 0.0
    cpu: bool = False  # step_time_s is the busiest rank's CPU seconds a step (`busy_time`)


def read_run(path: str | Path) -> Run:
    """A run directory's config and median steady step time; ValueError if unusable."""
    path = Path(path)
    cfg_file, metrics = path / "config.json", path / "metrics.jsonl"
    if not cfg_file.is_file() or not metrics.is_file():
        raise ValueError(f"{path}: not a run directory (needs config.json and metrics.jsonl)")
    raw = json.loads(cfg_file.read_text())
    cfg = from_dict({k: v for k, v in raw.items() if isinstance(v, dict)})
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [float(r["step_time_s"]) for r in rows if r.get("step_time_s") and not r.get("skipped")]
    if len(times) < 2:
        raise ValueError(f"{metrics}: {len(times)} timed steps; need at least 2")
    return Run(str(path), Layout.build(cfg), cfg.model, *steady_median(times))


def steady_median(times: list[float]) -> tuple[float, float]:
    """The median of the steps after warm-up (all but the first quarter, at least two
    dropped while at least two remain), and their spread: the median absolute deviation
    over the median."""
    steady = times[max(len(times) // 4, min(2, len(times) - 2)) :]
    median = statistics.median(steady)
    return median, statistics.median(abs(t - median) for t in steady) / median


def with_link_scale(cluster: Cluster, scale: float) -> Cluster:
    """`cluster` with links `scale` times faster (bandwidth x scale, latency / scale)."""

    def scaled(link: Link) -> Link:
        measured = {op: (a / scale, bw * scale) for op, (a, bw) in link.measured.items()}
        return replace(link, alpha_s=link.alpha_s / scale, base_s=link.base_s / scale,
                       intra_alpha_s=link.intra_alpha_s / scale, bw_Bps=link.bw_Bps * scale,
                       measured=measured)  # fmt: skip

    return replace(cluster, intra=scaled(cluster.intra), inter=scaled(cluster.inter))


def busy_time(pred: Any) -> float:
    """A prediction's seconds of work on its busiest rank: the step less the pipeline's
    idle time (its bubble and its waits for transfers), in which a rank runs nothing.
    What the rank's CPU time measures: its computing, its communication (gloo's threads
    move and reduce the bytes), its optimizer step."""
    return pred.step_time_s - pred.breakdown["bubble"] - pred.breakdown["pp"]


def predicted_step(planner: Any, run: Run, efficiency: float) -> float:
    """`planner`'s step for `run`'s layout at GEMM efficiency `efficiency` (for a run
    timed in CPU seconds, the busiest rank's work, `busy_time`)."""
    at = planner.on(at_efficiency(planner.cluster, efficiency))
    pred = at.predict(run.layout, run.model, False)
    return busy_time(pred) if run.cpu else pred.step_time_s


def implied_efficiency(planner: Any, run: Run) -> float:
    """The GEMM efficiency at which `planner` predicts `run`'s step time (as the busiest
    rank's work where it is CPU seconds), within EFFICIENCY_BOUNDS (a bound where even it
    cannot reproduce the step)."""
    lo, hi = EFFICIENCY_BOUNDS
    for _ in range(16):  # to 0.03% of the bounds' log range
        mid = math.sqrt(lo * hi)
        if predicted_step(planner, run, mid) > run.step_time_s:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


@dataclass
class Calibration:
    """What `calibrate` fitted, and from what."""

    efficiency: float
    link_scale: float
    spread: tuple[float, float]
    runs: list[dict[str, Any]]


@dataclass
class _Trial:
    """One link scale's best fit."""

    scale: float
    objective: float
    efficiency: float
    implied: list[float]
    predicted: list[float]


def _sigma(run: Run) -> float:
    return math.hypot(MODEL_NOISE, run.noise)


def _trial(planner: Any, runs: list[Run], scale: float) -> _Trial:
    """The best efficiency at link scale `scale` and the fit's objective there, the prior
    on the links included (nothing at scale 1, the only one when the links are fixed)."""
    linked = planner.on(with_link_scale(planner.cluster, scale))
    implied = [implied_efficiency(linked, r) for r in runs]
    weights = [1 / _sigma(r) ** 2 for r in runs]
    eff = math.exp(sum(w * math.log(e) for w, e in zip(weights, implied)) / sum(weights))
    predicted = [predicted_step(linked, r, eff) for r in runs]
    objective = sum((math.log(p / r.step_time_s) / _sigma(r)) ** 2 for p, r in zip(predicted, runs))
    objective += (math.log(scale) / LINK_PRIOR) ** 2
    return _Trial(scale, objective, eff, implied, predicted)


def calibrate(
    cluster: Cluster, engine: Any, runs: list[Run], fit_links: bool = True
) -> tuple[Cluster, Calibration]:
    """`cluster` fitted to `runs` (efficiency; links too unless `fit_links` is False)."""
    if not runs:
        raise ValueError("calibrate needs at least one run")
    from tetrad.plan.cost import Planner

    planner = Planner(cluster, engine)
    scales = LINK_SCALES if fit_links else (1.0,)
    best = min((_trial(planner, runs, s) for s in scales), key=lambda t: t.objective)
    ratios = (min(best.implied) / best.efficiency, max(best.implied) / best.efficiency)
    fitted = at_efficiency(with_link_scale(cluster, best.scale), best.efficiency)
    fitted = replace(fitted, spread=(min(ratios[0], 1.0), max(ratios[1], 1.0)))
    table = [
        {"run": r.path, "layout": _layout(r.layout), "step_time_s": r.step_time_s,
         "noise": r.noise, "implied_efficiency": e, "predicted_step_time_s": p}
        for r, e, p in zip(runs, best.implied, best.predicted)
    ]  # fmt: skip
    return fitted, Calibration(best.efficiency, best.scale, fitted.spread, table)


def _layout(lay: Layout) -> dict[str, Any]:
    degrees = {k: getattr(lay, k) for k in ("dp", "fsdp", "tp", "pp", "zero_stage")}
    return degrees | {"pp_schedule": lay.schedule, "microbatches": lay.microbatches}
