"""The collective watchdog names a call that outlives its timeout, and only such a call;
on a timeout every rank's ledger of recent collectives is dumped and the rank that is
behind is named; every process group gets the job's timeout; NCCL's settings for hangs
are made before the group exists."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import Jobs, tiny_config
from tetrad.comm import Comm
from tetrad.comm.ledger import Ledger
from tetrad.comm.watchdog import Watchdog, nccl_environment
from tetrad.errors import REPORT_DIR, read_traces, traces_written, who_is_behind
from tetrad.layout import Layout
from tetrad.mesh import Group
from tetrad.train.loop import init_distributed

TIMEOUT_S = 0.5  # the skipped collective's: the test waits about this long, not more


def test_a_stuck_call_is_named_and_a_quick_one_is_not():
    fired: list[str] = []
    dog = Watchdog(0.4, on_stuck=fired.append)
    ledger = Ledger()
    try:
        dog.arm(ledger.issue("all_reduce", Group("data", [0, 1], 0), 8))
        dog.disarm()  # completed in time
        time.sleep(0.8)
        assert fired == []
        dog.arm(ledger.issue("all_gather", Group("fsdp", [2, 3], 1), 8))
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.close()
    (message,) = fired
    assert "all_gather over fsdp (ranks [2, 3]) did not complete within 0.4 s" in message


def _trace(rank: int, seqs: dict[str, int], waiting: tuple[str, str, int] | None) -> dict:
    groups = {"data": [0, 1, 2], "tp": [rank]}
    recent = [{"op": "all_reduce", "group": g, "seq": s} for g, s in seqs.items()]
    wait = dict(zip(("op", "group", "seq"), waiting, strict=True)) if waiting else None
    return {
        "rank": rank,
        "groups": {g: {"ranks": groups[g], "seq": s} for g, s in seqs.items()},
        "recent": recent,
        "waiting": wait,
    }


def test_the_rank_whose_number_lags_is_named_with_the_op_the_others_wait_in():
    traces = [
        _trace(0, {"data": 7, "tp": 3}, ("reduce_scatter", "data", 7)),
        _trace(1, {"data": 6, "tp": 3}, None),  # skipped #7: busy elsewhere
        _trace(2, {"data": 7, "tp": 3}, ("reduce_scatter", "data", 7)),
    ]
    line = who_is_behind(traces)
    assert "behind on data (ranks [0, 1, 2]): rank 1 at #6" in line
    assert "ranks [0, 2] wait in reduce_scatter #7 over data" in line
    # on NCCL the others may have enqueued more: they wait in the first the laggard lacks
    ahead = [{**traces[0], "waiting": None}, traces[1], {**traces[2], "waiting": None}]
    for t in (ahead[0], ahead[2]):
        t["groups"] = {**t["groups"], "data": {"ranks": [0, 1, 2], "seq": 9}}
        t["recent"] = [{"op": op, "group": "data", "seq": k} for k, op in
                       ((7, "all_gather"), (8, "reduce_scatter"), (9, "all_reduce"))]  # fmt: skip
    assert "ranks [0, 2] wait in all_gather #7 over data" in who_is_behind(ahead)
    # a rank that left no trace (dead) is named too
    assert "rank(s) [1] left no trace" in who_is_behind([traces[0], traces[2]])
    # everyone reached the collective: nobody is behind, the device or shapes are suspect
    even = [_trace(r, {"data": 7}, ("all_gather", "data", 7)) for r in range(3)]
    assert who_is_behind(even).startswith("no rank is behind")
    assert who_is_behind([]) is None


def test_nccl_settings_are_made_where_unset_and_the_users_kept(tmp_path):
    env = {REPORT_DIR: str(tmp_path), "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    made = nccl_environment(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and "TORCH_NCCL_DUMP_ON_TIMEOUT" not in made
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(
        str(tmp_path / "nccl-flight-attempt000")
    )


def _skip_one(rank: int, world: int, report_dir: str) -> dict:
    """Rank 1 skips the second all-reduce until every rank's trace is written: rank 0
    waits in it past the timeout, its watchdog fires and asks for the traces."""
    os.environ[REPORT_DIR] = report_dir
    fired: list[str] = []
    dog = Watchdog(TIMEOUT_S, on_stuck=fired.append)
    try:
        comm = Comm("cpu", dog)
        world_group = Group("world", list(range(world)), rank, dist.group.WORLD)
        t = torch.ones(4)
        comm.all_reduce(t, world_group)
        start = time.monotonic()
        if rank == 1:  # the skipped collective: issued only once the dump is done
            while traces_written() < world and time.monotonic() - start < 60:
                time.sleep(0.02)
        comm.all_reduce(t, world_group)
        return {"fired": fired, "waited_s": time.monotonic() - start}
    finally:
        dog.close()
        del os.environ[REPORT_DIR]


def _group_timeouts(rank: int, world: int, cfg_dict: dict) -> dict[str, float]:
    """Each of this rank's process groups' timeout, after `init_distributed` (but the
    world's, which the spawn made)."""
    from tetrad.config import from_dict

    cfg = from_dict(cfg_dict)
    mesh, _ = init_distributed(cfg, Layout.build(cfg, world), timeout_s=123.0)
    out = {}
    for name, group in mesh.groups.items():
        if group.pg is not None and group.pg is not dist.group.WORLD:
            backend = group.pg._get_backend(torch.device("cpu"))
            out[name] = backend.options._timeout.total_seconds()
    return out


TIMEOUT_CFG = tiny_config(parallel={"pp": 2, "microbatches": 2})  # pp_ends: a new group


def declare_jobs(jobs: Jobs) -> None:
    jobs.add("skip", 2, _skip_one, str(jobs.tmp("skip")))
    jobs.add("timeouts", 2, _group_timeouts, TIMEOUT_CFG.to_dict())


@pytest.mark.distributed
def test_a_skipped_collective_names_the_rank_behind_within_the_timeout(jobs):
    zero, one = jobs["skip"]
    (message,) = zero["fired"]
    assert "rank 0: all_reduce over world (ranks [0, 1]) did not complete within 0.5 s" in message
    assert one["fired"] == []  # rank 1 never waited in a collective
    traces = read_traces(jobs.tmp("skip"))
    assert [t["rank"] for t in traces] == [0, 1]
    line = who_is_behind(traces)
    assert "rank 1 at #1; ranks [0] wait in all_reduce #2 over world" in line, line
    # named within the timeout and the watchdog's poll, not the process group's timeout
    assert zero["waited_s"] < TIMEOUT_S + 10


@pytest.mark.distributed
def test_every_new_group_gets_the_jobs_timeout(jobs):
    for rank_timeouts in jobs["timeouts"]:
        assert rank_timeouts == {"pp_ends": 123.0}


def test_the_nccl_flight_recorder_lands_in_the_trace_as_json(monkeypatch, tmp_path):
    """By reading torch: on NCCL the dump function returns bytes of JSON (its name differs
    across versions); the trace parses it. Here the process group is faked."""
    import json

    from tetrad.comm import watchdog

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    c10d = torch._C._distributed_c10d
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        monkeypatch.delattr(c10d, name, raising=False)
    assert watchdog.nccl_flight_record() is None  # no dump in this torch: nothing, no error
    fake = lambda includeCollectives, onlyActive: b'{"entries": [{"collective_seq_id": 5}]}'  # noqa: E731
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", fake, raising=False)
    monkeypatch.setenv(REPORT_DIR, str(tmp_path))
    dog = Watchdog(10.0, on_stuck=lambda m: None)
    try:
        dog.trace(None)
    finally:
        dog.close()
    (trace,) = read_traces(tmp_path)
    assert trace["nccl_flight_recorder"] == {"entries": [{"collective_seq_id": 5}]}
    assert json.dumps(trace)
