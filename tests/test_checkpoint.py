"""Checkpoints: an interrupted run resumes exactly, in any layout; files are verified and
commits atomic; the manifest describes everything.

The oracle is the single-process 20-step run: 10 steps, a checkpoint, then the last 10
steps in another process set (and often another layout) must give its losses, gradient
norms and final weights. Multi-process jobs share one spawn, one after the other.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from harness import assert_close_run, tiny_config, trainer_for
from tetrad.config import validate
from tetrad.testing import spawn
from tetrad.train import checkpoint


def _jobs(rank: int, world: int, jobs: list[tuple[dict, int | None]]) -> list[dict]:
    """Per (config, stop): build a trainer, resume (if configured), train to `stop`."""
    from tetrad.config import from_dict

    out = []
    for raw, stop in jobs:
        trainer = trainer_for(from_dict(raw), rank)
        start = trainer.resume()
        rows = trainer.fit(stop=stop)
        state = trainer.engine.full_state_dict()
        out.append(
            {
                "start": start,
                "losses": [r["loss"] for r in rows],
                "grad_norms": [r["grad_norm"] for r in rows],
                "state": state if rank == 0 else None,
            }
        )
    return out


def _cfg(out, parallel=None, every=0, resume=False, keep=2):
    ck = {"every": every, "resume": resume, "keep": keep}
    return tiny_config(train={"out": str(out)}, parallel=parallel or {}, checkpoint=ck).to_dict()


def _tail(ref: dict, start: int) -> dict:
    return {**ref, "losses": ref["losses"][start:], "grad_norms": ref["grad_norms"][start:]}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A single-process run of the 20-step config stopped after 10, checkpoints at 5, 10."""
    out = tmp_path_factory.mktemp("interrupted")
    (first,) = _jobs(0, 1, [(_cfg(out, every=5), 10)])
    return out, first


def test_resume_reproduces_the_straight_run(reference, interrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(interrupted[0], out)
    ref = reference()
    torch.testing.assert_close(
        torch.tensor(interrupted[1]["losses"]), torch.tensor(ref["losses"][:10]), rtol=0, atol=0
    )
    (got,) = _jobs(0, 1, [(_cfg(out, every=5, resume=True), None)])
    assert got["start"] == 10
    assert_close_run(got, _tail(ref, 10))
    # the resumed run kept checkpointing; keep=2 left the newest two
    names = [p.name for p in checkpoint.committed(out / "checkpoints")]
    assert names == ["step_00000015", "step_00000020"]


def test_adam_state_is_restored_not_restarted(interrupted):
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(_cfg(interrupted[0], resume=True)), 0)
    assert trainer.resume() == 10
    ckpt = checkpoint.read(interrupted[0] / "checkpoints" / "step_00000010")
    for name, p in trainer.engine.named_parameters():
        state = trainer.optimizer.state[p]
        assert int(state["step"]) == 10
        assert torch.equal(state["exp_avg"], ckpt.optim[f"exp_avg/{name}"])
        assert torch.equal(state["exp_avg_sq"], ckpt.optim[f"exp_avg_sq/{name}"])
        assert float(state["exp_avg_sq"].abs().sum()) > 0
    assert trainer.loader.state_dict() == {"step": 10}


@pytest.mark.distributed
def test_resharding_across_layouts(reference, tmp_path):
    """Saved under dp=2 and resumed under tp=2, pp=2 (1f1b), fsdp=2 zero-3 and zero-1;
    saved under fsdp=2 zero-3 and under tp=2, resumed on one process."""
    dp_dir, zero_dir, tp_dir = tmp_path / "dp", tmp_path / "zero", tmp_path / "tp"
    resumes = [
        {"tp": 2},
        {"pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
        {"fsdp": 2, "zero_stage": 3},
        {"fsdp": 2, "zero_stage": 1},
    ]
    jobs = [(_cfg(dp_dir, {"dp": 2}, every=10), 10)]
    jobs += [(_cfg(dp_dir, par, resume=True), None) for par in resumes]
    jobs += [(_cfg(zero_dir, {"fsdp": 2, "zero_stage": 3}, every=10), 10)]
    jobs += [(_cfg(tp_dir, {"tp": 2}, every=10), 10)]
    results = spawn(_jobs, 2, jobs, timeout=300)[0]
    ref = reference()
    for par, got in zip(resumes, results[1 : 1 + len(resumes)]):
        assert got["start"] == 10, par
        try:
            assert_close_run(got, _tail(ref, 10))
        except AssertionError as e:
            raise AssertionError(f"resumed under {par}: {e}") from None
    for saved in (zero_dir, tp_dir):
        (got,) = _jobs(0, 1, [(_cfg(saved, resume=True), None)])
        assert got["start"] == 10, saved
        assert_close_run(got, _tail(ref, 10))


def test_corrupt_file_fails_naming_it(interrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(interrupted[0], out)
    file = out / "checkpoints" / "step_00000010" / "optim.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="optim.safetensors"):
        _jobs(0, 1, [(_cfg(out, resume=True), None)])


def test_partial_checkpoints_are_ignored(interrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(interrupted[0], out)
    root = out / "checkpoints"
    # a directory without a manifest, and a save cut short in its temporary directory
    (root / "step_00000015").mkdir()
    shutil.copy(root / "step_00000010" / "model.safetensors", root / "step_00000015")
    shutil.copytree(root / "step_00000010", root / ".tmp-step_00000020")
    assert [p.name for p in checkpoint.committed(root)] == ["step_00000005", "step_00000010"]
    (got,) = _jobs(0, 1, [(_cfg(out, resume=True), 12)])
    assert got["start"] == 10 and len(got["losses"]) == 2


def test_failed_save_keeps_the_committed_checkpoints(interrupted, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(interrupted[0], out)

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        _jobs(0, 1, [(_cfg(out, every=5, resume=True), 15)])
    root = out / "checkpoints"
    assert [p.name for p in checkpoint.committed(root)] == ["step_00000005", "step_00000010"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005", "step_00000010"]
    checkpoint.read(root / "step_00000010")  # still intact


def test_fresh_run_refuses_a_directory_with_checkpoints(interrupted):
    with pytest.raises(ValueError, match="--resume"):
        _jobs(0, 1, [(_cfg(interrupted[0], every=5), 1)])


def test_manifest_describes_the_checkpoint(interrupted):
    from tetrad.models.init import full_shape

    path = interrupted[0] / "checkpoints" / "step_00000010"
    manifest = json.loads((path / "manifest.json").read_text())
    cfg = tiny_config()
    for name, entry in manifest["tensors"].items():
        if name == "step":
            continue
        logical = name.split("/", 1)[-1]
        assert entry["shape"] == list(full_shape(logical, cfg.model)), name
        assert entry["dtype"] == "float32"
    kinds = {n.split("/")[0] for n in manifest["tensors"] if "/" in n}
    assert kinds == {"exp_avg", "exp_avg_sq"}
    assert "layers.1.feed_forward.w2.weight" in manifest["tensors"]
    for fname, entry in manifest["files"].items():
        assert entry["sha256"] == hashlib.sha256((path / fname).read_bytes()).hexdigest()
    assert manifest["training"]["step"] == 10
    assert manifest["training"]["optimizer_step"] == 10
    assert manifest["data"] == {"step": 10}
    assert manifest["rng"]["seed"] == 0
    assert manifest["placement"]["kind"] == "consolidated"


@pytest.mark.parametrize("key,value", [("every", -1), ("keep", 0)])
def test_checkpoint_config_is_validated(key, value):
    cfg = tiny_config(checkpoint={key: value})
    with pytest.raises(ValueError, match=f"checkpoint.{key}"):
        validate(cfg)


def test_run_appends_metrics_on_resume(tmp_path):
    """A job that died after step 17 with its last checkpoint at 15: the resumed job
    replaces the rows of steps 15.. and appends the rest, equal to the first job's."""
    import dataclasses

    from tetrad.train.run import run

    cfg = tiny_config(train={"out": str(tmp_path)}, checkpoint={"every": 5})
    first = run(cfg)
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000020")
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:18]) + '\n{"step": 18, "lo')  # cut short mid-row
    resumed = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    run(resumed)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in first], rel=1e-6)
