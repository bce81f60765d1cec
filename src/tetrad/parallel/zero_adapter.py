"""ZeRO's state adapter: full logical tensors from and into the flat shards.

Out: each unit's master shard is all-gathered over its group's axis (fsdp, or ep_data for
expert weights) and cut into the local parameters by name. In: a unit's flat buffer is
rebuilt from full local tensors by name and this rank keeps its shard; no collective,
since every rank holds the full tensors it loads from. Sharded checkpoints: each rank's
shard of master weights and AdamW moments, cut into boxes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from tetrad.comm.tp import gather_along
from tetrad.parallel.boxes import Box, box_numel, box_shape, flat_boxes, shift
from tetrad.parallel.state_adapter import (
    MOMENTS,
    Owned,
    PlainAdapter,
    Reader,
    adam_step,
    moment,
    set_adam_state,
    snapshot,
)
from tetrad.parallel.zero import FlatUnit, ZeroShards
from tetrad.precision import widen


class ZeroAdapter(PlainAdapter):
    """`PlainAdapter` over parameter groups ZeRO shards (`sharded`, one `ZeroShards` each,
    dense first): their tensors live in its units, gathered over its axis to read. A group
    held whole (expert weights with one rank per expert-data group) stays in the model:
    the `PlainAdapter` half, over `optimized`. Each method walks the sharded groups in
    order, then the whole one: the same collectives in the same order on every rank."""

    def __init__(self, sharded: list[ZeroShards], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sharded = sharded

    def _units(self) -> Iterator[tuple[ZeroShards, FlatUnit]]:
        """Every sharded group's units, in order, each group's gathers drained first."""
        for sh in self.sharded:
            sh.drain()
            yield from ((sh, u) for u in sh.units)

    @torch.no_grad()
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """Every local parameter, full size, wide (float32; float64 under fp64), on CPU:
        each unit's master shard all-gathered over its group's axis."""
        out: dict[str, torch.Tensor] = {}
        for sh, u in self._units():
            full = gather_along(widen(u.master), 0, sh.comm, sh.group)  # [padded]
            out |= {n: t.cpu().clone() for n, t in zip(u.layout.names, u.layout.split(full))}
        return out | super().local_state_dict()

    @torch.no_grad()
    def load_full(self, params: dict[str, torch.Tensor]) -> None:
        """Each unit's shard of the full logical tensors into its master weights (and into
        the compute buffer while that is gathered: stages 1-2 between steps), then the
        whole group's tensors."""
        for sh, u in self._units():
            sh.stale = True  # FP8 gathers: new weights, new scales
            full = torch.zeros(u.layout.padded, dtype=u.master.dtype, device=u.data.device)
            for name, piece in zip(u.layout.names, u.layout.split(full)):
                piece.copy_(self._slice(name, params[name]))
            if u.gathered:
                u.data.copy_(full)
            u.master.copy_(full.view(-1, u.layout.shard)[u.rank])
        super().load_full(params)

    # --- sharded checkpoints: each rank's own piece of each unit, as boxes ----------------
    def shard_boxes(self, u: FlatUnit) -> list[tuple[str, int, Box]]:
        """(name, offset in this rank's shard, box in the full tensor) covering the shard."""
        lo = u.rank * u.layout.shard
        hi = lo + u.layout.shard
        out = []
        for name, off, shape in zip(u.layout.names, u.layout.offsets, u.layout.shapes):
            a, b = max(off, lo), min(off + math.prod(shape), hi)
            at = a - lo
            for box in flat_boxes(tuple(shape), a - off, b - off):
                out.append((name, at, shift(box, self.box(name))))
                at += box_numel(box)
        return out

    @torch.no_grad()
    def owned_slices(self, optimizer, replicated) -> tuple[Owned, int]:
        out: Owned = []
        for sh, u in self._units():
            flats = {"": u.master} | {f"{k}/": optimizer_shard(u, optimizer, k) for k in MOMENTS}
            for name, at, box in self.shard_boxes(u):
                if self.writes(name, replicated, sh.axis):
                    n, shape = box_numel(box), box_shape(box)
                    out += [(f"{key}{name}", box, snapshot(flat[at : at + n].view(shape)))
                            for key, flat in flats.items()]  # fmt: skip
        out += super().owned_slices(optimizer, replicated)[0]  # the whole group's
        return out, adam_step(optimizer)

    @torch.no_grad()
    def load_owned(self, read: Reader, step: int, optimizer) -> None:
        """Each unit's shard of master weights and moments, read box by box (padding 0),
        then the whole group's tensors."""
        keys = ("", *(f"{k}/" for k in MOMENTS))  # the master shard's, then the moments'
        for _, u in self._units():
            flats = {key: torch.zeros(u.layout.shard, dtype=u.master.dtype) for key in keys}
            for name, at, box in self.shard_boxes(u):
                for key, flat in flats.items():
                    flat[at : at + box_numel(box)] = read(f"{key}{name}", box).reshape(-1)
            u.master.copy_(flats[""])
            for (_, p), v in zip(u.params, u.views):
                moments = (flats[k][v.start : v.stop] for k in keys[1:])
                set_adam_state(optimizer, p, step, *moments)
        super().load_owned(read, step, optimizer)

    def after_load(self) -> None:
        """Stages 1-2 keep full compute weights: gather them from the loaded shards."""
        for sh in self.sharded:
            sh.after_step()


def optimizer_shard(u: FlatUnit, optimizer: torch.optim.Optimizer, kind: str) -> torch.Tensor:
    """One AdamW moment over `u`'s shard (zeros for padding and before the first step)."""
    shard = torch.zeros(u.layout.shard, dtype=u.master.dtype, device=u.data.device)
    for (_, p), v in zip(u.params, u.views):
        shard[v.start : v.stop] = moment(optimizer, p, kind)
    return shard
