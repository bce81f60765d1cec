"""The test harness: the tiny test model, training runs on one rank or several (and the
jobs that share one spawn per world size, `Jobs`), the comparison of two runs, and the
reference CSVs' path (tests/data/).

Test-only; what users need (`spawn`) is in `tetrad.testing`. Tests import these with
`from harness import ...`: pytest puts tests/ on sys.path, and spawned ranks inherit it.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tetrad.config import Config, from_dict
from tetrad.mesh import Mesh
from tetrad.testing import spawn
from tetrad.train.loop import Trainer

# Copies of the published reference CSVs (tests/data/README.md names each one's source)
DATA = Path(__file__).resolve().parent / "data"


def reference_csv(name: str) -> Path:
    """The path of reference CSV `name` in tests/data/ (an error, not a skip, if missing)."""
    path = DATA / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: copy it from shared/reference/ (tests/data/README.md)")
    return path


def tiny_config(**overrides: dict[str, Any]) -> Config:
    """The test model: tiny Llama, synthetic data, 20 steps, no progress display, in fp64,
    the verification dtype (layouts then differ by float64 round-off alone: EXACT);
    `train={"dtype": ...}` gives what users run (fp32, bf16), held by `check_rounded`."""
    base = {
        "model": {"layers": 2, "dim": 32, "heads": 4, "kv_heads": 2, "vocab": 64},
        "train": {
            "steps": 20, "global_batch": 8, "seq_len": 16, "lr": 3e-3,
            "warmup_steps": 2, "progress": False, "dtype": "fp64",
        },
        "data": {"source": "synthetic"},
        "checkpoint": {"final": False},  # tests that save say so
    }  # fmt: skip
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    return from_dict(base)


def trainer_for(cfg: Config, rank: int) -> Trainer:
    """This rank's CPU trainer of `cfg` on the mesh of its degrees (process group joined)."""
    mesh = Mesh.build(cfg.parallel, rank)
    return Trainer(cfg, mesh, torch.device("cpu"))


def train_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Train a config on this rank; return losses, norms, comm stats and the full weights."""
    trainer = trainer_for(from_dict(cfg_dict), rank)
    rows = trainer.fit()
    state = trainer.engine.full_state_dict()
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "skipped": [r["skipped"] for r in rows],
        "comm": trainer.comm.summary(),
        "state": state if rank == 0 else None,
    }


def one_step_comm(rank: int, world: int, cfg_dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One step of each config on this rank; the comm layer's counts for that step."""
    out = []
    for raw in cfg_dicts:
        trainer = trainer_for(from_dict(raw), rank)
        trainer.comm.reset()
        trainer.train_step()
        out.append(trainer.comm.summary())
    return out


def train_many(rank: int, world: int, cfg_dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several trainings, one after the other, in one set of processes (saves start-ups)."""
    return [train_worker(rank, world, raw) for raw in cfg_dicts]


def train_resumed(rank: int, world: int, runs: list[tuple[dict, int | None]]) -> list[dict]:
    """Per (config, stop): build a trainer, resume if its config says so, train to `stop`;
    where it started, its losses and norms, and (rank 0) the full weights."""
    out = []
    for raw, stop in runs:
        trainer = trainer_for(from_dict(raw), rank)
        start = trainer.resume()
        rows = trainer.fit(stop=stop)
        state = trainer.engine.full_state_dict()  # a collective: every rank
        out.append({
            "start": start,
            "losses": [r["loss"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows],
            "state": state if rank == 0 else None,
        })  # fmt: skip
    return out


def run_jobs(rank: int, world: int, jobs: dict[str, tuple[Callable, tuple]]) -> list[Any]:
    """Several workers, one after another, in one set of processes: fn(rank, world, *args)
    of each job (name: (fn, args)), in order. With TETRAD_JOB_TIMES set to a file, rank 0
    appends each job's wall and CPU seconds to it (where the suite's time goes)."""
    log = os.environ.get("TETRAD_JOB_TIMES") if rank == 0 else None
    out = []
    for name, (fn, args) in jobs.items():
        wall, cpu = time.perf_counter(), time.process_time()
        out.append(fn(rank, world, *args))
        if log:
            with open(log, "a") as f:
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                f.write(f"{wall:8.1f} {cpu:8.1f} {world} {name}\n")
    return out


class Jobs:
    """Multi-process jobs grouped by world size, each group run in one spawn (starting the
    ranks is most of a small job's time): all of them in the background from `start`, or
    else the first time a test asks for one of its jobs.

    jobs.add(name, world, fn, *args) queues fn(rank, world, *args); jobs[name] is then its
    results in rank order. `scoped(prefix)` is a view of the same queue whose names carry
    the prefix (conftest gives each test module one). A failed spawn fails every job of
    that world size, each time asked, without running it again.
    """

    def __init__(self, timeout: float = 600.0, mktemp: Callable[[str], Path] | None = None):
        self.timeout = timeout
        self._mktemp = mktemp  # makes a new temporary directory (tmp_path_factory.mktemp)
        self._tmp: dict[str, Path] = {}
        self._prefix = ""
        self._queued: dict[int, dict[str, tuple[Callable, tuple]]] = {}
        self._results: dict[str, list[Any]] = {}
        self._failed: dict[int, BaseException] = {}
        self._done: dict[int, threading.Event] = {}  # the worlds `start` runs, set when run

    def scoped(self, prefix: str) -> Jobs:
        """A view of these jobs whose names are prefixed with `prefix:`."""
        view = copy.copy(self)
        view._prefix = f"{self._prefix}{prefix}:"
        return view

    def tmp(self, name: str) -> Path:
        """The temporary directory `name` of these jobs: made on the first call, the same
        one after (for jobs that write files, and the tests that read them)."""
        key = self._prefix + name
        if key not in self._tmp:
            if self._mktemp is None:
                raise ValueError("these jobs were made without mktemp")
            self._tmp[key] = self._mktemp(key.replace(":", "-").replace(".", "-"))
        return self._tmp[key]

    def add(self, name: str, world: int, fn: Callable, *args: Any) -> None:
        name = self._prefix + name
        if any(name in queued for queued in self._queued.values()):
            raise ValueError(f"job {name!r} added twice")
        if world in self._done:
            raise ValueError(f"job {name!r}: the {world}-rank world has already started")
        self._queued.setdefault(world, {})[name] = (fn, args)

    def add_training(self, name: str, cfgs: list[Config]) -> None:
        """Queue the training of `cfgs` (one world size, see train_many): jobs[name][0] is
        then rank 0's runs, in order."""
        worlds = {c.parallel.world for c in cfgs}
        if len(worlds) != 1:
            raise ValueError(f"{name}: one world size per training job, got {sorted(worlds)}")
        self.add(name, worlds.pop(), train_many, [c.to_dict() for c in cfgs])

    def start(self) -> None:
        """Run every queued world, the largest first, in two background threads (each
        taking every other size, one world after another: a world's ranks wait on each
        other's gloo messages often enough that two worlds keep two cores busier than
        one). The ranks then use the cores that the tests needing no world leave idle
        (pytest runs those first, see conftest); a test that asks for a job waits for its
        own world only. A world that has started takes no more jobs."""
        worlds = sorted(self._queued, reverse=True)
        self._done.update((w, threading.Event()) for w in worlds)
        for lane in (worlds[0::2], worlds[1::2]):
            threading.Thread(target=self._run_all, args=(lane,), name="jobs", daemon=True).start()

    def _run_all(self, worlds: list[int]) -> None:
        for world in worlds:
            try:
                self._run(world)
            except Exception:  # kept in _failed: the tests that ask raise it
                pass
            finally:
                self._done[world].set()

    def _run(self, world: int) -> None:
        queued = dict(self._queued[world])
        try:
            per_rank = spawn(run_jobs, world, queued, timeout=self.timeout)
        except Exception as e:
            self._failed[world] = e
            raise
        self._results.update(zip(queued, (list(job) for job in zip(*per_rank))))

    def __getitem__(self, name: str) -> list[Any]:
        name = self._prefix + name
        if name not in self._results:
            world = next((w for w, q in self._queued.items() if name in q), None)
            if world is None:
                raise KeyError(f"no job {name!r}")
            if world in self._done:
                self._done[world].wait()
            elif world not in self._failed:
                self._run(world)
            if world in self._failed:
                raise self._failed[world]
        return self._results[name]


def run_layouts(cfgs: list[Config], timeout: float = 600.0) -> list[dict[str, Any]]:
    """Train configs of one world size in one spawn; rank 0's results in order."""
    worlds = {c.parallel.world for c in cfgs}
    if len(worlds) != 1:
        raise ValueError(f"run_layouts needs one world size, got {sorted(worlds)}")
    raws = [c.to_dict() for c in cfgs]
    return spawn(train_many, worlds.pop(), raws, timeout=timeout)[0]


def run_layout(cfg: Config, timeout: float = 240.0) -> dict[str, Any]:
    """Train `cfg` on its world size (in-process when 1); rank 0's result."""
    world = cfg.parallel.world
    raw = cfg.to_dict()
    if world == 1:
        return train_worker(0, 1, raw)
    return spawn(train_worker, world, raw, timeout=timeout)[0]


# The bound every fp64 layout is held to, relative, on losses, norms and weights (norm-wise
# per tensor), after 20 steps. float64 rounds at 1.1e-16 a step of arithmetic; 20 AdamW
# steps of the tiny model amplify a layout's different summation order to at most 1e-14
# (seen: 1.1e-14, cp; docs/architecture.md, "Bounds"), whatever the CPU's kernels, so the
# bound has four orders of margin. A real bug moves fp64 results by far more: one rounding
# to float32 anywhere in a step left weights 1e-8 away (the chunked loss's weight gradient,
# found by this bound), a lost or doubled gradient term 1e-3 and up.
EXACT = 1e-10


def assert_close_run(got: dict, ref: dict, rtol: float = EXACT) -> None:
    """Per-step losses, grad norms and final weights equal to the reference (relative
    rtol): fp64 runs. A float32 or bf16 run rounds where its layout splits a sum, by an
    amount that depends on the CPU's kernels: `check_rounded` holds those."""
    dtypes = {t.dtype for t in ref["state"].values()} | {t.dtype for t in got["state"].values()}
    if rtol < 1e-6 and dtypes != {torch.float64}:
        raise ValueError(f"a fixed bound of {rtol:.0e} is for fp64 runs, not {dtypes}")
    torch.testing.assert_close(
        torch.tensor(got["losses"], dtype=torch.float64),
        torch.tensor(ref["losses"], dtype=torch.float64),
        rtol=rtol, atol=0,
    )  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(got["grad_norms"], dtype=torch.float64),
        torch.tensor(ref["grad_norms"], dtype=torch.float64),
        rtol=rtol, atol=0,
    )  # fmt: skip
    assert got["state"].keys() == ref["state"].keys()
    # Weights: norm-wise relative error per tensor. Adam turns round-off in near-zero
    # gradients into visible element-wise differences, so element-wise rtol is too strict.
    for name, value in ref["state"].items():
        err = float((got["state"][name].double() - value.double()).norm() / value.double().norm())
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


def valid_schedule(name: str, pp: int, m: int, v: int) -> bool:
    """Whether `layout.check_schedule` accepts the request (grids enumerate only these)."""
    from tetrad.layout import check_schedule

    try:
        check_schedule(name, pp, m, v)
    except ValueError:
        return False
    return True


# What users run (fp32, bf16) rounds where a layout splits a sum, by amounts that depend
# on the CPU's kernels (AVX-512 and SSE4.2 sum in other orders than AVX2): no fixed bound
# holds everywhere. Such a layout is held to its own single process's rounding instead:
# its distance from the fp64 single process at most ROUNDED_K times the distance of the
# single process in the same dtype from it, on losses and norms (the worst step) and on
# every weight tensor (norm-wise; the single process's distance floored at its median
# over tensors, so a tensor it happens to land near is not held to luck). Both distances
# are one rounding process seen twice, so their ratio does not move with the kernels
# (docs/architecture.md, "Bounds", has the ratios measured on two kernel paths); a bug
# (a missing or doubled reduction, a cast in the wrong place) moves a layout by 10 to
# 10^4 times the rounding, far past the multiple.
ROUNDED_K = {"losses": 3.0, "grad_norms": 3.0, "weights": 5.0}


def rounded_distances(run: dict, high: dict) -> dict[str, Any]:
    """How far `run` is from the fp64 run `high`: worst relative step of losses and norms,
    norm-wise relative distance of each weight tensor."""

    def worst(key: str) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(run[key], high[key], strict=True))

    weights = {
        n: float((run["state"][n].double() - v).norm() / v.norm()) for n, v in high["state"].items()
    }
    return {"losses": worst("losses"), "grad_norms": worst("grad_norms"), "weights": weights}


def check_rounded(got: dict, single: dict, high: dict, k: dict[str, float] = ROUNDED_K) -> None:
    """A float32 or bf16 layout's run `got` no farther from the fp64 single process `high`
    than k times the single process in its dtype (`single`) is (see ROUNDED_K)."""
    assert got["state"].keys() == high["state"].keys()
    mine, own = rounded_distances(got, high), rounded_distances(single, high)
    for key in ("losses", "grad_norms"):
        assert mine[key] <= k[key] * own[key], (
            f"{key}: {mine[key]:.2e} from fp64, > {k[key]} x the single process's {own[key]:.2e}"
        )
    floor = sorted(own["weights"].values())[len(own["weights"]) // 2]
    for name, d in mine["weights"].items():
        allowed = k["weights"] * max(own["weights"][name], floor)
        assert d <= allowed, f"{name}: {d:.2e} from fp64, > {allowed:.2e} allowed"
