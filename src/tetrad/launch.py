"""The launcher: re-run a `tetrad` command under torchrun with N local ranks on loopback.

torchrun is the launcher (it sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous); this
module only builds its command line. The store binds to 127.0.0.1 on a free port, so a
single-node job is reachable from this machine only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port free on loopback now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def drop_nproc(argv: list[str]) -> list[str]:
    """`argv` without `--nproc N` / `--nproc=N` (the ranks must not launch again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(nproc: int, argv: list[str]) -> int:
    """Run `tetrad ARGV` (less --nproc) as `nproc` local ranks; return torchrun's code.

    Each rank gets an equal share of this machine's cores as its torch thread count.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "tetrad.cli", *drop_nproc(argv),
    ]  # fmt: skip
    env = dict(os.environ, TETRAD_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)
