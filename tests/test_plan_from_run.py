"""`tetrad plan --from-run`: fitted to tetrad's own runs on this machine, the planner
predicts a layout it was not fitted to. Three 2-rank layouts of one job are trained in the
same two processes, a few steps of each in turn, each writing its run directory as
`tetrad train` does; each is then predicted from the other two, in CPU time (below). One
`tetrad train` run is also read back through the command line. The fit itself is checked
without processes, on steps the planner made up at a known efficiency and link speed.

Why CPU time: the test runs beside the rest of the suite (conftest starts the worlds in
the background) and beside other people's jobs on a 2-core machine, and a step's wall time
counts the neighbours: at 4.5 to 7.6 tasks runnable on average, the wall-time errors of
the same runs reached -30% and +33%. A rank's CPU time (its process's, gloo's threads
included: they move and reduce the bytes) is the work it did, computing and communicating;
a neighbour that takes its core stops that clock too. The planner's counterpart is the
busiest rank's work (`calibrate.busy_time`): the step less the pipeline's idle time, which
uses no CPU. The bubble is therefore not tested here; `test_pp_measure` checks the
runtime's bubble against the schedule's, on computes padded to fixed times.

Why in turn: on this shared machine the speed drifts by 10-20% over tens of seconds
(measured in wall time: separate 24-step runs of the same layout, a minute apart, differed
by up to 19%), so three runs made one after the other compare the machine's moments as
much as the layouts; steps of all three interleaved see the same machine."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import Jobs, trainer_for
from plan_helpers import layout_config, planned
from tetrad.cli import build_config, parser
from tetrad.config import model_preset
from tetrad.plan.calibrate import (
    Run,
    busy_time,
    calibrate,
    read_run,
    steady_median,
    with_link_scale,
)
from tetrad.plan.cost import Planner
from tetrad.plan.engines import TETRAD
from tetrad.plan.hardware import at_efficiency, cluster_preset
from tetrad.train.metrics import MetricsWriter

LAYOUTS = {
    "dp2": ["--dp", "2"],
    "fsdp2": ["--fsdp", "2"],
    "pp2": ["--pp", "2", "--microbatches", "4"],
}
JOB = ["--model", "small", "--global-batch", "16", "--seq-len", "128", "--steps", "32",
       "--data", "synthetic", "--no-progress"]  # fmt: skip
TURN = 4  # steps of one layout before the next layout's turn
# Each layout's busiest rank's CPU seconds a step, predicted from the other two's, within
# BOUND. Measured (2026-12, this job, 13 runs at 4.5 to 19.9 tasks runnable on average on
# the 2 cores: other people's jobs, 3 busy loops beside it in seven, other test files
# in one): dp 2 +5% to +16%, fsdp 2 -5% to +9%, pp 2 -6% to -18%; the wall-time errors of
# 4 of the same runs reached -30% and +33%. What is left is mostly the model's own (pp's
# four microbatches of smaller GEMMs cost more a FLOP than it says; dp 2 less), and some
# load's: pp 2's CPU time over dp 2's varied from 1.08 to 1.21 between runs (likely a rank
# that blocks and wakes often, as pp's do at their sends and receives, finds its caches
# cold after a neighbour ran; not measured).
BOUND = 0.25
# The negative control: links fixed at 1/8 of the preset's (communication charged 8x what
# gloo costs here) with only the efficiency fitted to the two: on 4 of those runs pp 2 misses
# by -45% to -56% and fsdp 2 by +36% to +51%, so the runs tell the links apart at this
# bound. At 1/4 pp 2 misses by -22% to -29%, at the bound; communication is 3-7% of these
# steps, so a model without any (-12% to +12%) is inside it, as one with links 2x off.
WRONG_LINKS = 1 / 8


def job_config(layout: list[str], out: Path):
    """The Config `tetrad train` builds from these flags."""
    return build_config(parser().parse_args(["train", *layout, *JOB, "--out", str(out)]))


def _runnable() -> int:
    """Tasks runnable on the machine now (the kernel's count: /proc/loadavg's fourth field),
    or 0 where there is no such file."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except OSError:
        return 0


def _interleaved(rank: int, world: int, dicts: dict[str, dict]) -> dict:
    """Train every layout on this rank, TURN steps each in turn; rank 0 writes each run's
    config.json and metrics.jsonl as `tetrad train` does. Returns this rank's CPU seconds
    of each step, by layout ("cpu"), and what the steps ran under ("load"): the mean count
    of runnable tasks, sampled every 0.1 s while they trained (not the load average, whose
    minute-long memory holds the jobs before these)."""
    import threading

    from tetrad.config import from_dict

    trainers = {n: trainer_for(from_dict(d), rank) for n, d in dicts.items()}
    writers = {}
    if rank == 0:
        for name, t in trainers.items():
            out = Path(t.cfg.train.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(t.cfg.to_dict(), indent=2))
            writers[name] = MetricsWriter(str(out), t.cfg.train.steps, False)
    steps = next(iter(trainers.values())).cfg.train.steps
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            samples.append(_runnable())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    for start in range(0, steps, TURN):
        for name, t in trainers.items():
            for step in range(start + 1, min(start + TURN, steps) + 1):
                c0 = time.process_time()
                t.fit(writers.get(name), stop=step)
                cpu[name].append(time.process_time() - c0)
    done.set()
    sampler.join()
    for w in writers.values():
        w.close()
    return {"load": sum(samples) / max(len(samples), 1), "cpu": cpu}


def declare_jobs(jobs: Jobs) -> None:
    """The three layouts, interleaved, in the shared 2-rank world."""
    root = jobs.tmp("runs")
    cfgs = {name: job_config(layout, root / name) for name, layout in LAYOUTS.items()}
    jobs.add("interleaved", 2, _interleaved, {n: c.to_dict() for n, c in cfgs.items()})


@pytest.fixture(scope="module")
def runs(jobs) -> dict[str, str]:
    """The runs' directories, as `tetrad train` writes them (wall-clock steps)."""
    jobs["interleaved"]  # written by then
    root = jobs.tmp("runs")
    return {name: str(root / name) for name in LAYOUTS}


@pytest.fixture(scope="module")
def worked(jobs, runs) -> tuple[dict[str, Run], float]:
    """Each run timed in CPU seconds a step, its busiest rank's (`Run.cpu`), and the load
    its steps ran under (`_interleaved`)."""
    ranks = jobs["interleaved"]
    out = {}
    for name, path in runs.items():
        median, noise = max(steady_median(rank["cpu"][name]) for rank in ranks)
        out[name] = dataclasses.replace(read_run(path), step_time_s=median, noise=noise, cpu=True)
    return out, ranks[0]["load"]


@pytest.fixture(scope="session")  # its tests run apart (conftest): one launch for both
def cli_run(tmp_path_factory) -> str:
    """One `tetrad train` run directory, as a user gets it."""
    path = tmp_path_factory.mktemp("cli") / "dp2"
    res = subprocess.run(
        [sys.executable, "-m", "tetrad.cli", "train", "--nproc", "2", *LAYOUTS["dp2"], *JOB,
         "--steps", "8", "--out", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return str(path)


def test_job_config_is_what_train_writes(cli_run, tmp_path):
    """The interleaved runs' configs are the command line's (up to the step count)."""
    written = json.loads((Path(cli_run) / "config.json").read_text())
    mine = job_config(LAYOUTS["dp2"], Path(cli_run)).to_dict()
    mine["train"]["steps"] = 8
    assert {k: v for k, v in mine.items() if isinstance(v, dict)} == {
        k: v for k, v in written.items() if isinstance(v, dict)
    }


def _left_out(runs: dict[str, Run], links: float | None = None) -> dict[str, float]:
    """Each run's predicted work a step over its measured, fitted to the other two runs:
    efficiency and links, or the efficiency alone on links `links` x the preset's."""
    base = cluster_preset("cpu")
    if links is not None:
        base = with_link_scale(base, links)
    errors = {}
    for name, run in runs.items():
        others = [r for n, r in runs.items() if n != name]
        cluster, _ = calibrate(base, TETRAD, others, fit_links=links is None)
        pred = Planner(cluster).predict(run.layout, run.model)
        errors[name] = busy_time(pred) / run.step_time_s - 1
    return errors


@pytest.mark.distributed
def test_each_layout_from_the_other_two(worked):
    """Efficiency and link speed fitted to two runs predict the third's work a step (its
    busiest rank's CPU time) within BOUND; links 8x too slow miss by more."""
    runs, load = worked
    print(f"{load:.1f} tasks runnable on average on {os.cpu_count()} cores while the runs trained")
    errors = _left_out(runs)
    for name, run in runs.items():
        print(f"{name}: {run.step_time_s:.4f} CPU s a step (spread {run.noise:.1%}), "
              f"predicted {errors[name]:+.1%}")  # fmt: skip
    assert all(abs(e) <= BOUND for e in errors.values()), errors
    wrong = _left_out(runs, links=WRONG_LINKS)
    assert max(abs(e) for e in wrong.values()) > BOUND, f"links 8x too slow fit too: {wrong}"


@pytest.mark.distributed
def test_cli_from_run(runs, cli_run, capsys):
    from tetrad.cli import main

    argv = ["plan", "--from-run", cli_run, "--from-run", runs["fsdp2"], "--pp", "2",
            "--microbatches", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    cal = out["calibration"]
    assert len(cal["runs"]) == 2 and 0 < cal["efficiency"] <= 1
    pred = out["predictions"][0]
    assert pred["layout"]["pp"] == 2 and pred["layout"]["world"] == 2  # the runs' job
    low, high = pred["step_time_range_s"]
    assert low <= pred["step_time_s"] <= high
    assert main(["plan", "--from-run", cli_run, "--dp", "2"]) == 0
    assert "range" in capsys.readouterr().out


def test_from_run_refuses_what_is_not_a_run(tmp_path, capsys):
    from tetrad.cli import main

    assert main(["plan", "--from-run", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "step_time_s": 0.1}) + "\n")
    assert main(["plan", "--from-run", str(tmp_path)]) == 2
    assert "1 timed steps" in capsys.readouterr().err
    assert main(["plan", "--model", "small", "--gpu", "cpu"]) == 2
    assert "--gpus, --global-batch, --seq-len required" in capsys.readouterr().err


# --- the fit, on made-up steps ---------------------------------------------------------------


def _small(**parallel):
    cfg = layout_config(model_preset("small"), 16, 128, "fp32", **parallel)
    cfg.train.steps = 24
    return cfg


def _made_up(efficiency: float, scale: float) -> dict[str, Run]:
    """Runs whose steps are the planner's own at `efficiency` and links `scale` x the preset."""
    cluster = at_efficiency(with_link_scale(cluster_preset("cpu"), scale), efficiency)
    planner = Planner(cluster)
    cfgs = {"dp2": _small(dp=2), "fsdp2": _small(fsdp=2), "pp2": _small(pp=2, microbatches=4)}
    return {
        n: Run(n, *planned(c), planner.predict(*planned(c), False).step_time_s, 0.02)
        for n, c in cfgs.items()
    }


@pytest.mark.parametrize("efficiency", [0.3, 0.7])
def test_fit_recovers_the_efficiency_and_predicts_the_third(efficiency):
    """Steps made at a known efficiency and links are reproduced: the fitted efficiency
    within 5%, the left-out layout within 3%. The fit stays inside its bounds (the old
    spread-minimising fit ran the links to 1/32 and the efficiency to 1.0)."""
    made = _made_up(efficiency, 1.0)
    for name, run in made.items():
        others = [r for n, r in made.items() if n != name]
        cluster, cal = calibrate(cluster_preset("cpu"), TETRAD, others)
        assert cal.efficiency == pytest.approx(efficiency, rel=0.05)
        assert 0.25 <= cal.link_scale <= 4
        got = Planner(cluster).predict(run.layout, run.model).step_time_s
        assert got == pytest.approx(run.step_time_s, rel=0.03), name


def test_fit_tells_slow_links_from_slow_compute():
    """Links 8x slower than the preset make ZeRO-3 and the pipeline cost more than plain DP
    beside the same compute; fitted on all three, the link scale moves well below 1 and
    the efficiency stays near the true one."""
    made = _made_up(0.5, 1 / 8)
    _, cal = calibrate(cluster_preset("cpu"), TETRAD, list(made.values()))
    assert cal.link_scale <= 0.25
    assert cal.efficiency == pytest.approx(0.5, rel=0.15)
    _, fixed = calibrate(cluster_preset("cpu"), TETRAD, list(made.values()), fit_links=False)
    # links held at the preset: the slow steps are charged to compute, and the runs disagree
    assert fixed.link_scale == 1.0 and fixed.efficiency < cal.efficiency
    assert fixed.spread[1] / fixed.spread[0] > 1.2 > cal.spread[1] / cal.spread[0]


def test_read_run_takes_the_median_after_warm_up(tmp_path):
    cfg = _small(dp=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    steps = [5.0, 3.0, 0.10, 0.12, 0.11, 0.50, 0.11, 0.09]  # warm-up, then one disturbed step
    rows = [{"step": i, "step_time_s": t, "skipped": False} for i, t in enumerate(steps)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run = read_run(tmp_path)
    assert run.step_time_s == pytest.approx(0.11)
    assert run.layout.dp == 2 and 0 < run.noise < 0.2
