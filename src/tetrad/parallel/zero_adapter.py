"""ZeRO's state adapter: full logical tensors from and into the flat shards.

Out: each unit's shard (master weights, or an AdamW moment assembled from the shard views'
state) is all-gathered over its group's axis (fsdp, or ep_data for expert weights) and cut
into the local parameters by name. In: a unit's
flat buffer is rebuilt from full local tensors by name and this rank keeps its shard; no
collective, since every rank holds the full tensors it loads from.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tetrad.parallel.boxes import Box, box_numel, box_shape, flat_boxes, shift
from tetrad.parallel.state_adapter import (
    MOMENTS,
    Moments,
    Owned,
    PlainAdapter,
    Reader,
    adam_step,
    set_adam_state,
    snapshot,
)
from tetrad.parallel.zero import FlatUnit, UnitSlots, ZeroShards
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

    @property
    def device(self) -> torch.device:
        return self.sharded[0].device

    @property
    def whole(self) -> bool:
        """Whether ZeRO left parameters in the model (a group held whole)."""
        return any(True for _ in self.model.parameters())

    def local_names(self) -> list[str]:
        units = [n for sh in self.sharded for u in sh.layouts for n in u.names]
        return units + super().local_names()

    @torch.no_grad()
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """Every local parameter, full size, in the masters' dtype, from the master shards."""
        out: dict[str, torch.Tensor] = {}
        for sh in self.sharded:
            sh.drain()
            out |= gather_units(sh, lambda u: u.master)
        return out | super().local_state_dict()

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer) -> tuple[Moments, int]:
        """Full local moments, gathered over each group's axis from the shard views' AdamW
        state (and the whole group's own); the step over every tensor."""
        moments: Moments = {k: {} for k in MOMENTS}
        for sh in self.sharded:
            for k in MOMENTS:
                moments[k] |= gather_units(sh, lambda u, k=k: optimizer_shard(u, optimizer, k))
        whole, step = super().local_optimizer_state(optimizer)
        return {k: moments[k] | whole[k] for k in MOMENTS}, step

    def load_local(self, params, moments, step: int, optimizer) -> None:
        for sh in self.sharded:
            load_units(sh, params, moments, step, optimizer)
        super().load_local(params, moments, step, optimizer)

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
        for sh in self.sharded:
            sh.drain()
            for u in sh.units:
                flats = {"": u.master} | {
                    f"{k}/": optimizer_shard(u, optimizer, k) for k in MOMENTS
                }
                for name, at, box in self.shard_boxes(u):
                    if self.writes(name, replicated, sh.axis):
                        n, shape = box_numel(box), box_shape(box)
                        out += [(f"{key}{name}", box, snapshot(flat[at : at + n].view(shape)))
                                for key, flat in flats.items()]  # fmt: skip
        if self.whole:  # reads moments through `local_optimizer_state`, which gathers the
            out += super().owned_slices(optimizer, replicated)[0]  # units too, on every rank
        return out, adam_step(optimizer)

    @torch.no_grad()
    def load_owned(self, read: Reader, step: int, optimizer) -> None:
        """Each unit's shard of master weights and moments, read box by box (padding 0),
        then the whole group's tensors."""
        for sh in self.sharded:
            sh.drain()
            for u in sh.units:
                self._load_unit(u, read, step, optimizer)
        super().load_owned(read, step, optimizer)

    def _load_unit(self, u: FlatUnit, read: Reader, step: int, optimizer) -> None:
        # the master shard (key "") and the moments' ("exp_avg/", ...), padding left 0
        keys = ("", *(f"{k}/" for k in MOMENTS))
        flats = {key: torch.zeros(u.layout.shard, dtype=u.master.dtype) for key in keys}
        for name, at, box in self.shard_boxes(u):
            for key, flat in flats.items():
                flat[at : at + box_numel(box)] = read(f"{key}{name}", box).reshape(-1)
        u.master.copy_(flats[""])
        for (_, p), v in zip(u.params, u.views):
            set_adam_state(optimizer, p, step, *(flats[k][v.start : v.stop] for k in keys[1:]))

    def after_load(self) -> None:
        """Stages 1-2 keep full compute weights: gather them from the loaded shards."""
        for sh in self.sharded:
            sh.after_step()


@torch.no_grad()
def gather_units(
    shards: ZeroShards, shard_of: Callable[[FlatUnit], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every local parameter, full size, wide (float32; float64 under fp64), on CPU, from
    each unit's `shard_of(unit)`."""
    out = {}
    for u in shards.units:
        shard = widen(shard_of(u))
        full = torch.empty(u.layout.padded, dtype=shard.dtype, device=shards.device)
        shards.comm.all_gather(full, shard, shards.group)
        for name, off, shape in zip(u.layout.names, u.layout.offsets, u.layout.shapes):
            out[name] = full[off : off + math.prod(shape)].view(shape).cpu().clone()
    return out


def optimizer_shard(u: FlatUnit, optimizer: torch.optim.Optimizer, kind: str) -> torch.Tensor:
    """One AdamW moment over `u`'s shard (zeros for padding and before the first step)."""
    shard = torch.zeros(u.layout.shard, dtype=u.master.dtype, device=u.data.device)
    for (_, p), v in zip(u.params, u.views):
        if kind in optimizer.state.get(p, {}):
            shard[v.start : v.stop] = optimizer.state[p][kind]
    return shard


@torch.no_grad()
def load_units(
    shards: ZeroShards,
    params: dict[str, torch.Tensor],
    moments: dict[str, dict[str, torch.Tensor]] | None,
    step: int,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Install full local tensors by name: each unit's shard into its master weights (and
    into the compute buffer while that is gathered), and its views' AdamW state."""
    shards.drain()
    shards.stale = True  # FP8 gathers: new weights, new scales
    for u in shards.units:
        lo, hi = u.rank * u.layout.shard, (u.rank + 1) * u.layout.shard
        full = _flatten(u.layout, params, u.master.dtype).to(u.data.device)
        if u.gathered:  # stages 1-2 between steps: the compute weights persist
            u.data.copy_(full)
        u.master.copy_(full[lo:hi])
        if moments is None:
            continue
        moment_shards = [_flatten(u.layout, moments[k], u.master.dtype)[lo:hi] for k in MOMENTS]
        for (_, p), v in zip(u.params, u.views):
            set_adam_state(optimizer, p, step, *(m[v.start : v.stop] for m in moment_shards))


def _flatten(
    layout: UnitSlots, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """A unit's flat `dtype` buffer (padding zeroed) from its parameters' tensors by name."""
    pad = torch.zeros(layout.padded - layout.numel, dtype=dtype)
    return torch.cat([tensors[n].reshape(-1).to("cpu", dtype) for n in layout.names] + [pad])
