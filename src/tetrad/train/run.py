"""One rank's whole job: join the mesh, train, write metrics, leave cleanly."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from tetrad.comm import Comm
from tetrad.comm.watchdog import Watchdog
from tetrad.config import Config
from tetrad.layout import Layout, elastic_config
from tetrad.train.checkpoint import run_record
from tetrad.train.loop import Trainer, init_distributed
from tetrad.train.metrics import MetricsWriter, require_tensorboard
from tetrad.train.stop import Preempted, StopRequest


def run(
    cfg: Config,
    threads: int | None = None,
    timeline: str | None = None,
    layout: Layout | None = None,
) -> list[dict]:
    """Train `cfg` on this process's rank (torchrun's environment, or a single process).

    layout: `cfg`'s, if the caller built it for this world already; built (and so
    validated, once, before any collective) here otherwise. With an elastic degree
    (`--dp auto`) the world torchrun gave this (re)start sets it (`elastic_config`).

    timeline: with pp > 1, a directory for the last step's pipeline timeline pictures.
    SIGTERM/SIGINT stop every rank after the same step with a checkpoint (`Preempted`);
    a collective blocked longer than `train.timeout` ends the process, naming it. On an
    error the process group is left without a barrier: the peers must not wait for us."""
    if threads:
        torch.set_num_threads(threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = elastic_config(cfg, world)  # --dp/--fsdp auto: the degree this world gives
    layout = layout or Layout.build(cfg, world)
    if cfg.train.tensorboard:
        require_tensorboard()  # every rank, before the first collective
    stop = StopRequest(grace=cfg.train.timeout)
    if threading.current_thread() is threading.main_thread():
        stop.install()
    mesh, device = init_distributed(cfg, layout, timeout_s=cfg.train.timeout + 60)
    comm = Comm(device, Watchdog(cfg.train.timeout))
    clean = True
    try:
        return _train(cfg, layout, mesh, device, comm, stop, timeline)
    except BaseException as e:
        clean = isinstance(e, Preempted)  # every rank agreed and saved: they leave together
        raise
    finally:
        stop.uninstall()
        if clean and dist.is_initialized():
            comm.barrier(mesh["world"])  # watched: a peer that never arrives is named
            dist.destroy_process_group()
        comm.watchdog.close()


def _train(
    cfg: Config, layout: Layout, mesh, device, comm: Comm, stop: StopRequest, timeline
) -> list[dict]:
    trainer = Trainer(cfg, mesh, device, comm, stop, layout)
    resumed = trainer.resume()  # None: a fresh start
    writer = None
    try:
        if mesh.rank == 0:
            out = Path(cfg.train.out)
            print(f"tetrad: writing the run to {out}/ (metrics.jsonl, checkpoints/)", flush=True)
            out.mkdir(parents=True, exist_ok=True)
            record = run_record(cfg, trainer.layout)  # a measured split: as fixed
            (out / "config.json").write_text(json.dumps(record, indent=2))
            if resumed is not None:
                replayed = keep_metrics_before(out / "metrics.jsonl", resumed)
                trainer.resumed["replayed_steps"] = replayed
            elif cfg.checkpoint.resume:
                print(f"tetrad: no checkpoint under {out / 'checkpoints'}; starting afresh")
            writer = MetricsWriter(
                cfg.train.out,
                cfg.train.steps,
                cfg.train.progress,
                tensorboard=cfg.train.tensorboard,
                resumed=resumed,
            )
        rows = trainer.fit(writer)
    finally:
        if writer is not None:
            writer.close()
    if timeline and cfg.parallel.pp > 1 and rows:
        write_step_timeline(trainer, timeline)
    if mesh.rank == 0:
        say_where(Path(cfg.train.out), trainer.step, cfg.checkpoint.final or cfg.checkpoint.every)
    return rows


def say_where(out: Path, step: int, saved: bool) -> None:
    """The run's last line: where it is, and what to do with it next."""
    print(f"tetrad: done at step {step}: {out}/metrics.jsonl", flush=True)
    if saved:
        print(f"  sample from it: tetrad generate {out} --prompt 'def '", flush=True)
    print(f"  plot it:        tetrad report {out}", flush=True)


def keep_metrics_before(path: Path, step: int) -> int:
    """Drop metrics rows of steps >= `step`: a resumed run appends its own for them (rows
    written after the checkpoint, before the job died, would otherwise appear twice).
    Returns how many were dropped: the steps the resumed run will do again."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                kept.append(line + "\n")
            else:
                dropped += 1
        except (ValueError, KeyError, TypeError):
            pass  # a row the dying job left half-written
    path.write_text("".join(kept))
    return dropped


def write_step_timeline(trainer: Trainer, out_dir: str) -> None:
    """Gather the last step's pipeline timeline (every rank calls); rank 0 writes it."""
    from tetrad.parallel.pipeline.measure import measure_step, write_timeline

    lay = trainer.layout
    run = trainer.engine.last_run
    events = run.events + run.comm_events  # computes, and the communication lane
    measured, simulated = measure_step(
        events, trainer.comm, trainer.mesh["pp"], lay.schedule, lay.microbatches, lay.virtual_stages
    )
    if trainer.mesh.rank == 0:
        write_timeline(measured, simulated, out_dir)
