"""Long runs that survive: one clear error and no hang when any rank fails, a collective
watchdog, preemption by signal with an exact resume, restarts after a killed worker (from
the durable checkpoint, and from the in-memory one), and a two-node job; all through the
`tetrad train` launcher and torchrun, in subprocesses.

Faults are injected from outside tetrad: tests/faults/sitecustomize.py, which Python loads
at start-up when that directory is on PYTHONPATH, patches one rank's training step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tetrad.launch import free_port

pytestmark = pytest.mark.distributed

FAULTS = str(Path(__file__).parent / "faults")
TINY = [
    "--layers", "2", "--dim", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
    "--seq-len", "16", "--global-batch", "8", "--data", "synthetic", "--no-progress",
]  # fmt: skip
STEPS = 40
ENDS_WITHIN_S = 30.0


def start(out: Path, *args: str, fault: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]))
    if fault:
        env["TETRAD_TEST_FAULT"] = fault
    cmd = [sys.executable, "-m", "tetrad.cli", "train", *TINY, "--out", str(out), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"job still running after {timeout} s:\n{err[-3000:]}") from None
    return proc.returncode, out, err


def processes_of(out: Path) -> list[int]:
    """Pids of live processes whose command line names `out` (launcher, torchrun, ranks)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if str(out).encode() in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("tetrad: error:")]


def reports(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (out / "logs").glob("reports-*/attempt*-rank*.json")]


def weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    path = out / "checkpoints" / f"step_{step:08d}"
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def assert_same_run(got: Path, ref: Path, step: int) -> None:
    """Equal final weights and Adam moments (bitwise: same layout, same order of sums) and
    per-step losses."""
    a, b = weights(got, step), weights(ref, step)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows = [json.loads(x) for x in (got / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(step))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in want], rel=1e-6)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run the interrupted ones must reproduce."""
    out = tmp_path_factory.mktemp("straight")
    code, _, err = finish(
        start(out, "--nproc", "2", "--steps", str(STEPS), "--checkpoint-every", "10")
    )
    assert code == 0, err[-3000:]
    return out


def test_error_in_a_step_on_one_rank_ends_the_job_with_one_message(tmp_path):
    out = tmp_path / "run"
    code, stdout, err = finish(start(out, "--nproc", "2", "--steps", "20", fault="raise:1:3"))
    ended = time.time()
    assert code == 1
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert "rank 1: RuntimeError: injected fault at step 3" in lines[0]
    assert str(out / "logs") in lines[0]
    assert "ChildFailedError" not in err + stdout and "Traceback" not in err + stdout
    cause = [r for r in reports(out) if r["rank"] == 1 and r["kind"] == "error"]
    assert ended - cause[0]["time"] < ENDS_WITHIN_S
    assert "injected fault" in (out / "logs" / "rank1.stderr.log").read_text()  # the whole log
    assert not processes_of(out)


def test_watchdog_names_the_stuck_collective(tmp_path):
    out = tmp_path / "run"
    args = ("--nproc", "2", "--steps", "20", "--timeout", "3")
    code, _, err = finish(start(out, *args, fault="hang:1:2"))
    ended = time.time()
    assert code == 1
    (line,) = error_lines(err)
    assert "rank 0: all_reduce over data (ranks [0, 1]) did not complete within 3 s" in line
    # rank 1 never issued step 2's first collective (the token count over data): every
    # rank's trace says so, and the launcher names it and what rank 0 waits in
    (behind,) = [x for x in err.splitlines() if x.startswith("tetrad: behind on data")]
    assert "rank 1 at #" in behind and "ranks [0] wait in all_reduce #" in behind, behind
    mine, theirs = (int(x) for x in re.findall(r"#(\d+)", behind))
    assert theirs == mine + 1
    cause = [r for r in reports(out) if r["kind"] == "error"]
    assert ended - min(r["time"] for r in cause) < ENDS_WITHIN_S
    assert not processes_of(out)


def test_bad_token_id_deep_in_the_file_fails_the_job_at_start(tmp_path):
    tokens = np.zeros(5_000_000, dtype=np.uint16)  # past the first 4M tokens
    tokens[4_500_001] = 64
    path = tmp_path / "tokens.u16"
    tokens.tofile(path)
    out = tmp_path / "run"
    code, _, err = finish(start(out, "--nproc", "2", "--steps", "5", "--data", str(path)))
    assert code == 2
    (line,) = error_lines(err)
    assert f"token id 64 at position 4500001 of {path} is >= model.vocab=64" in line
    # every rank checks the file when it opens it; the first to refuse it ends the job
    assert {r["rank"] for r in reports(out) if r["kind"] == "error"} <= {0, 1}
    assert not processes_of(out)


def test_bad_out_fails_once_before_launching(tmp_path, capfd):
    """Refused by the launcher itself (in this process: nothing is launched)."""
    from tetrad.cli import main as cli_main

    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    assert cli_main(["train", *TINY, "--out", str(out), "--nproc", "2"]) == 2
    (line,) = error_lines(capfd.readouterr().err)
    assert "cannot be created: Not a directory" in line


def test_sigterm_saves_at_the_step_reached_and_resume_is_exact(straight, tmp_path):
    out = tmp_path / "run"
    args = ("--nproc", "2", "--steps", str(STEPS), "--checkpoint-every", "10")
    proc = start(out, *args, "--async-checkpoint", fault="slow:0:0")  # 50 ms a step
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 12):
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc)[2][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code, stdout, err = finish(proc)
    while processes_of(out) and time.monotonic() - signalled < ENDS_WITHIN_S:
        time.sleep(0.2)
    assert not processes_of(out), "processes left after SIGTERM"
    assert time.monotonic() - signalled < ENDS_WITHIN_S
    assert code == 75, err[-3000:]
    reached = len(metrics.read_text().splitlines())
    assert 12 <= reached < STEPS
    assert f"stopped by SIGTERM after step {reached}" in stdout
    assert (out / "checkpoints" / f"step_{reached:08d}" / "manifest.json").is_file()
    code, _, err = finish(start(out, *args, "--resume"))
    assert code == 0, err[-3000:]
    assert_same_run(out, straight, STEPS)


def test_killed_worker_restarts_and_finishes_the_same_run(straight, tmp_path):
    out = tmp_path / "run"
    args = ("--nproc", "2", "--steps", str(STEPS), "--checkpoint-every", "10")
    code, _, err = finish(start(out, *args, "--max-restarts", "1", fault="kill:1:25"))
    assert code == 0, err[-3000:]
    log = (out / "logs" / "rank0.stderr.log").read_text()
    assert "--- attempt 1" in log  # the agent restarted the workers
    assert_same_run(out, straight, STEPS)


def test_killed_worker_resumes_from_memory_replaying_at_most_k_steps(straight, tmp_path):
    """Rank 1 is SIGKILLed at the start of step 18. The newest durable checkpoint is step
    10's; the in-memory generation of step 15 (K = 5) is newer, so the restarted workers
    resume from it, replay at most K steps, and finish the uninterrupted run exactly."""
    out, shm = tmp_path / "run", tmp_path / "shm"
    args = ("--nproc", "2", "--steps", str(STEPS), "--checkpoint-every", "10")
    local = ("--local-checkpoint-every", "5", "--local-dir", str(shm))
    code, _, err = finish(start(out, *args, *local, "--max-restarts", "1", fault="kill:1:18"))
    assert code == 0, err[-3000:]
    assert "--- attempt 1" in (out / "logs" / "rank0.stderr.log").read_text()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (resumed,) = [r for r in rows if "resumed_from" in r]
    assert resumed["step"] == 15 and resumed["resumed_from"] == "memory"
    assert 1 <= resumed["replayed_steps"] <= 5  # steps 15..17 had been logged (2 or 3)
    assert_same_run(out, straight, STEPS)
    assert not shm.exists()  # the launcher frees the node's memory


def test_two_nodes_match_one_process(tmp_path):
    """Two torchrun agents on this machine, one rank each, meet at a c10d rendezvous on
    127.0.0.1: the README's multi-node recipe."""
    from tetrad.cli import build_config, parser
    from tetrad.train.run import run

    one, two = tmp_path / "one", tmp_path / "two"
    steps = ("--steps", "6")
    run(build_config(parser().parse_args(["train", *TINY, "--out", str(one), *steps])))
    node = ("--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")
    nodes = [start(two, *node, "--dp", "2", *steps) for _ in range(2)]
    for proc in nodes:
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5)
