"""Activation memory, measured: the bytes autograd keeps saved for backward, live and at peak.

Used by both runners (the microbatch loop and the pipeline runtime) for `metrics.jsonl`'s
`peak_activation_bytes`, by tests that hold the planner's activation model against it, and
by the benchmarks for the peers. It works on any device: it counts tensors, not allocator
blocks.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable

import torch


class ActivationMeter:
    """Live and peak bytes of activations held by one rank.

    Counted: the distinct storages autograd saves for backward while `saving()` is active
    (released when autograd frees them), plus whatever `hold` keeps alive on top (stage
    outputs waiting for their send, inputs of deferred weight gradients). Parameters are
    not activations and are skipped; views of one storage count once.

    `counting` off makes `saving()` a no-op (no hooks, none of their cost: about 3 us per
    saved tensor); holds are still counted, so `references` then sees only them.
    `measure(every)` says which steps count: the first, one of every `every` after, and
    the one after a `recount()` (a cheap check saw a step differ from the counted one).
    """

    def __init__(self) -> None:
        self.skip: set[int] = set()
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.held: dict[object, list[int]] = {}
        self.held_refs: Counter[int] = Counter()  # storage pointer -> how many holds count it
        self.live = 0
        self.peak = 0
        self.counting = True
        self.measured = 0  # the peak of the latest step that counted
        self.steps = 0
        self.decisions: dict[object, bool] = {}  # see `learned`
        self.again = False  # count the next step (see `recount`)

    def measure(self, every: int) -> bool:
        """Start a step: count saved tensors in it if it is the first, or one of every
        `every` (0: the first only), or if a recount was asked for. Returns whether it counts."""
        self.counting = self.again or self.steps == 0 or (every > 0 and self.steps % every == 0)
        self.again = False
        self.steps += 1
        return self.counting

    def learned(self, key: object, seen: Callable[[], bool]) -> bool:
        """A yes/no read off the counts, for the steps that count none: on a counting
        step `seen()`, and once it has said yes the answer stays yes; on the other steps
        the remembered answer, yes if it was never counted (the cautious one). A step's
        graph may differ from the counted one (a data-dependent branch): whoever acts on a
        "no" checks, cheaply, that acting is safe (`alone`), and calls `recount` when not."""
        if self.counting:
            self.decisions[key] = self.decisions.get(key, False) or seen()
        return self.decisions.get(key, True)

    def recount(self) -> None:
        """Count the next step: a remembered answer did not hold on this one."""
        self.again = True

    def finish(self) -> int:
        """End a step: the latest counted peak (this step's, if it counted)."""
        if self.counting:
            self.measured = self.peak
        return self.measured

    def reset(self, params: Iterable[torch.Tensor] = ()) -> None:
        """Start a new peak; `params`' storages are never counted, nor their views' (ZeRO's
        flat buffers, which modules see only through views, even across a free and
        re-gather)."""
        # a storage's identity: unlike its data pointer, it survives a resize (ZeRO-3 frees
        # and re-gathers a buffer in place)
        self.skip = {p.untyped_storage()._cdata for p in params}
        self.peak = self.live

    def saving(self) -> contextlib.AbstractContextManager:
        """Context manager: count every tensor autograd saves inside it (if counting)."""
        if not self.counting:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def hold(self, key: object, tensors: Iterable[torch.Tensor]) -> None:
        """Count `tensors` as live until `drop(key)`."""
        ptrs = [p for p in (self._ref(t) for t in tensors) if p is not None]
        self.held.setdefault(key, []).extend(ptrs)
        self.held_refs.update(ptrs)

    def drop(self, key: object) -> None:
        """Stop counting what `hold(key, ...)` kept."""
        ptrs = self.held.pop(key, [])
        for ptr in ptrs:
            self._unref(ptr)
        self.held_refs -= Counter(ptrs)  # (which drops the pointers no hold counts now)

    def references(self, t: torch.Tensor) -> int:
        """How many saved tensors and holds currently count `t`'s storage."""
        return self.refs.get(t.untyped_storage().data_ptr(), [0])[0]

    def holds(self, t: torch.Tensor) -> int:
        """How many holds (not saved tensors) currently count `t`'s storage."""
        return self.held_refs[t.untyped_storage().data_ptr()]

    def _pack(self, t: torch.Tensor):
        ptr = self._ref(t)
        # detached: an output saved by its own node would otherwise hold that node, a
        # cycle through C++ that Python's collector cannot see (graphs kept for a later
        # weight pass then leak)
        return t if ptr is None else _Saved(t.detach(), ptr, self)

    def _ref(self, t: torch.Tensor) -> int | None:
        if t.device.type == "meta":
            return None
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or storage._cdata in self.skip:
            return None
        entry = self.refs.setdefault(ptr, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return ptr

    def _unref(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]


def alone(t: torch.Tensor) -> bool:
    """Whether nothing but `t` itself refers to its storage: no view, no detached alias,
    no tensor autograd saved as its own output or packed through a hook (all of which a
    later backward may read). Two reference counts, so cheap on every step. `t` itself
    may still be held (autograd saving it as is, or its gradient accumulator): not seen
    here, those keep its version counter, which reuse bumps (`autograd.graph.increment_version`)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= _ALONE


def held_as_is(t: torch.Tensor) -> bool:
    """Whether anything but its Python object holds the tensor `t` itself (autograd saves
    an op's input as is). Yes where this torch cannot tell (the cautious answer)."""
    count = getattr(t, "_use_count", None)
    return count is None or count() > 1


def _fresh_storage_refs() -> int:
    """A lone tensor's storage references (its own, and its Python storage object's)."""
    t = torch.empty(1)
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_ALONE = _fresh_storage_refs()


class _Saved:
    """A saved tensor with a receipt: when autograd lets go of it, the meter is told."""

    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: torch.Tensor, ptr: int, meter: ActivationMeter):
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter._unref(self.ptr)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed
