"""The pipeline loop's mechanics: no host sync inside it, receive buffers reused."""

from __future__ import annotations

import pytest

from harness import tiny_config
from tetrad.testing import spawn

pytestmark = pytest.mark.distributed

# Python-visible ways a tensor's value reaches the host (each one a device sync on a GPU)
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def _worker(rank: int, world: int, raw: dict) -> dict:
    import torch

    from harness import trainer_for
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(raw), rank)
    runtime = trainer.engine.runner
    calls: list[str] = []
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
        try:
            return run(*args)
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)

    runtime.run = watched
    allocated = []
    for _ in range(3):
        trainer.train_step()
        allocated.append(runtime.allocated)
    receives = sum(
        len([a for a in item.ops if a.kind.startswith("RECV")])
        for item in runtime.items
        if type(item).__name__ == "Post"
    )
    return {"syncs": calls, "allocated": allocated, "receives": receives}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_schedule_loop_has_no_host_sync_and_reuses_buffers(schedule):
    par = {"pp": 2, "pp_schedule": schedule, "microbatches": 8}
    cfg = tiny_config(model={"layers": 4}, train={"global_batch": 8}, parallel=par)
    for rank, out in enumerate(spawn(_worker, 2, cfg.to_dict(), timeout=220)):
        assert out["syncs"] == [], f"rank {rank}: host syncs in the loop: {out['syncs']}"
        first, *later = out["allocated"]
        assert all(n == first for n in later), out["allocated"]  # no new buffer after step 1
        assert 0 < first < out["receives"], (first, out["receives"])  # reused within a step
