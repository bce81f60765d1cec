"""The pipeline loop's mechanics: no host sync inside it, receive buffers reused, and the
activation meter's hooks only on the steps that count."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, tiny_config

pytestmark = pytest.mark.distributed

# Python-visible ways a tensor's value reaches the host (each one a device sync on a GPU)
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
# ...and the ways the host waits for the device directly
CUDA_WAITS = ("synchronize", "current_stream", "default_stream", "Stream")


class FakeEvent:
    """Stands in for torch.cuda.Event on CPU, so the runtime's clock takes its GPU path:
    recording is free, any wait for one (or reading a time, which needs it done) counts."""

    log = None  # log(name): set by _gpu_clock

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self, stream=None) -> None:
        import time

        self.t = time.time()

    def query(self) -> bool:
        FakeEvent.log("Event.query")
        return True

    def synchronize(self) -> None:
        FakeEvent.log("Event.synchronize")

    def wait(self, stream=None) -> None:
        FakeEvent.log("Event.wait")

    def elapsed_time(self, end) -> float:
        FakeEvent.log("Event.elapsed_time")
        return (end.t - self.t) * 1e3


def _gpu_clock(runtime, log) -> None:
    """Give the runtime a GPU-mode clock on fake events; every CUDA wait from here on is
    passed to `log(name)`."""
    import torch

    from tetrad.devices import Clock

    torch.cuda.Event, FakeEvent.log = FakeEvent, log
    for name in CUDA_WAITS:
        setattr(torch.cuda, name, lambda *a, _n=name, **k: log(f"cuda.{_n}"))
    runtime.clock = Clock(torch.device("cuda", 0))


def _worker(rank: int, world: int, raw: dict) -> dict:
    import torch

    from harness import trainer_for
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(raw), rank)
    runtime = trainer.engine.runner
    calls: list[str] = []  # host waits inside the schedule loop
    outside: list[str] = []  # CUDA waits elsewhere (the clock's making, reading its times)
    looping = [False]
    _gpu_clock(runtime, lambda name: (calls if looping[0] else outside).append(name))
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name):
        def call(self, *args, **kwargs):
            calls.append(name)
            return originals[name](self, *args, **kwargs)

        return call

    run = runtime.run

    def watched(*args):  # only the schedule loop itself is watched
        for name in SYNCS:
            setattr(torch.Tensor, name, counting(name))
        looping[0] = True
        try:
            return run(*args)
        finally:
            looping[0] = False
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)

    runtime.run = watched
    allocated, marks = [], []
    for _ in range(3):
        trainer.train_step()
        allocated.append(runtime.allocated)
        marks.append(sum(isinstance(m[3], FakeEvent) for m in trainer.engine.last_run.marks))
    before = len(outside)
    times = trainer.engine.last_run.events  # read after the step, as the timeline does
    receives = sum(
        len([a for a in item.ops if a.kind.startswith("RECV")])
        for item in runtime.items
        if type(item).__name__ == "Post"
    )
    return {
        "syncs": calls,
        "allocated": allocated,
        "receives": receives,
        "marks": marks,
        "computes": len(times),
        "read": len(outside) - before,
    }


SYNC_SCHEDULES = ["1f1b", "zb-h1"]
METER_SCHEDULES = ["1f1b", "zb-h1", "zb-v", "dp"]


def _sync_config(schedule: str):
    par = {"pp": 2, "pp_schedule": schedule, "microbatches": 8}
    return tiny_config(model={"layers": 4}, train={"global_batch": 8}, parallel=par)


def _meter_config(schedule: str):
    v = 2 if schedule == "zb-v" else 1
    par = {"pp": 2, "pp_schedule": schedule, "microbatches": 4, "virtual_stages": v}
    if schedule == "dp":
        par = {"dp": 2, "microbatches": 2}
    return tiny_config(model={"layers": 4}, train={"global_batch": 8}, parallel=par)


def declare_jobs(jobs: Jobs) -> None:
    """The loop's and the meter's runs, 2 ranks each."""
    for schedule in SYNC_SCHEDULES:
        jobs.add(f"sync-{schedule}", 2, _worker, _sync_config(schedule).to_dict())
    for schedule in METER_SCHEDULES:
        jobs.add(f"meter-{schedule}", 2, _meter_worker, _meter_config(schedule).to_dict())


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES)
def test_schedule_loop_has_no_host_sync_and_reuses_buffers(jobs, schedule):
    for rank, out in enumerate(jobs[f"sync-{schedule}"]):
        assert out["syncs"] == [], f"rank {rank}: host syncs in the loop: {out['syncs']}"
        # the loop did take GPU timings (an event per compute) and waits only when read
        assert out["marks"] == [out["computes"]] * 3 and out["computes"] > 0, out
        assert out["read"] > 0
        first, *later = out["allocated"]
        assert all(n == first for n in later), out["allocated"]  # no new buffer after step 1
        assert 0 < first < out["receives"], (first, out["receives"])  # reused within a step


def _meter_worker(rank: int, world: int, raw: dict) -> dict:
    import torch

    from harness import trainer_for
    from tetrad.config import from_dict

    out: dict = {}
    for every in (0, 1):  # the same run, counting saved tensors on step 0 only, or always
        cfg = from_dict(raw)
        cfg.train.meter_every = every
        trainer = trainer_for(cfg, rank)
        runtime, meter = trainer.engine.runner, trainer.engine.runner.meter
        packs, freed = [0], [0]
        pack = meter._pack
        frees = getattr(runtime, "_frees", None)  # the pipeline's; the plain loop sends nothing

        def counted(t, pack=pack, packs=packs):
            packs[-1] += 1
            return pack(t)

        def freeing(s, t, frees=frees, freed=freed):
            done = frees(s, t)
            freed[-1] += done
            return done

        meter._pack = counted
        if frees is not None:
            runtime._frees = freeing
        losses, peaks = [], []
        for _ in range(4):
            losses.append(trainer.train_step().loss)
            peaks.append(trainer.engine.last_run.peak_activation_bytes)
            packs.append(0)
            freed.append(0)
        state = trainer.engine.full_state_dict()
        out[every] = {
            "losses": losses,
            "peaks": peaks,
            "packs": packs[:-1],
            "freed": freed[:-1],
            "pooled": getattr(runtime, "allocated", 0),
            "weights": {k: v.clone() for k, v in state.items()} if rank == 0 else None,
        }
        del trainer
        torch.distributed.barrier()
    return out


@pytest.mark.parametrize("schedule", METER_SCHEDULES)
def test_meter_counts_only_its_steps_and_changes_nothing(jobs, schedule):
    """With meter_every=0 the saved-tensor hooks run on the first step only; the steps
    after it free sent outputs and pool receive buffers by what that step learned, and
    compute bit for bit what a run counting every step computes (and the plain loop, dp)."""
    ranks = jobs[f"meter-{schedule}"]
    for rank, out in enumerate(ranks):
        once, always = out[0], out[1]
        assert once["packs"][0] > 0 and once["packs"][1:] == [0, 0, 0], once["packs"]
        assert all(n == always["packs"][0] > 0 for n in always["packs"]), always["packs"]
        assert once["losses"] == always["losses"], (rank, once["losses"], always["losses"])
        assert once["peaks"] == always["peaks"] == [always["peaks"][0]] * 4
        assert once["freed"] == always["freed"], (once["freed"], always["freed"])
        assert once["pooled"] == always["pooled"]
        if rank == 0:
            for k, w in always["weights"].items():
                assert torch.equal(once["weights"][k], w), k
    # sent outputs are freed on the steps that count nothing, too
    freed = [out[0]["freed"] for out in ranks]
    assert schedule == "dp" or any(n > 0 for f in freed for n in f[1:]), freed
