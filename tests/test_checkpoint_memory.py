"""In-memory checkpoints with a partner copy (train/local_checkpoint.py): training with them
on is the single-process run; a restart resumes from memory, a rank whose own copy is gone
taking it from its partner; a corrupt partner copy is skipped for the next older generation
or the durable checkpoint (saying why); a full local directory turns them off with one
warning. A partner copy never touches the compute device: it is staged, swapped and
gathered in host memory over a gloo group of its own. A generation is a step and the world
that wrote it, so a directory rewritten after a shrink cannot pass off a mixture.

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
from types import SimpleNamespace

import pytest
import torch
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


def _staging(rank: int, world: int, out: Path) -> dict:
    """A generation swapped, committed and restored by checkpoints whose compute device is
    `meta` (a partner copy staged there would fail its exchange: meta tensors hold no
    bytes); what each of their calls was handed, and the backend their group asked for."""
    trainer = trainer_for(from_dict(_cfg(out, ZERO3, local_every=0)), rank)
    trainer.fit(stop=1)
    asked, new_group = [], dist.new_group
    dist.new_group = lambda *a, **kw: asked.append(kw.get("backend")) or new_group(*a, **kw)
    try:
        fake = SimpleNamespace(device=torch.device("meta"), watchdog=None)
        local = lc.LocalCheckpoints(from_dict(_cfg(out, ZERO3)), trainer.engine, fake)
    finally:
        dist.new_group = new_group
    seen = []
    for comm in (local.swap_comm, local.host_comm):
        for op in ("batch_p2p", "broadcast", "all_reduce"):
            setattr(comm, op, _recording(op, getattr(comm, op), seen))
    local.start(1, trainer.optimizer, trainer.loader)
    row = local.finish()
    restored = local.restore(trainer.optimizer, trainer.loader)
    local.close(finished=True)
    return {"asked": asked, "seen": seen, "row": row, "restored": restored}


def _recording(op: str, call, seen: list):
    """`call`, noting for each tensor it is handed (op, device, pinned, group backend)."""

    def wrapped(*args, **kwargs):
        group = next(a for a in (*args, *kwargs.values()) if isinstance(a, lc.Group))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list) for _, t, _ in a]
        backend = dist.get_backend(group.pg)
        seen.extend((op, t.device.type, t.is_pinned(), backend) for t in tensors)
        return call(*args, **kwargs)

    return wrapped


def declare_jobs(jobs: Jobs) -> None:
    jobs.add("memory", 2, _jobs, jobs.tmp("memory"))
    jobs.add("staging", 2, _staging, jobs.tmp("staging"))


def _tail(ref: dict, start: int) -> dict:
    return {**ref, "losses": ref["losses"][start:], "grad_norms": ref["grad_norms"][start:]}


# --- pure -------------------------------------------------------------------------------------


def test_partner_is_a_node_ahead_or_on_one_node_the_next_rank():
    assert [lc.partner_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [lc.partner_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]
    assert all(lc.held_from(lc.partner_of(r, 6, 2), 6, 2) == r for r in range(6))


def _gen(step: int, world: int, *ranks: int) -> dict:
    return {"step": step, "world": world, "ranks": list(ranks)}


def test_newest_complete_generation_takes_lost_copies_from_partners():
    # 4 ranks, 2 per node: rank q's copy is on q + 2. Step 10: rank 1 lost its own copy,
    # rank 3 (its partner) holds it. Step 15: rank 1's own and partner copies both gone.
    held = [
        [_gen(10, 4, 0, 2), _gen(15, 4, 0, 2)],
        [_gen(10, 4, 3), _gen(15, 4, 3)],
        [_gen(10, 4, 2, 0), _gen(15, 4, 2, 0)],
        [_gen(10, 4, 3, 1), _gen(15, 4, 3)],
    ]
    assert lc.newest_complete(held) == (10, [0, 3, 2, 3])
    assert lc.why_not(held, 10, 11) == (
        "the newest complete in-memory checkpoint, of step 10, is older than the durable "
        "checkpoint of step 12"
    )
    two = [[_gen(5, 2, 1)], [_gen(5, 2)]]
    assert lc.newest_complete(two) == (None, [])
    assert (
        lc.why_not(two, None, -1)
        == "no in-memory checkpoint is complete (step 5 of 2 ranks lacks rank(s) 0)"
    )
    assert lc.why_not([[], []], None, -1) is None  # nothing held: nothing to explain


def _write_state(directory: Path, stem: str, rank: int, world: int, cfg) -> None:
    """Rank `rank`'s state of a world of `world` ranks (2 a node), as file `stem`."""
    info = {
        "training": {"step": int(directory.name[5:]), "config": cfg.to_dict()},
        "placement": {"saved_from": {"world": world}},
        "local_world": 2,
    }
    meta, data = lc.pack(rank, [("w", ((0, 1),), torch.full((1,), float(world)))], info)
    directory.mkdir(parents=True, exist_ok=True)
    lc.store(directory, stem, meta, data)


def test_a_step_rewritten_by_a_shrunk_world_is_not_taken_as_a_mixture(tmp_path):
    """A world of 4 (two nodes of 2) wrote steps 10 and 15; the node left, shrunk to 2
    ranks, resumed from 10 and began step 15 again in the same directory: rank 0 of world
    2 wrote its file, rank 1 had not. step_15 holds rank files of world 2 (rank-00000) and
    of world 4 (rank-00001, stale) and partner copies of world 4 (ranks 2 and 3): every
    rank number is there, but no one world's states are all there, so step 10 is taken."""
    cfg, root = tiny_config(), tmp_path
    for step in (10, 15):
        for q in range(4):  # this node's files of world 4: its ranks' own, the others' copies
            _write_state(
                root / f"step_{step:08d}", f"{'rank' if q < 2 else 'copy'}-{q:05d}", q, 4, cfg
            )
    _write_state(root / "step_00000015", "rank-00000", 0, 2, cfg)
    warned: list[str] = []
    scans = [lc.scan(root, local, 2, cfg, warned.append) for local in (0, 1)]
    assert warned == []
    held = [h for h, _ in scans]
    assert held[0] == [_gen(15, 2, 0), _gen(15, 4, 2), _gen(10, 4, 0, 2)]
    assert held[1] == [_gen(15, 4, 1, 3), _gen(10, 4, 1, 3)]
    assert lc.newest_complete(held) == (10, [0, 1, 0, 1])
    blobs = scans[0][1]
    assert lc.unpack(blobs[(15, 2, 0)])[0]["placement"]["saved_from"]["world"] == 2
    assert lc.why_not([h[:-1] for h in held], None, -1) == (
        "no in-memory checkpoint is complete (step 15 of 4 ranks lacks rank(s) 0; "
        "step 15 of 2 ranks lacks rank(s) 1)"
    )
    # once world 2's rank 1 writes too, step 15 is complete: world 2's, not a mixture
    _write_state(root / "step_00000015", "rank-00001", 1, 2, cfg)
    held = [lc.scan(root, local, 2, cfg, warned.append)[0] for local in (0, 1)]
    assert lc.newest_complete(held) == (15, [0, 1])


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
    skipped, why = got["warnings"]  # rank 0 holds rank 1's copy
    assert "copy-00001" in skipped and "sha256" in skipped
    assert why == (
        "tetrad: warning: not resuming from memory: no in-memory checkpoint is complete "
        "(step 10 of 2 ranks lacks rank(s) 1)"
    )
    assert_close_run(got, _tail(reference(), 10))


@pytest.mark.distributed
def test_partner_copies_never_stage_on_the_compute_device(jobs):
    """The compute device was `meta`: the generation still swapped, committed and restored,
    and every tensor its exchanges were handed was in host memory (pageable: over gloo
    nothing is copied to a device), on the gloo group it asked for."""
    for got in jobs["staging"]:
        assert got["asked"] == ["gloo"]
        assert got["row"]["local_checkpoint"] == 1 and got["restored"] == 1
        ops = {op for op, *_ in got["seen"]}
        assert ops == {"batch_p2p", "all_reduce", "broadcast"}
        assert {tuple(where) for _, *where in got["seen"]} == {("cpu", False, "gloo")}
