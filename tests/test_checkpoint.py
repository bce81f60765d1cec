"""Checkpoints: an interrupted run resumes exactly, in any layout; files are verified and
commits atomic; the manifest describes everything.

The oracle is the single-process 20-step run: 10 steps, a checkpoint, then the last 10
steps in another process set (and often another layout) must give its losses, gradient
norms and final weights. Multi-process jobs share one spawn, one after the other.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil

import pytest
import torch

from harness import EXACT, Jobs, assert_close_run, tiny_config, trainer_for
from tetrad.layout import Layout
from tetrad.train import checkpoint

SHARD0 = "rank-00000.safetensors"


def _jobs(rank: int, world: int, jobs: list[tuple[dict, int | None]]) -> list[dict]:
    """Per (config, stop): build a trainer, resume (if configured), train to `stop`."""
    asked: list = []  # (key, box) this rank read from a checkpoint
    read = checkpoint.SliceReader.__call__
    checkpoint.SliceReader.__call__ = lambda self, k, b: asked.append((k, b)) or read(self, k, b)
    try:
        return [_job(rank, raw, stop, asked) for raw, stop in jobs]
    finally:  # the ranks may go on to other modules' jobs
        checkpoint.SliceReader.__call__ = read


def _job(rank: int, raw: dict, stop: int | None, asked: list) -> dict:
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(raw), rank)
    asked.clear()
    start = trainer.resume()
    rows = trainer.fit(stop=stop)
    state = trainer.engine.full_state_dict()
    return {
        "start": start,
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "state": state if rank == 0 else None,
        "asked": list(asked),
    }


def _cfg(out, parallel=None, every=0, resume=False, keep=2, async_save=False):
    ck = {"every": every, "resume": resume, "keep": keep, "async_save": async_save}
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


def test_async_save_resumes_exactly(reference, tmp_path):
    """Checkpoints written in the background (every 3 steps: saves overlap training and
    each other's commits) resume to the straight run."""
    out = tmp_path / "run"
    (first,) = _jobs(0, 1, [(_cfg(out, every=3, async_save=True, keep=10), 10)])
    names = [p.name for p in checkpoint.committed(out / "checkpoints")]
    assert names == [f"step_{s:08d}" for s in (3, 6, 9)]
    shutil.rmtree(out / "checkpoints" / "step_00000009")
    (got,) = _jobs(0, 1, [(_cfg(out, every=3, resume=True, async_save=True), None)])
    assert got["start"] == 6
    assert_close_run(got, _tail(reference(), 6))


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


RESUMES = [
    {"tp": 2},
    {"pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
    {"fsdp": 2, "zero_stage": 3},
    {"fsdp": 2, "zero_stage": 1},
    {"cp": 2},
]
TIED_PARALLEL = {"fsdp": 2, "zero_stage": 3, "pp": 2, "pp_schedule": "zb-h1", "microbatches": 2}


def _tied_cfg(out, par, **ck):
    ck = {"every": 0, "resume": False, "keep": 2} | ck
    model = {"tie_embeddings": True}
    return tiny_config(train={"out": str(out)}, parallel=par, model=model,
                       checkpoint=ck).to_dict()  # fmt: skip


def declare_jobs(jobs: Jobs) -> None:
    """Saves and resumes across layouts (2 ranks, in directories of their own), and the
    tied embedding under ZeRO-3 x pp (4 ranks)."""
    root = jobs.tmp("resharding")
    dp_dir, zero_dir, tp_dir, cp_dir = (root / d for d in ("dp", "zero", "tp", "cp"))
    runs = [(_cfg(dp_dir, {"dp": 2}, every=10), 10)]
    runs += [(_cfg(dp_dir, par, resume=True), None) for par in RESUMES]
    # ZeRO-3's save is asynchronous (the resumed run checks what the background wrote)
    runs += [(_cfg(zero_dir, {"fsdp": 2, "zero_stage": 3}, every=10, async_save=True), 10)]
    runs += [(_cfg(tp_dir, {"tp": 2}, every=10), 10)]
    runs += [(_cfg(cp_dir, {"cp": 2, "cp_attention": "ring"}, every=10), 10)]
    jobs.add("resharding", 2, _jobs, runs)
    tied = jobs.tmp("tied")
    runs = [(_tied_cfg(tied, TIED_PARALLEL, every=10), 10)]
    runs += [(_tied_cfg(tied, TIED_PARALLEL, resume=True), None)]
    jobs.add("tied", 4, _jobs, runs)


@pytest.mark.distributed
def test_resharding_across_layouts(reference, jobs):
    """Saved under dp=2 and resumed under tp=2, pp=2 (1f1b), fsdp=2 zero-3 and zero-1 and
    cp=2; saved under fsdp=2 zero-3, under tp=2 and under cp=2, resumed on one process."""
    by_rank = jobs["resharding"]
    root = jobs.tmp("resharding")
    dp_dir, zero_dir, tp_dir, cp_dir = (root / d for d in ("dp", "zero", "tp", "cp"))
    resumes = RESUMES
    results = by_rank[0]
    ref = reference()
    for par, got in zip(resumes, results[1 : 1 + len(resumes)]):
        assert got["start"] == 10, par
        try:
            assert_close_run(got, _tail(ref, 10))
        except AssertionError as e:
            raise AssertionError(f"resumed under {par}: {e}") from None
    for saved in (zero_dir, tp_dir, cp_dir):
        (got,) = _jobs(0, 1, [(_cfg(saved, resume=True), None)])
        assert got["start"] == 10, saved
        assert_close_run(got, _tail(ref, 10))
    _check_sharded_files(dp_dir, zero_dir, tp_dir)
    step = "checkpoints/step_00000010"  # cp ranks hold the same parameters: one writer
    assert sorted(p.name for p in (cp_dir / step).glob("*.safetensors")) == [SHARD0]
    _check_reads_only_own_boxes([r[3]["asked"] for r in by_rank])  # zero-3 from dp's files


@pytest.mark.distributed
def test_zero_with_an_embedding_tied_across_stages_resumes(reference, jobs):
    """ZeRO-3 x pp 2 with zb-h1 and the embedding tied to the head across the two stages
    (each stage holds a copy; their gradients are summed): saved at step 10, resumed in
    the same layout and on one process, both reproduce the single process's last 10
    steps, and the checkpoint holds the tied weight once."""
    out = jobs.tmp("tied")
    saved, resumed = jobs["tied"][0]
    (single,) = _jobs(0, 1, [(_tied_cfg(out, {"microbatches": 2}, resume=True), None)])
    ref = reference(model={"tie_embeddings": True}, parallel={"microbatches": 2})
    torch.testing.assert_close(saved["losses"], ref["losses"][:10], rtol=EXACT, atol=0)
    for got in (resumed, single):
        assert got["start"] == 10
        assert_close_run(got, _tail(ref, 10))
    manifest = json.loads((out / "checkpoints/step_00000010/manifest.json").read_text())
    assert "output.weight" not in manifest["tensors"]  # the head is the embedding


def _check_sharded_files(dp_dir, zero_dir, tp_dir) -> None:
    """Each rank wrote only what it owns: dp's replica nothing, ZeRO and TP half each."""
    step = "checkpoints/step_00000010"
    files = lambda d: sorted(p.name for p in (d / step).glob("*.safetensors"))  # noqa: E731
    assert files(dp_dir) == [SHARD0]
    assert files(zero_dir) == files(tp_dir) == [SHARD0, "rank-00001.safetensors"]
    whole = (dp_dir / step / SHARD0).stat().st_size
    for d in (zero_dir, tp_dir):
        sizes = [(d / step / f).stat().st_size for f in files(d)]
        assert sum(sizes) < 1.05 * whole  # one copy of the state in all, not one per rank
        assert max(sizes) < 0.75 * whole
    tp = json.loads((tp_dir / step / "manifest.json").read_text())["tensors"]
    wq = tp["layers.0.attention.wq.weight"]["slices"]
    assert sorted(p["box"][0] for p in wq) == [[0, 16], [16, 32]]  # rows split over tp
    assert len(tp["norm.weight"]["slices"]) == 1  # replicated on tp: written once


def _check_reads_only_own_boxes(asked_by_rank) -> None:
    """ZeRO-3 over 2 ranks resuming from whole tensors: each rank asked for its half of the
    state and never for all of a tensor it does not own."""
    cfg = tiny_config()
    from tetrad.models.init import full_shape
    from tetrad.parallel.boxes import box_numel

    total = {}
    for asked in asked_by_rank:
        assert asked
        for key, box in asked:
            total[key] = total.get(key, 0) + box_numel(box)
    for key, n in total.items():  # the two ranks' boxes tile each tensor exactly once
        assert n == math.prod(full_shape(key.rsplit("/", 1)[-1], cfg.model)), key


def _flip_last_byte(file) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


def test_corrupt_newest_is_skipped_with_one_warning(reference, interrupted, tmp_path, capsys):
    """A flipped byte in the newest checkpoint: resume from the previous one, exactly, after
    one warning naming the file and the reason."""
    out = tmp_path / "run"
    shutil.copytree(interrupted[0], out)
    _flip_last_byte(out / "checkpoints" / "step_00000010" / SHARD0)
    (got,) = _jobs(0, 1, [(_cfg(out, resume=True), None)])
    assert got["start"] == 5
    assert_close_run(got, _tail(reference(), 5))
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert "step_00000010" in warnings[0] and SHARD0 in warnings[0]
    assert "sha256" in warnings[0]


def test_all_corrupt_fails_naming_the_files(interrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(interrupted[0], out)
    _flip_last_byte(out / "checkpoints" / "step_00000010" / SHARD0)
    (out / "checkpoints" / "step_00000005" / SHARD0).unlink()
    with pytest.raises(ValueError, match="no valid checkpoint") as e:
        _jobs(0, 1, [(_cfg(out, resume=True), None)])
    assert f"step_00000010/{SHARD0} is corrupt" in str(e.value)
    assert f"step_00000005/{SHARD0} is missing" in str(e.value)


def test_partial_checkpoints_are_ignored(interrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(interrupted[0], out)
    root = out / "checkpoints"
    # a directory without a manifest, and a save cut short in its temporary directory
    (root / "step_00000015").mkdir()
    shutil.copy(root / "step_00000010" / SHARD0, root / "step_00000015")
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
        logical = name.split("/", 1)[-1]
        assert entry["shape"] == list(full_shape(logical, cfg.model)), name
        assert entry["dtype"] == "float64"  # the masters' dtype: the test model is fp64
        # one process: every tensor whole, in rank 0's file
        (piece,) = entry["slices"]
        assert piece["file"] == "rank-00000.safetensors"
        assert piece["box"] == [[0, n] for n in entry["shape"]]
    kinds = {n.split("/")[0] for n in manifest["tensors"] if "/" in n}
    assert kinds == {"exp_avg", "exp_avg_sq"}
    assert "layers.1.feed_forward.w2.weight" in manifest["tensors"]
    for fname, entry in manifest["files"].items():
        assert entry["sha256"] == hashlib.sha256((path / fname).read_bytes()).hexdigest()
    assert manifest["training"]["step"] == 10
    assert manifest["training"]["optimizer_step"] == 10
    assert manifest["data"] == {"step": 10}
    assert manifest["rng"]["seed"] == 0
    assert manifest["placement"]["kind"] == "sharded"


@pytest.mark.parametrize("key,value", [("every", -1), ("keep", 0)])
def test_checkpoint_config_is_validated(key, value):
    cfg = tiny_config(checkpoint={key: value})
    with pytest.raises(ValueError, match=f"checkpoint.{key}"):
        Layout.build(cfg)


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


def _as_version_1(src, dst) -> None:
    """`src` (a one-process checkpoint) written as version 1 wrote it: every tensor whole
    under its own name, the model's in model.safetensors, AdamW's (and its count, a tensor
    "step") in optim.safetensors."""
    from safetensors.torch import load_file, save_file

    manifest = json.loads((src / "manifest.json").read_text())
    pieces = {}
    for fname in manifest["files"]:
        pieces |= {(fname, k): t for k, t in load_file(src / fname).items()}
    whole = {n: pieces[(e["slices"][0]["file"], e["slices"][0]["key"])]
             for n, e in manifest["tensors"].items()}  # fmt: skip
    files = {"model.safetensors": {n: t for n, t in whole.items() if "/" not in n}}
    files["optim.safetensors"] = {n: t for n, t in whole.items() if "/" in n}
    files["optim.safetensors"]["step"] = torch.tensor(float(manifest["training"]["step"]))
    dst.mkdir()
    tensors, manifest["files"] = {}, {}
    for fname, group in files.items():
        save_file(group, dst / fname)
        data = (dst / fname).read_bytes()
        manifest["files"][fname] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        tensors |= {n: {"shape": list(t.shape), "dtype": manifest["tensors"].get(n, {}).get(
            "dtype", "float32"), "file": fname} for n, t in group.items()}  # fmt: skip
    manifest |= {"version": 1, "tensors": tensors}
    (dst / "manifest.json").write_text(json.dumps(manifest))


def test_version_1_checkpoints_are_still_read(interrupted, tmp_path):
    """docs/checkpoint.md: a consolidated version-1 checkpoint reads as the same tensors,
    each one whole box, its "step" tensor left out (the count is in "training")."""
    new = checkpoint.read(interrupted[0] / "checkpoints" / "step_00000010")
    _as_version_1(new.path, tmp_path / "v1")
    old = checkpoint.read(tmp_path / "v1")
    assert set(old.tensors) == set(new.tensors) and "step" not in old.tensors
    for kind in ("model", "optim"):
        want, got = getattr(new, kind), getattr(old, kind)
        assert want.keys() == got.keys() and want
        for name, t in want.items():
            assert torch.equal(got[name], t), name
