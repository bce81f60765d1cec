"""The launcher: re-run a `tetrad` command under torchrun, watch it, and say how it ended.

torchrun is the launcher (it sets RANK, WORLD_SIZE, LOCAL_RANK, the rendezvous, and its
elastic agent restarts failed workers up to `--max-restarts` times); this module builds
its command line and stands between it and the user:

- logs: torchrun's own output goes to OUT/logs/torchrun.log and each rank's stderr (and
  stdout, but rank 0's) to OUT/logs/rank<R>.{stderr,stdout}.log, so the console shows the
  progress and, on failure, one line: the root cause from the ranks' reports
  (`tetrad.errors`), with its rank;
- hangs: when a collective outlives --timeout every rank leaves a trace of its recent
  collectives (`tetrad.comm.ledger`), and a second line names the rank that is behind and
  the collective the others wait in;
- signals: SIGTERM or SIGINT to this process is forwarded once, as SIGTERM, to torchrun,
  whose agent passes it to every worker; the workers save and exit (`tetrad.train.stop`).
  torchrun runs in its own session (a terminal's Ctrl-C reaches it only through us) and
  dies with us (PR_SET_PDEATHSIG), and so do its workers, so no process outlives the job;
- start-up: torchrun's agent is forked from this process when it is single-threaded and
  has imported torch already (as `tetrad train` has, to check the layout), so the agent
  does not import torch a second time (about 2 s of CPU per launch); elsewhere it is a
  new interpreter. The agent starts the workers as new interpreters either way.

The single-node store binds to 127.0.0.1 on a free port, reachable from this machine only;
several nodes meet at a c10d rendezvous endpoint instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

from tetrad.errors import (
    EXIT_FAILED,
    EXIT_PREEMPTED,
    REPORT_DIR,
    read_reports,
    read_traces,
    root_cause,
    who_is_behind,
)

LOG_DIR = "TETRAD_LOG_DIR"
PR_SET_PDEATHSIG = 1
KILL_AFTER_S = 60.0  # after forwarding a signal: torchrun's own grace is 30 s


def free_port() -> int:
    """A TCP port free on loopback now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def drop_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` without `--flag V` / `--flag=V` for each of `flags` (launcher-only flags)."""
    out, args = [], iter(argv)
    for a in args:
        if a in flags:
            next(args, None)  # its value
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (elsewhere: nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def launch(
    nproc: int,
    argv: list[str],
    out: str | Path | None = None,
    max_restarts: int = 0,
    nnodes: int | str = 1,
    rdzv_endpoint: str | None = None,
    rdzv_conf: str | None = None,
) -> int:
    """Run `tetrad ARGV` (less launcher flags) as `nproc` local ranks under torchrun; return
    the job's code. torchrun's store is on loopback for one node; several nodes meet at a
    c10d rendezvous (`nnodes` "MIN:MAX": an elastic range, which the rendezvous re-forms
    within).

    With `out`, logs and the ranks' failure reports go under OUT/logs and a failure prints
    its root cause once. Each rank gets an equal share of this machine's cores as threads.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd.append(f"--max-restarts={max_restarts}")
    if str(nnodes) == "1" and rdzv_endpoint is None:
        cmd += ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        if max_restarts:  # the elastic agent's restarts need a rendezvous that can re-form
            cmd[-2:] = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        cmd.append("--rdzv-id=tetrad")
        if rdzv_conf:
            cmd.append(f"--rdzv-conf={rdzv_conf}")
    # dropped: torchrun's parser reads the whole line, and would take these as its own
    # (--nnodes, --max-restarts) or refuse them as ambiguous (--nproc)
    launcher_only = ("--nproc", "--max-restarts", "--nnodes", "--rdzv-endpoint", "--rdzv-conf")
    cmd += ["-m", "tetrad.cli", *drop_flags(argv, launcher_only)]
    env = dict(os.environ, TETRAD_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    if ":" in str(nnodes):
        # an elastic range: the agents' shared store keeps the first round's worker address,
        # so a node that joins a later round (a grown job) waits for one never published;
        # without sharing, every round's rank 0 publishes its own
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if out is None:
        return _supervise(cmd, env, None)[0]
    logs = Path(out) / "logs"
    reports = logs / f"reports-{uuid.uuid4().hex[:8]}"
    reports.mkdir(parents=True)
    env |= {REPORT_DIR: str(reports), LOG_DIR: str(logs)}
    log = logs / "torchrun.log"
    log_start = log.stat().st_size if log.exists() else 0  # this launch's part follows
    code = explain(*_supervise(cmd, env, logs), reports, logs, log_start)
    with contextlib.suppress(OSError):
        reports.rmdir()  # kept only when it holds reports
    return code


def _supervise(cmd: list[str], env: dict, logs: Path | None) -> tuple[int, int | None]:
    """Run torchrun, forwarding SIGTERM/SIGINT once; returns (its code, the signal)."""
    with open(logs / "torchrun.log", "ab") if logs else contextlib.nullcontext() as log:
        proc = start_agent(cmd, env, log)
        got: list[tuple[int, float]] = []  # (signal, when)

        def forward(signum, _frame):
            if not got:
                proc.send_signal(signal.SIGTERM)  # torchrun's agent passes it to every worker
            got.append((signum, time.monotonic()))

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while proc.poll() is None:
                time.sleep(0.1)
                # asked twice, or the workers outlive torchrun's own grace: do not wait longer
                if len(got) > 1 or (got and time.monotonic() - got[0][1] > KILL_AFTER_S):
                    _kill_group(proc.pid)
            return proc.returncode, (got[0][0] if got else None)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            _kill_group(proc.pid)  # anything torchrun left in its session


def start_agent(cmd: list[str], env: dict, log) -> subprocess.Popen | ForkedAgent:
    """Start torchrun's `cmd` in a new session that dies with this process, its stderr to
    `log`: forked from this process where that is safe and saves importing torch."""
    forkable = threading.active_count() == 1 and "torch" in sys.modules
    if forkable and cmd[1:3] == ["-m", "torch.distributed.run"]:
        return ForkedAgent(cmd[3:], env, log)
    return subprocess.Popen(
        cmd, env=env, stderr=log, start_new_session=True, preexec_fn=die_with_parent
    )


class ForkedAgent:
    """torchrun's main(`args`) in a forked child, watched as `subprocess.Popen` is (`pid`,
    `poll`, `send_signal`, `returncode`). Only this process's one thread is copied by the
    fork; the child runs no tensor operation (its workers are new interpreters)."""

    def __init__(self, args: list[str], env: dict, log) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _agent(args, env, log, parent)  # never returns
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def _agent(args: list[str], env: dict, log, parent: int) -> None:
    """The forked child: what `python -m torch.distributed.run ARGS` would do, started
    as Popen starts it (own session, dies with the launcher, stderr to the log, default
    signal handlers); leaves with its exit code, never returning into the caller."""
    code = 1
    try:
        os.setsid()
        die_with_parent()
        if os.getppid() != parent:  # the launcher died before the line above
            os._exit(code)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if log is not None:
            os.dup2(log.fileno(), 2)
        os.environ.clear()
        os.environ.update(env)
        from torch.distributed.run import main

        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def explain(code: int, signalled: int | None, reports: Path, logs: Path, log_start: int = 0) -> int:
    """Print how the job ended (once) and return the launcher's exit code. `log_start`:
    where this launch's part of OUT/logs/torchrun.log begins."""
    if code == 0 and signalled is None:
        return 0
    cause = root_cause(read_reports(reports))
    if cause is not None and cause["kind"] == "preempted":
        print(f"tetrad: {cause['message']}; continue with --resume", flush=True)
        return EXIT_PREEMPTED
    log = ""  # this launch's part of torchrun's log
    with contextlib.suppress(OSError):
        log = (logs / "torchrun.log").read_bytes()[log_start:].decode(errors="replace")
    # torchrun ended on its rendezvous timing out: after a failure, fewer nodes than the
    # job's minimum came back
    if signalled is None and "RendezvousTimeoutError" in log:
        after = f" (the failure: {cause['message']})" if cause is not None else ""
        print(f"tetrad: error: the job could not re-form: fewer nodes than --nnodes MIN "
              f"rejoined the rendezvous within its join_timeout{after} (logs: {logs})",
              file=sys.stderr, flush=True)  # fmt: skip
        return code or EXIT_FAILED
    if cause is not None:
        print(f"tetrad: error: {cause['message']} (logs: {logs})", file=sys.stderr, flush=True)
        # a timed-out collective: the ranks' traces say who did not arrive
        if behind := who_is_behind(read_traces(reports)):
            print(f"tetrad: {behind} (traces: {reports})", file=sys.stderr, flush=True)
        return int(cause.get("code") or EXIT_FAILED)
    if signalled is not None:
        name = signal.Signals(signalled).name
        print(f"tetrad: stopped by {name} before any step could save (logs: {logs})",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + signalled
    print(f"tetrad: error: {_child_failure(log)} (logs: {logs})", file=sys.stderr, flush=True)
    return code or EXIT_FAILED


def _child_failure(text: str) -> str:
    """The root cause torchrun's log `text` names when a rank died without a report
    (killed, crashed)."""
    tail = text[text.rfind("Root Cause") :] if "Root Cause" in text else text[-4000:]
    rank = re.search(r"rank\s*:\s*(\d+)", tail)
    exitcode = re.search(r"exitcode\s*:\s*(-?\d+)", tail)
    if rank and exitcode:
        ec = int(exitcode.group(1))
        how = f"signal {signal.Signals(-ec).name}" if ec < 0 else f"exit code {ec}"
        return f"rank {rank.group(1)} died ({how}) without reporting an error"
    return "torchrun failed before the ranks started"
