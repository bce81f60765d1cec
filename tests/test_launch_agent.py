"""How the launcher starts torchrun's agent: forked from itself where that is safe (one
thread, torch already imported: the agent then imports nothing again), a new interpreter
otherwise; either way in its own session, its stderr in the log, its exit code returned.

Run in a fresh interpreter: pytest's own process has threads (the worlds' spawner)."""

from __future__ import annotations

import subprocess
import sys

from tetrad.launch import free_port

PROBE = r"""
import os, sys, threading, time
import torch  # as `tetrad train` has, checking the layout
from tetrad.launch import ForkedAgent, start_agent

def run(args, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    agent = start_agent(cmd, dict(os.environ, PROBE_ENV="seen"), log)
    while agent.poll() is None:
        time.sleep(0.02)
    return agent

# one worker that runs `true`, on a loopback store (as tetrad's single node does)
TRUE = ["--nproc-per-node=1", "--nnodes=1", "--master-addr=127.0.0.1",
        f"--master-port={sys.argv[2]}", "--no-python", "true"]
with open(sys.argv[1], "wb") as log:
    ok = run(TRUE, log)
    bad = run(["--nproc-per-node"], log)  # a flag without its value: argparse's 2
print("forked", isinstance(ok, ForkedAgent), ok.returncode, bad.returncode, flush=True)
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # a second thread: no fork now
other = run(["--nproc-per-node"], None)
stop.set()
print("threaded", type(other).__name__, other.returncode, flush=True)
"""


def test_agent_is_forked_when_alone_and_a_new_interpreter_otherwise(tmp_path):
    log = tmp_path / "torchrun.log"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(log), str(free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["forked"] == "True 0 2"  # forked, and its exit codes are torchrun's
    assert lines["threaded"] == "Popen 2"
    assert "error: argument --nproc-per-node" in log.read_text()  # its stderr, in the log


def test_a_silent_death_is_named_from_this_launchs_part_of_the_log(tmp_path, capsys):
    """A rank that died without a report is named from torchrun's root cause in the log
    this launch wrote, not from an earlier launch's in the same file (a resumed run)."""
    from tetrad.launch import explain

    logs, reports = tmp_path / "logs", tmp_path / "logs" / "reports"
    reports.mkdir(parents=True)
    old = "Root Cause\n  rank      : 0\n  exitcode  : 1\n"
    (logs / "torchrun.log").write_text(old + "Root Cause\n  rank      : 1\n  exitcode  : -9\n")
    assert explain(1, None, reports, logs, log_start=len(old)) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("tetrad: error: rank 1 died (signal SIGKILL) without reporting")
    (logs / "torchrun.log").write_text(old + "RuntimeError: the store is unreachable\n")
    assert explain(1, None, reports, logs, log_start=len(old)) == 1  # nothing of rank 0's
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("tetrad: error: torchrun failed before the ranks started")
