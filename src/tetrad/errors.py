"""Exit codes and failure reports: how a rank tells the launcher, once, what went wrong.

A rank that fails writes one small JSON report (its rank, the restart attempt, the time,
the message) into the directory the launcher names in `TETRAD_REPORT_DIR`, then exits. The
launcher reads the reports of the last attempt and prints the earliest error: the root
cause, not the peers that failed after it because it was gone. Without a launcher (plain
torchrun) nothing is written and each rank prints its own line.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

EXIT_FAILED = 1  # an error during the job (the launcher names the rank and the cause)
EXIT_USAGE = 2  # bad configuration or input, refused before or at start
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGINT after saving a checkpoint: resume with --resume
REPORT_DIR = "TETRAD_REPORT_DIR"
KINDS = ("error", "preempted", "stopped")  # in the launcher's order of interest
# swallows file errors: a failure report must never raise a second failure (reentrant)
_QUIET = contextlib.suppress(OSError, ValueError, KeyError, TypeError)


def rank_and_attempt() -> tuple[int, int]:
    """This process's global rank and torchrun restart count (0, 0 outside torchrun)."""
    rank = int(os.environ.get("RANK", "0"))
    return rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _attempt_dir() -> tuple[Path | None, int, int]:
    """The launcher's report directory (None: no launcher), this rank, this attempt."""
    directory = os.environ.get(REPORT_DIR)
    return (Path(directory) if directory else None), *rank_and_attempt()


def report(kind: str, message: str, code: int, **extra: Any) -> bool:
    """Write this rank's report for the launcher; False when there is no launcher to read it."""
    record = {"kind": kind, "message": message, "code": code, "time": time.time()}
    record |= {"pid": os.getpid(), **extra}
    return _write("attempt{attempt:03d}-rank{rank:05d}-{kind}.json", record)


def _write(name: str, record: dict[str, Any]) -> bool:
    """`record`, with this rank and attempt, into the launcher's report directory as `name`
    (formatted with the record's fields), whole (the launcher never reads half a file);
    False without a launcher or on failure."""
    directory, rank, attempt = _attempt_dir()
    if directory is None:
        return False
    record = {"rank": rank, "attempt": attempt, **record}
    with _QUIET:
        path = directory / name.format(**record)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
        return True
    return False


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """The reports of the newest attempt found in `directory`, oldest first."""
    return _newest_attempt(Path(directory).glob("attempt*-rank*.json"), lambda r: r["time"])


def _newest_attempt(paths, key) -> list[dict[str, Any]]:
    """The readable JSON records of `paths` that belong to the newest attempt, by `key`."""
    records = []
    for path in sorted(paths):
        with _QUIET:
            records.append(json.loads(path.read_text()))
    last = max((r.get("attempt", 0) for r in records), default=0)
    return sorted((r for r in records if r.get("attempt", 0) == last), key=key)


def root_cause(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The report that explains the job's end: the earliest error, else the first other."""
    return next((r for kind in KINDS for r in records if r.get("kind") == kind), None)


# --- hangs: which rank is behind ---------------------------------------------------------
# When a collective outlives --timeout, the rank that saw it asks every rank for its recent
# collectives (a request file in the report directory, which every rank's watchdog looks
# for); each answers with a trace file; the launcher compares the sequence numbers.


def request_traces() -> None:
    """Ask every rank of this attempt to write its trace (without a launcher: nothing); the
    request names the rank that asked."""
    _write("attempt{attempt:03d}.traces-requested", {})


def traces_requested() -> bool:
    """Whether some rank of this attempt asked for every rank's trace."""
    directory, _, attempt = _attempt_dir()
    return directory is not None and (directory / f"attempt{attempt:03d}.traces-requested").exists()


def write_trace(record: dict[str, Any]) -> None:
    """This rank's trace (its recent collectives, see `comm.ledger`) for the launcher."""
    _write("trace-attempt{attempt:03d}-rank{rank:05d}.json", record)


def traces_written() -> int:
    """How many ranks of this attempt have written their trace."""
    directory, _, attempt = _attempt_dir()
    return len(list(directory.glob(f"trace-attempt{attempt:03d}-rank*.json"))) if directory else 0


def read_traces(directory: Path) -> list[dict[str, Any]]:
    """The traces of the newest attempt found in `directory`, by rank."""
    return _newest_attempt(Path(directory).glob("trace-attempt*-rank*.json"), lambda t: t["rank"])


def who_is_behind(traces: list[dict[str, Any]]) -> str | None:
    """One sentence naming the rank whose collective sequence number lags on a group, and
    the collective the others wait in there; None without traces.

    A trace holds, per group name, the group's ranks and the last sequence number this
    rank issued on it (`groups`), and the collective it is blocked in, if any
    (`waiting`: op, group, seq). Every rank issues the same collectives on a group in the
    same order, so on a group whose members disagree, the lower numbers are behind."""
    by_rank = {t["rank"]: t for t in traces}
    waiting = [t["waiting"] for t in traces if t.get("waiting")]
    names = [w["group"] for w in waiting] + sorted({g for t in traces for g in t["groups"]})
    for name in dict.fromkeys(names):  # the groups someone waits in first
        if line := _lag_on(name, by_rank, waiting):
            return line
    if waiting:
        w = waiting[0]
        return (
            f"no rank is behind in the collectives it issued: ranks wait in {w['op']} "
            f"#{w['seq']} over {w['group']}, which every member reached (a slow or stuck "
            "device, or a mismatch of shapes; on GPUs see the NCCL flight recorder dumps)"
        )
    return None


def _lag_on(name: str, by_rank: dict[int, dict], waiting: list[dict]) -> str | None:
    members = next(t["groups"][name]["ranks"] for t in by_rank.values() if name in t["groups"])
    seqs = {r: by_rank[r]["groups"].get(name, {}).get("seq", 0) for r in members if r in by_rank}
    silent = [r for r in members if r not in by_rank]
    top = max(seqs.values(), default=0)
    behind = sorted(r for r, s in seqs.items() if s < top)
    if not behind and not silent:
        return None
    # the first collective a lagging rank has not issued: where the others wait (on NCCL
    # they may have enqueued more behind it)
    stuck = min(seqs[r] for r in behind) + 1 if behind else top
    ahead = sorted(r for r, s in seqs.items() if s >= stuck)
    # what the others wait in, else what the first of them issued there (its recent calls)
    calls = [*waiting, *by_rank[ahead[0]].get("recent", [])]
    op = next((c["op"] for c in calls if c["group"] == name and c["seq"] == stuck), "a collective")
    lags = ", ".join(f"rank {r} at #{seqs[r]}" for r in behind)
    if silent:
        lags = ", ".join(filter(None, [lags, f"rank(s) {silent} left no trace"]))
    return (
        f"behind on {name} (ranks {members}): {lags}; ranks {ahead} wait in {op} #{stuck} "
        f"over {name}"
    )
