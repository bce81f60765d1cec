"""Elastic shrink (`--nnodes MIN:MAX` with `--dp auto`): losing a node re-forms a smaller
world that resumes from the in-memory checkpoints and matches the uninterrupted run.

The rules are pure (`elastic_config`: the elastic degree and the microbatch count for a
world; refusals naming the values), and the launcher refuses a node range the layout
cannot shrink to before starting anything. The kill test runs two torchrun agents on this
machine (two `tetrad train` launches, two ranks each, one c10d rendezvous on loopback),
kills one agent's whole process tree mid-run, and reads the survivor's metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from harness import Jobs, assert_close_run, tiny_config, trainer_for
from tetrad.cli import build_config, main, parser
from tetrad.config import from_dict
from tetrad.launch import free_port
from tetrad.layout import elastic_config
from tetrad.train import local_checkpoint as lc

FAULTS = str(Path(__file__).parent / "faults")
TINY = [
    "--layers", "2", "--dim", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
    "--seq-len", "16", "--global-batch", "8", "--data", "synthetic", "--no-progress",
    "--steps", "20",
]  # fmt: skip
K = 5
NPROC = 2  # ranks per agent (node): 2 so that a node's local ranks share its files
# torchrun's rendezvous, fast for a test: a node is dead after 3 missed 1 s heartbeats, and
# a round with at least MIN nodes closes LAST_CALL_S after its first node joined: both
# agents, started together, must join the first round within it on a loaded machine (one
# that joins later grows the job, a restart this test does not expect)
LAST_CALL_S = 8
RDZV = f"join_timeout=60,last_call_timeout={LAST_CALL_S},keep_alive_interval=1,keep_alive_max_attempt=3"  # noqa: E501


# --- pure -------------------------------------------------------------------------------------


def _elastic(world: int, **parallel):
    cfg = tiny_config(parallel={"elastic": "dp", "elastic_max_world": 4} | parallel)
    return elastic_config(cfg, world).parallel


def test_elastic_degree_fills_the_world_and_keeps_the_microbatch_size():
    # global batch 8 on 4 data ranks in 1 microbatch: 2 sequences each; on 2 data ranks the
    # same 2-sequence microbatches, 2 of them per rank
    assert (_elastic(4).dp, _elastic(4).microbatches) == (4, 1)
    assert (_elastic(2).dp, _elastic(2).microbatches) == (2, 2)
    assert (_elastic(1).dp, _elastic(1).microbatches) == (1, 4)
    shrunk = _elastic(4, tp=2, elastic_max_world=8)  # tp fixed: dp = 4 / 2
    assert (shrunk.dp, shrunk.tp, shrunk.microbatches) == (2, 2, 2)
    fsdp = elastic_config(tiny_config(parallel={"elastic": "fsdp"}), 2).parallel
    assert (fsdp.dp, fsdp.fsdp) == (1, 2)


def test_a_world_below_the_fixed_degrees_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"1 ranks cannot hold the fixed degrees tp=2 = 2 .*"
                       "fewer than the layout's minimum"):  # fmt: skip
        _elastic(1, tp=2, elastic_max_world=4)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        _elastic(3, tp=2, elastic_max_world=4)


def test_a_global_batch_that_does_not_split_at_the_new_size_is_refused():
    with pytest.raises(ValueError, match="at 3 ranks the global batch 8 does not split over "
                       "3 data ranks in microbatches of 1 sequences"):  # fmt: skip
        _elastic(3, elastic_max_world=8)


def _train(*args: str) -> tuple[int, str]:
    return main(["train", *TINY, *args])


def test_launcher_refuses_a_node_range_below_the_layout_minimum(tmp_path, capsys):
    rdzv = ("--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--out", str(tmp_path))
    code = _train("--nnodes", "1:2", "--nproc", "1", "--tp", "2", "--dp", "auto",
                  "--max-restarts", "1", *rdzv)  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert code == 2
    (line,) = [x for x in err if x.startswith("tetrad: error:")]
    assert "--nnodes 1:2 --nproc 1: at 1 node(s), 1 ranks: 1 ranks cannot hold the fixed " \
           "degrees tp=2 = 2 with --dp auto: fewer than the layout's minimum" in line  # fmt: skip
    assert _train("--nnodes", "1:2", "--nproc", "1", "--max-restarts", "1", *rdzv) == 2
    assert "give one elastic degree (--dp auto or --fsdp auto)" in capsys.readouterr().err
    assert _train("--nnodes", "1:2", "--nproc", "1", "--dp", "auto", *rdzv) == 2
    assert "give --max-restarts >= 1, got 0" in capsys.readouterr().err
    assert _train("--nnodes", "1:2", "--dp", "auto", "--max-restarts", "1", *rdzv) == 2
    assert "--dp auto needs --nproc N" in capsys.readouterr().err
    assert _train("--nnodes", "2:1", "--nproc", "1", "--dp", "auto", *rdzv) == 2
    assert "need 1 <= MIN <= MAX, got MIN=2, MAX=1" in capsys.readouterr().err
    assert _train("--nproc", "1", "--dp", "auto", "--fsdp", "auto", *rdzv) == 2
    assert "one degree at most can follow the world" in capsys.readouterr().err


# --- a 2-rank ZeRO-3 world's in-memory state, resumed by one rank -----------------------------


def _shrinking(out: Path, resume: bool = False) -> dict:
    """Elastic fsdp (ZeRO-3: each rank owns half of every tensor), in memory every K steps
    and durable every 2K."""
    return tiny_config(
        train={"out": str(out)},
        parallel={"elastic": "fsdp", "zero_stage": 3, "elastic_max_world": 2},
        checkpoint={
            "local_every": K, "local_dir": str(out / "shm"), "every": 2 * K, "resume": resume,
        },
    ).to_dict()  # fmt: skip


def _stopped_at_12(rank: int, world: int, out: Path) -> list[float]:
    """The 2-rank run, stopped after step 12 (generation 10 in memory, a durable checkpoint
    at 10); a copy of its files in OUT-copy, for the fallback test."""
    trainer = trainer_for(elastic_config(from_dict(_shrinking(out)), world), rank)
    losses = [r["loss"] for r in trainer.fit(stop=12)]
    dist.barrier()  # every rank's files written
    if rank == 0:
        shutil.copytree(out, out.with_name(out.name + "-copy"))
    return losses


def declare_jobs(jobs: Jobs) -> None:
    jobs.add("shrink", 2, _stopped_at_12, jobs.tmp("shrink"))


def _resume_alone(reference, out: Path, source: str):
    """One rank resumes the 2-rank run at step 10 from `source` and matches the
    single-process run's last 10 steps: losses, norms and weights."""
    cfg = elastic_config(from_dict(_shrinking(out, resume=True)), 1)
    assert (cfg.parallel.fsdp, cfg.parallel.microbatches) == (1, 2)
    trainer = trainer_for(cfg, 0)
    assert trainer.resume() == 10 and trainer.resumed["resumed_from"] == source
    rows = trainer.fit()
    ref = reference()
    got = {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows]}
    got["state"] = trainer.engine.full_state_dict()
    tail = {**ref, "losses": ref["losses"][10:], "grad_norms": ref["grad_norms"][10:]}
    assert_close_run(got, tail)
    return trainer


@pytest.mark.distributed
def test_one_rank_resumes_a_two_rank_world_from_memory(reference, jobs):
    """Both ranks' states are in the node's directory (one node): the one rank left reads
    every box of generation 10 into its whole tensors and accumulates 2 microbatches a
    step. The durable checkpoint of the same step is there, but memory comes first."""
    assert jobs["shrink"][0] == pytest.approx(reference()["losses"][:12], rel=1e-5)
    trainer = _resume_alone(reference, jobs.tmp("shrink"), "memory")
    assert trainer.local.restored_world == 2  # generation 10 was written by 2 ranks


@pytest.mark.distributed
def test_one_rank_falls_back_to_the_durable_checkpoint_when_memory_is_incomplete(reference, jobs):
    """Rank 1's own and partner copies of generation 10 gone: no complete generation, so the
    durable checkpoint of step 10, resharded to one rank, with a warning saying why."""
    jobs["shrink"]
    out = jobs.tmp("shrink").with_name(jobs.tmp("shrink").name + "-copy")
    for f in lc.generations(out / "shm")[0].glob("*-00001.*"):
        f.unlink()
    trainer = _resume_alone(reference, out, "checkpoint")
    assert trainer.local.warnings == [
        "tetrad: warning: not resuming from memory: no in-memory checkpoint is complete "
        "(step 10 of 2 ranks lacks rank(s) 1)"
    ]


def test_a_job_that_cannot_re_form_ends_with_one_line_saying_so(tmp_path, capsys):
    """torchrun gave up waiting for MIN nodes after a failure (its log since this launch
    began names RendezvousTimeoutError): one line, the failure that started it, exit 1.
    The same words in an earlier launch's part of the log do not count."""
    from tetrad.launch import explain

    logs, reports = tmp_path / "logs", tmp_path / "logs" / "reports"
    reports.mkdir(parents=True)
    record = {"kind": "error", "message": "rank 1: RuntimeError: Connection reset by peer",
              "code": 1, "rank": 1, "attempt": 0, "time": 1.0}  # fmt: skip
    (reports / "attempt000-rank00001-error.json").write_text(json.dumps(record))
    old = "an earlier launch: RendezvousTimeoutError\n"
    (logs / "torchrun.log").write_text(old + "...\nraise RendezvousTimeoutError\n")
    assert explain(1, None, reports, logs, log_start=len(old)) == 1
    (line,) = capsys.readouterr().err.splitlines()
    want = (
        "tetrad: error: the job could not re-form: fewer nodes than --nnodes MIN rejoined "
        "the rendezvous within its join_timeout (the failure: rank 1: RuntimeError: "
        "Connection reset by peer)"
    )
    assert line.startswith(want)
    (logs / "torchrun.log").write_text(old + "...\n")
    assert explain(1, None, reports, logs, log_start=len(old)) == 1
    assert "could not re-form" not in capsys.readouterr().err


# --- two agents, one killed -------------------------------------------------------------------


def _agent(out: Path, endpoint: str, shm: Path) -> subprocess.Popen:
    """One node: a `tetrad train` launch of NPROC ranks in an elastic job of 1 to 2 nodes, its
    in-memory checkpoints in a directory of its own (each node's /dev/shm)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]))
    env["TETRAD_TEST_FAULT"] = "slow:0:0"  # 50 ms a step until the restart: time to kill
    args = ["--nnodes", "1:2", "--nproc", str(NPROC), "--dp", "auto", "--max-restarts", "1",
            "--rdzv-endpoint", endpoint, "--rdzv-conf", RDZV, "--timeout", "30",
            "--local-checkpoint-every", str(K), "--local-dir", str(shm),
            "--no-final-checkpoint", "--out", str(out)]  # fmt: skip
    cmd = [sys.executable, "-m", "tetrad.cli", "train", *TINY, *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip


def _listener(port: int) -> set[int]:
    """Socket inodes listening on `port` (IPv4 or IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                found.add(int(cols[9]))
    return found


def _hosts(pid: int, inodes: set[int]) -> bool:
    """Whether a process of `pid`'s tree holds one of the sockets `inodes`."""
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{p}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                        return True
    return False


def _tree(pid: int) -> list[int]:
    """`pid` and every process descended from it (read from /proc)."""
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted(tree)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and its descendants (deepest first), if it still runs."""
    if proc.poll() is not None:
        return
    for pid in _tree(proc.pid)[::-1]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _wait(proc: subprocess.Popen, timeout: float, out: Path) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        _, err = proc.communicate()
        log = out / "logs" / "torchrun.log"  # the agents' own account of the restart
        agents = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        raise AssertionError(
            f"the surviving node still runs after {timeout} s; its last row "
            f"{_rows(out)[-1:]}\n{err[-3000:]}\ntorchrun.log:\n{agents}"
        ) from None
    return proc.returncode, err


@pytest.mark.distributed
@pytest.mark.timeout(540)
def test_killed_node_shrinks_the_job_which_matches_the_uninterrupted_run(tmp_path):
    """Nodes A (the one hosting the rendezvous store) and B, 2 ranks each: dp = 4. B's
    whole process tree is SIGKILLed after step 12; A's agent re-forms the job alone (one
    restart), dp = 2 with 2 microbatches per rank, from the in-memory generation of step
    10 (B's ranks' states from the partner copies A holds), and ends with the
    single-process run's loss."""
    from tetrad.train.run import run

    one, out = tmp_path / "one", tmp_path / "elastic"
    run(build_config(parser().parse_args(["train", *TINY, "--out", str(one)])))
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    a, b = (_agent(out, endpoint, tmp_path / f"shm-{node}") for node in "ab")
    try:
        deadline = time.monotonic() + 180
        while len(_rows(out)) < 13:
            alive = a.poll() is None and b.poll() is None
            assert alive and time.monotonic() < deadline, (a.poll(), b.poll(), _rows(out)[-1:])
            time.sleep(0.05)
        if _hosts(b.pid, _listener(port)):  # the node that hosts the rendezvous store stays
            a, b = b, a
        _kill_tree(b)  # the node is gone: launcher, torchrun, ranks
        killed_at = time.time()
        b.communicate()
        code, err = _wait(a, 300, out)  # 15 s on an idle machine; over 180 once at load 12
        assert code == 0, err[-3000:]
    finally:
        for proc in (a, b):
            _kill_tree(proc)  # what a failed test left running

    rows, ref = _rows(out), _rows(one)
    assert [r["step"] for r in rows] == list(range(20))
    restarts = [r for r in rows if "resumed_from" in r]
    assert len(restarts) == 1, f"{restarts}: did an agent join after the first round closed?"
    (resumed,) = restarts
    assert resumed["resumed_from"] == "memory" and resumed["world"] == NPROC
    assert resumed["step"] in (10, 15)
    # the rows past the resumed step are replayed: at least 13 were written before the kill
    # (none past 15 when the kill lands after step 15's in-memory generation, under load)
    assert resumed["step"] + resumed["replayed_steps"] >= 13 and resumed["replayed_steps"] <= K
    assert rows[-1]["loss"] == pytest.approx(ref[-1]["loss"], rel=1e-5)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    config = json.loads((out / "config.json").read_text())["parallel"]  # the re-formed job's
    assert (config["dp"], config["microbatches"]) == (NPROC, 2)
    last = out / "logs" / f"rank{2 * NPROC - 1}.stderr.log"
    assert "--- attempt 1" not in last.read_text()  # it was the first world's, not the second's
    print(f"kill to first step at the new size: {resumed['first_step_at'] - killed_at:.1f} s")
