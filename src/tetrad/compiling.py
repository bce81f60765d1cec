"""Graph breaks for `--compile`, declared without importing torch's compiler.

`torch.compiler.disable` imports torch._dynamo (about 1 s of CPU), which `tetrad plan` and
every uncompiled run would pay at import. `graph_break(fn)` instead returns a wrapper that
calls `fn` itself until `ready()` (run when the first block is compiled, before anything
is traced); from then on it calls fn's disabled twin, traced or not: the eager code
between two compiled graphs runs under dynamo's frame hook too, and the twin keeps that
hook out of fn's frames (its collectives and autograd functions).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)
_twins: dict[Callable, Callable] = {}  # fn -> what its wrapper calls: fn, then disabled fn
_ready = False


def graph_break(fn: F) -> F:
    """`fn`, run eagerly when called from a compiled region (a graph break there): for the
    parts a graph cannot hold (collectives, autograd functions with side effects, host
    reads)."""
    _twins[fn] = torch.compiler.disable(fn) if _ready else fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return _twins[fn](*args, **kwargs)

    return call  # type: ignore[return-value]


def ready() -> None:
    """Make every graph break's disabled twin (before the first trace)."""
    global _ready
    if not _ready:
        _ready = True
        for fn in _twins:
            _twins[fn] = torch.compiler.disable(fn)
