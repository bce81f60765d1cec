"""A compressed reduction's error-feedback residuals in checkpoints (train/checkpoint.py):
a run saved and resumed continues bitwise as the uninterrupted one, through dp's buckets
(both hops; resumed from the in-memory generation) and ZeRO-3's reduce-scatter (from the
durable checkpoint); without the residuals (stripped from the manifest) it does not;
resumed at another layout they start from zero, said once."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch

from harness import Jobs, tiny_config, trainer_for

pytestmark = pytest.mark.distributed

STEPS, SAVED = 6, 3
LAYOUTS = {
    "dp-int8": {"dp": 2, "reduce_dtype": "int8"},
    "zero3-fp8": {"fsdp": 2, "zero_stage": 3, "reduce_dtype": "fp8"},
}


MEMORY = "dp-int8"  # the layout whose resume reads the in-memory generation


def _cfg(out, parallel: dict, every: int = 0, resume: bool = False, memory: bool = False):
    ck = {"every": every, "resume": resume, "keep": 1}
    if memory:
        ck |= {"local_every": SAVED, "local_dir": str(out / "memory")}
    train = {"out": str(out), "dtype": "fp32", "steps": STEPS}
    return tiny_config(train=train, parallel=parallel, checkpoint=ck).to_dict()


def _run(rank: int, raw: dict, stop: int | None = None) -> dict:
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(raw), rank)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        start = trainer.resume()
    trainer.fit(stop=stop)
    state = trainer.engine.full_state_dict()
    return {"start": start, "state": state, "said": said.getvalue()}


def _strip(path) -> None:
    """A copy of the checkpoint at `path` without its residuals (rank 0), agreed."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        ck = path / "checkpoints" / f"step_{SAVED:08d}"
        copy = path.parent / "stripped" / "checkpoints" / ck.name
        shutil.copytree(ck, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["tensors"] = {k: v for k, v in manifest["tensors"].items() if "residual/" not in k}
        (copy / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()


def _worker(rank: int, world: int, root: str, name: str) -> dict:
    from pathlib import Path

    out, parallel = Path(root) / name, LAYOUTS[name]
    runs = {"whole": _run(rank, _cfg(out / "whole", parallel))}
    memory = name == MEMORY
    _run(rank, _cfg(out / "saved", parallel, every=SAVED, memory=memory), stop=SAVED)
    _strip(out / "saved")
    runs["resumed"] = _run(rank, _cfg(out / "saved", parallel, resume=True, memory=memory))
    runs["stripped"] = _run(rank, _cfg(out / "stripped", parallel, resume=True))
    other = LAYOUTS["zero3-fp8" if name == "dp-int8" else "dp-int8"]
    runs["other"] = _run(rank, _cfg(out / "saved", other, resume=True))
    return runs


def declare_jobs(jobs: Jobs) -> None:
    for name in LAYOUTS:
        jobs.add(f"ck-{name}", 2, _worker, str(jobs.tmp("compress-ck")), name)


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_resumed_run_continues_as_the_uninterrupted_one(jobs, name):
    for rank, runs in enumerate(jobs[f"ck-{name}"]):
        whole, resumed, stripped = runs["whole"], runs["resumed"], runs["stripped"]
        assert resumed["start"] == stripped["start"] == SAVED
        assert resumed["said"].count("residuals") == 0
        assert ("resumed from memory" in resumed["said"]) == (name == MEMORY and rank == 0)
        for n, w in whole["state"].items():  # bitwise, on every rank
            assert torch.equal(resumed["state"][n], w), (rank, n)
        # the residuals matter: started from zero, the same run lands elsewhere
        assert any(not torch.equal(stripped["state"][n], w) for n, w in whole["state"].items())
        said = "residuals start from zero (not in the checkpoint)"
        assert (said in stripped["said"]) == (rank == 0)


@pytest.mark.parametrize("name", LAYOUTS)
def test_another_layout_starts_the_residuals_from_zero_and_says_so(jobs, name):
    ranks = jobs[f"ck-{name}"]
    assert all(r["other"]["start"] == SAVED for r in ranks)
    said = ranks[0]["other"]["said"]
    assert "residuals start from zero (saved at {'dp': " in said and "resumed at" in said
    assert ranks[1]["other"]["said"] == ""
