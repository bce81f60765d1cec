"""Exit codes and failure reports: how a rank tells the launcher, once, what went wrong.

A rank that fails writes one small JSON report (its rank, the restart attempt, the time,
the message) into the directory the launcher names in `TETRAD_REPORT_DIR`, then exits. The
launcher reads the reports of the last attempt and prints the earliest error: the root
cause, not the peers that failed after it because it was gone. Without a launcher (plain
torchrun) nothing is written and each rank prints its own line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1  # an error during the job (the launcher names the rank and the cause)
EXIT_USAGE = 2  # bad configuration or input, refused before or at start
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGINT after saving a checkpoint: resume with --resume
REPORT_DIR = "TETRAD_REPORT_DIR"
KINDS = ("error", "preempted", "stopped")  # in the launcher's order of interest


def rank_and_attempt() -> tuple[int, int]:
    """This process's global rank and torchrun restart count (0, 0 outside torchrun)."""
    rank = int(os.environ.get("RANK", "0"))
    return rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def report(kind: str, message: str, code: int, **extra: Any) -> bool:
    """Write this rank's report for the launcher; False when there is no launcher to read it."""
    directory = os.environ.get(REPORT_DIR)
    if not directory:
        return False
    rank, attempt = rank_and_attempt()
    record = {"kind": kind, "message": message, "code": code, "rank": rank}
    record |= {"attempt": attempt, "time": time.time(), "pid": os.getpid(), **extra}
    path = Path(directory) / f"attempt{attempt:03d}-rank{rank:05d}-{kind}.json"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # the launcher never reads half a report
    except OSError:
        return False
    return True


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """The reports of the newest attempt found in `directory`, oldest first."""
    records = []
    for path in sorted(Path(directory).glob("attempt*-rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return []
    last = max(r.get("attempt", 0) for r in records)
    return sorted((r for r in records if r.get("attempt", 0) == last), key=lambda r: r["time"])


def root_cause(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The report that explains the job's end: the earliest error, else the first other."""
    for kind in KINDS:
        found = [r for r in records if r.get("kind") == kind]
        if found:
            return found[0]
    return None
