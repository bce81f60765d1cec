"""In-memory checkpoints with a partner copy (train/local_checkpoint.py): training with them
on is the single-process run; a restart resumes from memory, a rank whose own copy is gone
taking it from its partner; a corrupt partner copy is skipped for the next older generation
or the durable checkpoint; a full local directory turns them off with one warning.

The oracle is the single-process 20-step run (the `reference` fixture): a run stopped at
step 12 and resumed from the generation of step 10 must give its last 10 losses and its
final weights. The 2-rank jobs share the session's spawn; the kill-and-restart test goes
through the launcher and torchrun, in tests/test_launch_survival.py (beside the
uninterrupted run it is compared with).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from harness import Jobs, assert_close_run, tiny_config, trainer_for
from tetrad.config import from_dict
from tetrad.layout import Layout
from tetrad.train import local_checkpoint as lc

ZERO3 = {"fsdp": 2, "zero_stage": 3}  # each rank owns half of every tensor


def _cfg(out: Path, parallel=None, local_every=5, every=0, resume=False) -> dict:
    ck = {"local_every": local_every, "local_dir": str(out / "shm"), "every": every}
    ck["resume"] = resume
    return tiny_config(train={"out": str(out)}, parallel=parallel or {}, checkpoint=ck).to_dict()


def _run(rank: int, raw: dict, stop: int | None = None) -> dict:
    """Build, resume (if configured) and train; what the tests compare."""
    trainer = trainer_for(from_dict(raw), rank)
    start = trainer.resume()
    rows = trainer.fit(stop=stop)
    state = trainer.engine.full_state_dict()
    return {
        "start": start,
        "resumed": trainer.resumed,
        "rows": rows,
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "state": state if rank == 0 else None,
        "warnings": trainer.local.warnings if trainer.local else [],
        "left": sorted(str(p) for p in (Path(raw["checkpoint"]["local_dir"])).rglob("*")),
    }


def _newest(out: Path) -> Path:
    return lc.generations(out / "shm")[0]


def _damage(rank: int, out: Path, drop_own: int | None, corrupt_copy_on: int | None) -> None:
    """Before a restart: `drop_own` loses its own copy of the newest generation (as if its
    node were replaced), rank `corrupt_copy_on` flips a byte of the partner copy it holds.
    A barrier: no rank looks before the damage is done."""
    gen = _newest(out)
    if rank == drop_own:
        for f in gen.glob(f"rank-{rank:05d}.*"):
            f.unlink()
    if rank == corrupt_copy_on:
        copy = gen / f"copy-{1 - rank:05d}.safetensors"  # 2 ranks: it holds the other's
        data = bytearray(copy.read_bytes())
        data[-1] ^= 0xFF
        copy.write_bytes(bytes(data))
    dist.barrier()


def _jobs(rank: int, world: int, out: Path) -> dict:
    """The 2-rank runs: straight with local checkpoints; stopped at 12 (durable and
    in-memory checkpoints at 5 and 10), then resumed twice from copies of that state: with
    rank 1's own copy lost, and with its partner copy corrupt too (durable fallback)."""
    straight = _run(rank, _cfg(out / "straight", ZERO3, local_every=3))
    lost, bad = out / "lost", out / "bad"
    first = _run(rank, _cfg(lost, ZERO3, every=5), stop=12)
    if rank == 0:
        shutil.copytree(lost, bad)
    dist.barrier()
    _damage(rank, lost, drop_own=1, corrupt_copy_on=None)
    from_partner = _run(rank, _cfg(lost, ZERO3, every=5, resume=True))
    _damage(rank, bad, drop_own=1, corrupt_copy_on=0)
    durable = _run(rank, _cfg(bad, ZERO3, every=5, resume=True))
    return {"straight": straight, "first": first, "partner": from_partner, "durable": durable}


def declare_jobs(jobs: Jobs) -> None:
    jobs.add("memory", 2, _jobs, jobs.tmp("memory"))


def _tail(ref: dict, start: int) -> dict:
    return {**ref, "losses": ref["losses"][start:], "grad_norms": ref["grad_norms"][start:]}


# --- pure -------------------------------------------------------------------------------------


def test_partner_is_a_node_ahead_or_on_one_node_the_next_rank():
    assert [lc.partner_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [lc.partner_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]
    assert all(lc.source_of(lc.partner_of(r, 6, 2), 6, 2) == r for r in range(6))


def test_newest_complete_generation_takes_lost_copies_from_partners():
    # 4 ranks, 2 per node: rank q's copy is on q + 2. Step 10: rank 1 lost its own copy,
    # rank 3 (its partner) holds it. Step 15: rank 1's own and partner copies both gone.
    def row(*ranks):
        return {"world": 4, "ranks": list(ranks)}

    held = [
        {"10": row(0, 2), "15": row(0, 2)},
        {"10": row(3), "15": row(3)},
        {"10": row(2, 0), "15": row(2, 0)},
        {"10": row(3, 1), "15": row(3)},
    ]
    assert lc.newest_complete(held) == (10, [0, 3, 2, 3])
    two = [{"5": {"world": 2, "ranks": [1]}}, {"5": {"world": 2, "ranks": []}}]
    assert lc.newest_complete(two) == (None, [])


def test_negative_k_is_refused_naming_it():
    cfg = tiny_config(checkpoint={"local_every": -2})
    with pytest.raises(ValueError, match="local_every.*got -2"):
        Layout.build(cfg, 1)  # every rank, before the first collective


# --- one process ------------------------------------------------------------------------------


def test_corrupt_partner_copy_is_skipped_for_the_older_generation(reference, tmp_path, monkeypatch):
    """Generations 3, 6, 9 kept (pruning off); 9's own copy gone and its partner copy
    corrupt: one warning, and the run resumes from 6 and matches the straight run."""
    monkeypatch.setattr(lc, "prune", lambda *a: None)
    first = _run(0, _cfg(tmp_path, local_every=3), stop=10)
    assert [r.get("local_checkpoint") for r in first["rows"]][2:9:3] == [None, 3, 6]
    _gen_9 = _newest(tmp_path)
    (_gen_9 / "rank-00000.json").unlink()
    copy = _gen_9 / "copy-00000.safetensors"
    copy.write_bytes(copy.read_bytes()[:-1] + b"\0")
    got = _run(0, _cfg(tmp_path, local_every=3, resume=True))
    (warning,) = got["warnings"]
    assert "skipping the in-memory checkpoint" in warning and "copy-00000" in warning
    assert "sha256" in warning
    assert got["start"] == 6 and got["resumed"]["resumed_from"] == "memory"
    assert_close_run(got, _tail(reference(), 6))


def test_full_local_directory_degrades_to_durable_checkpoints(tmp_path, monkeypatch, capsys):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(lc, "write_file", full)
    cfg = tiny_config(
        train={"out": str(tmp_path), "steps": 8},
        checkpoint={"local_every": 2, "local_dir": str(tmp_path / "shm"), "every": 4},
    )
    trainer = trainer_for(cfg, 0)
    rows = trainer.fit()
    assert len(rows) == 8 and not trainer.local.enabled
    assert rows[3]["local_checkpoint_failed"] == 2  # found at the next due step, 4
    warned = [x for x in capsys.readouterr().out.splitlines() if "warning" in x]
    assert len(warned) == 1, warned
    assert "no space left" in warned[0] and "durable checkpoints go on" in warned[0]
    assert (tmp_path / "checkpoints" / "step_00000008" / "manifest.json").is_file()


# --- two ranks --------------------------------------------------------------------------------


@pytest.mark.distributed
def test_local_checkpoints_leave_the_run_unchanged(reference, jobs):
    got = jobs["memory"][0]["straight"]
    assert_close_run(got, reference())
    committed = [r["local_checkpoint"] for r in got["rows"] if "local_checkpoint" in r]
    assert committed == [3, 6, 9, 12, 15]  # each at the next due step; 18 at the end
    assert all(r["local_checkpoint_sent_bytes"] > 0 for r in got["rows"][5::3])
    assert got["left"] == []  # a finished run frees its memory


@pytest.mark.distributed
def test_lost_own_copy_is_restored_from_the_partner(reference, jobs):
    by_rank = jobs["memory"]
    got = by_rank[0]["partner"]
    assert got["start"] == 10 and got["resumed"]["resumed_from"] == "memory"
    assert by_rank[1]["partner"]["start"] == 10
    assert got["warnings"] == [] and by_rank[1]["partner"]["warnings"] == []
    assert_close_run(got, _tail(reference(), 10))


@pytest.mark.distributed
def test_corrupt_partner_copy_with_no_older_generation_falls_back_to_durable(reference, jobs):
    by_rank = jobs["memory"]
    got = by_rank[0]["durable"]
    assert got["start"] == 10 and got["resumed"]["resumed_from"] == "checkpoint"
    (warning,) = got["warnings"]  # rank 0 holds rank 1's copy
    assert "copy-00001" in warning and "sha256" in warning
    assert_close_run(got, _tail(reference(), 10))
