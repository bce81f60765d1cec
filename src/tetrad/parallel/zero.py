"""ZeRO-1/2/3 (FSDP), ours: flat per-block shards over the `fsdp` group.

Units. The local parameters (what the pipeline split and tensor parallelism left) are
grouped into units: one per transformer block and one "root" for the rest (embedding,
final norm, head). A unit's parameters lie end to end in one flat buffer padded to a
multiple of the fsdp size n, so rank r owns the contiguous shard [r·S, (r+1)·S), S =
padded/n. Inside a unit the parameters are ordered by class (weight decay or not, and the
axes the values are replicated over), so a shard meets each class in one contiguous
range; those ranges are the tensors the optimizer sees (`ShardView`), named after a
logical parameter they cover, so name rules (no decay for a norm's gain) still apply.
Padding belongs to no view: the optimizer never allocates state for it.

The model keeps its modules; each parameter attribute becomes a view into the unit's flat
compute buffer (an autograd leaf), re-split at every forward, so a unit's gradient lands
in one flat tensor and one post-accumulate-grad hook says "this unit's backward is done".

Stages (fp32 master shard and AdamW state: S elements each per unit on every stage):
  1: full compute params and full gradients persist; after backward the gradient is
     reduce-scattered in place; after the step the updated shards are all-gathered.
  2: as 1, but a unit's full gradient is freed as soon as its reduce-scatter is done,
     which is launched the moment the unit's backward finishes; the fp32 gradient shard
     lives from the reduction to the end of the step (stage 3 too).
  3: compute params exist only while used: all-gathered before a block's forward (the
     next block's gather is prefetched while this one computes) and again before its
     backward (the previous block prefetched from the middle of this one's backward, once
     its FFN half is done: off the step's peak), freed after each (`reshard_after_forward`
     =False keeps a block gathered from its first forward to the step's last backward).
     The root unit stays gathered from its first use to the end of the step's backward:
     backward starts with the head, so freeing it in between would save nothing.

Accumulation: on non-final microbatches (`sync=False`) gradients accumulate in the full
flat gradient and nothing is reduced; the final microbatch reduces each unit once, so a
step moves the same bytes whatever the microbatch count (ZeRO-2/3 hold up to one full
gradient per unit during the step for this). HSDP: the reduce-scattered shard is then
all-reduced over "replica" (dp × cp: with context parallelism the cp ranks' gradients
are summed too). Mixed precision: compute buffers in `train.dtype` are gathered
from casts of the fp32 master shards; gradients are reduced in `parallel.reduce_dtype`
and kept as fp32 shards for the optimizer. `--fp8-all-gather` (stage 3): a block's FP8
linears' weights are gathered in FP8 with scales max-reduced once a step
(parallel/compress.py, `Float8Gather`), the rest of the unit in the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate

import torch
from torch import nn

from tetrad.comm import Comm, Work
from tetrad.layout import Layout
from tetrad.mesh import Group, Mesh
from tetrad.models.fp8 import E4M3, Float8Linear, scale_of
from tetrad.models.plans import decays
from tetrad.models.spec import ModelSpec
from tetrad.parallel.compress import (
    Float8Gather,
    PieceWork,
    QuantizedReduce,
    Residual,
    max_over,
)
from tetrad.parallel.runner import Held
from tetrad.precision import mixed

ROOT = "root"
# (weight decay?, axes the values are replicated over besides fsdp)
ClassKey = tuple[bool, tuple[str, ...]]


# --- the layout: pure arithmetic, shared with the memory planner -------------------------


@dataclass(frozen=True)
class ShardView:
    """One optimizer tensor: a contiguous range of a rank's shard holding one class."""

    name: str
    key: ClassKey
    start: int  # offsets inside the rank's shard
    stop: int


@dataclass(frozen=True)
class UnitSlots:
    """Where each parameter of one unit lives in its flat buffer and in the shards."""

    name: str
    names: tuple[str, ...]  # in flat order
    shapes: tuple[tuple[int, ...], ...]
    keys: tuple[ClassKey, ...]
    world: int  # fsdp degree

    @cached_property
    def sizes(self) -> list[int]:
        """Each parameter's element count, in flat order."""
        return [math.prod(s) for s in self.shapes]

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(accumulate(self.sizes[:-1], initial=0))

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def padded(self) -> int:
        return -(-self.numel // self.world) * self.world

    @property
    def shard(self) -> int:
        return self.padded // self.world

    def views(self, rank: int) -> list[ShardView]:
        """The class ranges of `rank`'s shard, in flat order (padding excluded). A class's
        parameters lie end to end (`plan_units` sorts by class), so each range is the
        shard's part of one class, named after its first parameter there."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        out: list[ShardView] = []
        for name, key, off, n in zip(self.names, self.keys, self.offsets, self.sizes):
            a, b = max(off, lo) - lo, min(off + n, hi) - lo
            if a >= b:
                continue
            if out and out[-1].key == key:
                out[-1] = replace(out[-1], stop=b)
            else:
                out.append(ShardView(f"zero:{self.name}:{name}", key, a, b))
        return out

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` [padded] as its parameters' views, each in its shape (padding left out)."""
        pieces = flat.split([*self.sizes, self.padded - self.numel])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]


def class_key(name: str, replicated: tuple[str, ...], axis: str = "fsdp") -> ClassKey:
    """`axis`: what the shards split (fsdp; ep_data for expert weights), so not a copy."""
    return (decays(name), tuple(a for a in replicated if a not in ("fsdp", axis)))


def plan_units(
    named_shapes: list[tuple[str, tuple[int, ...]]],
    replicated: dict[str, tuple[str, ...]],
    world: int,
    spec: ModelSpec,
    axis: str = "fsdp",
) -> list[UnitSlots]:
    """Units in forward order (root first, then blocks as the model holds them)."""
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {ROOT: []}
    for name, shape in named_shapes:  # a unit: a parameter's transformer block, or the root
        groups.setdefault(spec.block_of(name) or ROOT, []).append((name, tuple(shape)))
    out = []
    for unit, members in groups.items():
        if not members:
            continue
        keyed = [(class_key(n, replicated[n], axis), n, s) for n, s in members]
        # decaying classes first, then by replication; stable, so model order within a class
        keyed.sort(key=lambda t: (not t[0][0], t[0][1]))
        keys, names, shapes = zip(*keyed)
        out.append(UnitSlots(unit, names, shapes, keys, world))
    return out


# --- the runtime --------------------------------------------------------------------------


class FlatUnit:
    """One unit's buffers on this rank: flat compute params, fp32 master and grad shards."""

    def __init__(self, layout: UnitSlots, model: nn.Module, rank: int, stage: int, dtype, device):
        self.layout, self.rank = layout, rank
        self.targets = [_owner(model, n) for n in layout.names]
        self.flat = torch.zeros(layout.padded, dtype=dtype, device=device).requires_grad_()
        # `.data` aliases the storage with its own version counter: gathers and the
        # optimizer write through it without invalidating tensors autograd saved.
        self.data = self.flat.data
        lo, hi = rank * layout.shard, (rank + 1) * layout.shard
        # mixed precision: the master shard from the fp32 values, not their bf16 rounding
        full = torch.zeros(layout.padded, device=device) if mixed(dtype) else self.data
        # the materialised parameters into it, dropped from their modules
        for (module, attr), piece in zip(self.targets, layout.split(full)):
            piece.copy_(getattr(module, attr).detach())
            del module._parameters[attr]
        if full is not self.data:
            self.data.copy_(full)
        # an fp32 master shard is a view of the compute buffer, but for ZeRO-3's (freed)
        self.master = full[lo:hi] if full is self.data and stage < 3 else full[lo:hi].clone()
        self.views = layout.views(rank)
        self.params = [(v.name, nn.Parameter(self.master[v.start : v.stop])) for v in self.views]
        # the fp32 gradient shard: stage 1 keeps it (in fp32, as a slice of the full
        # gradient it is reduce-scattered into in place); stages 2-3 create it when the
        # reduction lands and drop it after the step, so it never adds to the backward peak
        self.grad: torch.Tensor | None = None
        if stage == 1:  # (in fp32 a view: no copy)
            self.flat.grad = torch.zeros_like(self.data)
            self.attach_grad(self.flat.grad[lo:hi].to(self.master.dtype))
        self.installed = False  # whether this forward pass already has the views
        self.gathered, self.pending = True, None  # pending: (Work, its input) in flight
        self.fp8: Float8Gather | None = None  # its FP8 linears' weights gathered in FP8
        self.quantized: QuantizedReduce | None = None  # its compressed reduce-scatter's state
        self.reduced = False

    def attach_grad(self, grad: torch.Tensor | None) -> None:
        """Make `grad` (fp32, one shard) the gradient of this unit's optimizer views."""
        self.grad = grad
        for (_, p), v in zip(self.params, self.views):
            p.grad = None if grad is None else grad[v.start : v.stop]

    def install(self) -> None:
        """Point every module attribute at a fresh view of the flat buffer (for this pass)."""
        for (module, attr), piece in zip(self.targets, self.layout.split(self.flat)):
            setattr(module, attr, piece)
        # a block is one module, called once a pass; the root's modules share one install
        self.installed = self.layout.name == ROOT

    def end_pass(self) -> None:
        self.installed = False

    def free(self) -> None:
        self.data.untyped_storage().resize_(0)
        if self.fp8 is not None:
            self.fp8.free()
        self.gathered = False

    def allocate(self) -> None:
        if self.data.untyped_storage().nbytes() != self.data.nbytes:  # its shape stays [padded]
            self.data.untyped_storage().resize_(self.data.nbytes)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr  # "": the model itself


class ZeroShards:
    """The sharded state of one rank and the hooks that gather, free and reduce it.

    It is a `GradSync` (the engine's gradient-sync protocol), so the microbatch loop or a
    pipeline schedule drives it exactly as it drives data parallelism's buckets.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        comm: Comm,
        job: Layout,
        replicated,
        spec: ModelSpec,
        tied: tuple[str, Group] | None = None,
        exclude: Collection[str] = (),
        axis: str = "fsdp",
    ):
        """`exclude`: parameters left as they are, for another sync (expert weights).
        `axis`: the group the shards split, "fsdp", or "ep_data" for the expert weights
        (a second set of shards over the ranks holding the same experts: no replicas).
        The layout's `compress` ("int8", "fp8") reduce-scatters each unit's gradient in
        that block format (parallel/compress.py); replicas then sum their shards as is."""
        self.comm = comm
        # (name, group): a parameter another rank also holds (the embedding tied across
        # the pipeline's ends), its full gradient summed over `group` before the scatter
        self.tied = tied
        # a shard's copies: one per dp replica and per cp rank (cp ranks hold other tokens
        # of the same sequences, so their gradients are summed like dp's)
        self.axis = axis
        self.group = mesh[axis]
        self.dp: Group | None = mesh["replica"] if axis == "fsdp" else None
        self.stage = job.zero_stage
        self.reshard_after_forward = job.reshard_after_forward
        self.reduce_dtype = job.reduce_dtype
        self.device = next(model.parameters()).device
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters() if n not in exclude]
        layouts = plan_units(named, replicated, self.group.size, spec, axis)
        self.units = [self._build(u, model, job.compute_dtype) for u in layouts]
        if job.compress:  # (the group is sharded: two ranks or more)
            for u in self.units:
                u.quantized = QuantizedReduce(u.layout.padded, self.group, comm, *job.compression)
        # --fp8-all-gather: each weight's scale, max-reduced over the shards once a step
        self.scales = self._float8_gathers() if job.fp8_all_gather else None
        self.stale = True  # the scales predate the master weights (a step, a load)
        self.prefetch_midway: set[str] = set()  # blocks that prefetch from their middle
        self.sync = True
        # reduce-scatters in flight (unit, work, full gradient, shard), then dp all-reduces
        self.scattering: list[tuple[FlatUnit, Work | PieceWork, torch.Tensor, torch.Tensor]] = []
        self.replicating: list[tuple[FlatUnit, torch.Tensor, Work]] = []
        self.tying: list[tuple[FlatUnit, Work, torch.Tensor]] = []  # tied sums in flight
        self.armed: set[int] = set()  # units whose next accumulation is their last
        self.done: set[str] = set()  # parameters whose last backward work has run
        self._register_hooks(model, spec, job.compiled)

    def _float8_gathers(self) -> torch.Tensor:
        """Give each unit holding FP8 linears its `Float8Gather`; returns the scales of all
        their weights end to end, each gather's linears bound to theirs."""
        for u in self.units:
            at = zip(u.layout.offsets, u.layout.shapes, u.targets)
            linears = [(off, shape, m) for off, shape, (m, attr) in at
                       if isinstance(m, Float8Linear) and attr == "weight"]  # fmt: skip
            if linears:
                lay = u.layout
                args = (lay.numel, lay.padded, u.rank, lay.world, u.data.dtype, self.device)
                u.fp8 = Float8Gather(linears, *args)
        gathers = [u.fp8 for u in self.units if u.fp8 is not None]
        scales = torch.ones(sum(g.groups for g in gathers), device=self.device)
        for g, part in zip(gathers, scales.split([g.groups for g in gathers])):
            g.bind(part)
        return scales

    def _refresh_scales(self) -> None:
        """Every FP8-gathered weight's scale from the masters: one all-reduce (max) of
        each weight's amax over this rank's shard, the same point on every rank (the
        first gather after a step or a load)."""
        units = [u for u in self.units if u.fp8 is not None]
        amax = max_over(self.comm, self.group)(torch.cat([u.fp8.amax(u.master) for u in units]))
        self.scales.copy_(scale_of(amax, E4M3))
        self.stale = False

    def reduce_in_backward(self, on: bool) -> None:
        """See `GradSync`: off, a unit reduces only when armed by `final`."""
        self.sync = on

    def _build(self, layout: UnitSlots, model: nn.Module, dtype: torch.dtype) -> FlatUnit:
        unit = FlatUnit(layout, model, self.group.rank, self.stage, dtype, self.device)
        if self.stage == 3:
            unit.free()  # now, so that building never holds two full copies of the model
        else:
            unit.install()  # the attributes are real tensors between steps
            unit.end_pass()
        return unit

    # --- hooks ---------------------------------------------------------------------------
    def _register_hooks(self, model: nn.Module, spec: ModelSpec, compiled: bool) -> None:
        for u in self.units:
            u.flat.register_post_accumulate_grad_hook(lambda _, u=u: self._post_backward(u))
            if u.layout.name != ROOT:
                block = model.get_submodule(u.layout.name)
                block.register_forward_pre_hook(lambda *_, u=u: self._pre_forward(u, True))
                block.register_forward_hook(lambda _, __, out, u=u: self._post_forward(u, out))
                # the middle of its backward: its second-to-last child's output gradient (a
                # pre-norm block's second norm, before its MLP). A compiled body's backward
                # is one node: it has no middle, and a hook traced into it would give each
                # block a graph of its own
                children = list(block.children())
                if not compiled and len(children) >= 2:
                    self.prefetch_midway.add(u.layout.name)
                    children[-2].register_forward_hook(lambda _, __, o, u=u: self._midway(u, o))
        root = next((u for u in self.units if u.layout.name == ROOT), None)
        if root is None:
            return
        paths = list(dict.fromkeys(n.rpartition(".")[0] for n in root.layout.names))
        order = spec.roots  # the order forward uses them in
        paths.sort(key=lambda p: order.index(p) if p in order else 1)
        if not getattr(model, "logits", True):  # a fused loss reads the head's weight, never
            paths = [p for p in paths if p != spec.head]  # calls it: the norm installed it
        for path in paths:
            module = model.get_submodule(path)
            embed = path == spec.embedding
            module.register_forward_pre_hook(lambda *_, e=embed: self._pre_forward(root, e))
            if not embed:  # the head side: its backward comes first
                module.register_forward_hook(lambda _, __, out: self._post_forward(root, out))
        # the root's views serve one whole pass (one split, one gradient concatenation)
        model.get_submodule(paths[-1]).register_forward_hook(lambda *_: root.end_pass())

    def _pre_forward(self, unit: FlatUnit, prefetch: bool) -> None:
        self.ensure(unit)
        if not unit.installed:
            unit.install()
        if prefetch:
            self.prefetch(self._neighbour(unit, +1))

    def _post_forward(self, unit: FlatUnit, out) -> None:
        training = torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad
        if training:
            out.register_hook(lambda _: self._pre_backward(unit))
        if self._resharding(unit) and (self.reshard_after_forward or not training):
            unit.free()

    def _pre_backward(self, unit: FlatUnit) -> None:
        self.ensure(unit)
        if unit.layout.name not in self.prefetch_midway:
            self.prefetch(self._neighbour(unit, -1))

    def _midway(self, unit: FlatUnit, out) -> None:
        """Prefetch the previous block once this one's backward is past its middle (its
        FFN half done): the gather then overlaps the rest of the block's backward, and it
        lands after the FFN's activations are freed, not on top of the step's peak."""
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _: self.prefetch(self._neighbour(unit, -1)))

    def _post_backward(self, unit: FlatUnit) -> None:
        final = self.sync or id(unit) in self.armed
        if final and not unit.reduced:
            self._reduce(unit, bounded=self.sync)
        if self._resharding(unit) and (final or self.reshard_after_forward):
            unit.free()

    @contextmanager
    def final(self, names: Collection[str]) -> Iterator[None]:
        """The backward work inside is the step's last for the parameters `names` (a
        pipeline stage's last B, BW or W): a unit all of whose parameters are then done
        reduces as soon as autograd accumulates into it, or when the work ends (W's
        weight gradients arrive outside autograd). Waits for nothing."""
        done = self.done | set(names)
        armed = [u for u in self.units if not u.reduced and done.issuperset(u.layout.names)]
        self.armed.update(id(u) for u in armed)
        try:
            yield
        finally:
            self.armed.difference_update(id(u) for u in armed)
        self.done = done
        for u in armed:
            if not u.reduced:
                self._reduce(u, bounded=False)
            if self._resharding(u) and u.gathered and u.pending is None:
                u.free()  # a block kept gathered (no reshard after forward) is done

    def _resharding(self, unit: FlatUnit) -> bool:
        """Stage 3 frees blocks between uses; the root waits for the step's end."""
        return self.stage == 3 and unit.layout.name != ROOT

    def _neighbour(self, unit: FlatUnit, step: int) -> FlatUnit | None:
        """The next block to run forward (+1) or backward (-1); the root counts as
        block -1 forward and as block L backward."""
        blocks = [u for u in self.units if u.layout.name != ROOT]
        if unit.layout.name == ROOT:
            i = 0 if step > 0 else len(blocks) - 1
        else:
            i = blocks.index(unit) + step
        return blocks[i] if 0 <= i < len(blocks) else None

    # --- gathers -------------------------------------------------------------------------
    def prefetch(self, unit: FlatUnit | None) -> None:
        """Start gathering `unit` asynchronously unless it is gathered or on its way."""
        if unit is None or unit.gathered or unit.pending is not None:
            return
        unit.allocate()
        if unit.fp8 is not None:
            if self.stale:
                self._refresh_scales()
            unit.pending = unit.fp8.start(unit.master, self.comm, self.group)
            return
        source = unit.master.to(unit.data.dtype)  # the compute dtype: bf16 gathers half
        work = self.comm.all_gather(unit.data, source, self.group, async_op=True)
        unit.pending = (work, source)

    def ensure(self, unit: FlatUnit) -> None:
        """Make `unit`'s full compute parameters valid (waiting for its prefetch, if any)."""
        self.prefetch(unit)  # (nothing if gathered or on its way)
        if unit.pending is not None:
            unit.pending[0].wait()
            if unit.fp8 is not None:
                unit.fp8.land(unit.data)
            unit.pending, unit.gathered = None, True

    def drain(self) -> None:
        """Wait for every gather in flight (before reading or tearing down)."""
        for u in self.units:
            if u.pending is not None:
                self.ensure(u)

    # --- gradient reduction --------------------------------------------------------------
    def _reduce(self, unit: FlatUnit, bounded: bool = True) -> None:
        """Launch the reduction of `unit`'s full gradient into its shard. `bounded` (a
        backward's hooks) first waits for all but the latest reduce-scatter, which bounds
        the full gradients alive at once, as FSDP does; a pipeline, whose accumulation
        keeps them all anyway, only collects the finished ones."""
        self._settle(keep=1 if bounded else 0, waiting=bounded)
        full = unit.flat.grad
        if full is None:  # the unit took no part in this step's backward
            full = torch.zeros_like(unit.data)
        send = full.to(self.reduce_dtype)
        unit.reduced = True
        if self.stage > 1:
            unit.flat.grad = None  # `send` keeps it alive until the reduction is done
        names = unit.layout.names
        if self.tied is None or self.tied[0] not in names:
            self._scatter(unit, send)
        else:  # the other end of the pipeline gets there in its own time: the scatter
            # waits for `finish`, where every fsdp rank issues it at the same point
            tied = unit.layout.split(send)[names.index(self.tied[0])]
            work = self.comm.all_reduce(tied, self.tied[1], async_op=True)
            self.tying.append((unit, work, send))

    def _scatter(self, unit: FlatUnit, send: torch.Tensor) -> None:
        if self.stage == 1 and self.reduce_dtype == unit.grad.dtype:
            out = unit.grad  # straight into the kept shard (in place in an fp32 gradient)
        else:
            out = torch.empty(unit.layout.shard, dtype=self.reduce_dtype, device=send.device)
        quantized = unit.quantized
        if quantized is None:
            work = self.comm.reduce_scatter(out, send, self.group, async_op=True)
        else:
            quantized.start(send)
            work = PieceWork(quantized, out)
        self.scattering.append((unit, work, send, out))

    def _settle(self, keep: int, waiting: bool = True) -> None:
        """Wait for all but the `keep` latest reduce-scatters, drop their full gradients,
        and start all-reducing their shards over the dp replicas (HSDP). Not `waiting`:
        only those already done, oldest first (so the dp all-reduces start in the same
        order on every replica)."""
        while len(self.scattering) > keep and (waiting or self.scattering[0][1].is_completed()):
            unit, work, _, out = self.scattering.pop(0)  # its full gradient dropped here
            work.wait()
            if self.dp is not None:
                work = self.comm.all_reduce(out, self.dp, async_op=True)
            self.replicating.append((unit, out, work))  # (done already without replicas)

    def finish(self) -> None:
        """Reduce what backward did not, and wait for every reduction of the step."""
        for u in self.units:  # a fixed order, the same on every rank
            if not u.reduced:
                self._reduce(u)
        for unit, work, send in self.tying:
            work.wait()
            self._scatter(unit, send)
        self.tying.clear()
        self.done.clear()
        self._settle(keep=0)
        for unit, out, work in self.replicating:
            work.wait()
            if self.stage == 1 and out is not unit.grad:
                unit.grad.copy_(out)
            elif self.stage > 1:
                unit.attach_grad(out.to(unit.master.dtype))  # no-op when reduced in it
        self.replicating.clear()
        for u in self.units:
            u.reduced = False
        if self.stage == 3:
            self.drain()  # a prefetch no pass used (a pipeline's chunk boundary)
            for u in self.units:
                if u.gathered:
                    u.free()

    def zero_grad(self) -> None:
        for u in self.units:
            if self.stage == 1:
                u.flat.grad.zero_()
                u.grad.zero_()
            else:
                u.attach_grad(None)

    def after_step(self) -> None:
        """Stages 1-2: all-gather the updated shards (all launched, then all awaited: a
        gather left in flight past the last step aborts the process at exit). Stage 3 with
        FP8 gathers: the next one first takes the new weights' scales."""
        self.stale = True
        if self.stage < 3:
            for u in self.units:
                u.gathered = False
                self.prefetch(u)
            self.drain()

    def held(self) -> Held:
        """fp32: the master shards are the parameters (views of them below stage 3);
        mixed precision: the compute buffers, and the masters beside them. A compressed
        reduction's residuals count with the gradients."""
        two = any(mixed(u.data.dtype) for u in self.units)
        masters = [u.master for u in self.units]
        params = [u.data for u in self.units] + ([] if two else masters)
        grads = [u.flat.grad for u in self.units] + [u.grad for u in self.units]
        grads += [u.quantized.sent.error for u in self.units if u.quantized is not None]
        return Held(params, grads, masters if two else [])

    def residuals(self) -> dict[str, Residual]:
        """Each unit's compressed reduce-scatter's sender residual, "<axis>.<unit>.sent"."""
        out: dict[str, Residual] = {}
        for u in (u for u in self.units if u.quantized is not None):
            out |= u.quantized.residuals(f"{self.axis}.{u.layout.name}", False)
        return out

    # --- views for the engine ------------------------------------------------------------
    def params(self) -> list[tuple[str, nn.Parameter]]:
        """The optimizer's tensors: this rank's shard views of the fp32 master weights."""
        return [np for u in self.units for np in u.params]

    def view_replicated(self) -> dict[str, tuple[str, ...]]:
        """Replicated axes of each optimizer view (fsdp is what its shards split)."""
        return {v.name: v.key[1] for u in self.units for v in u.views}
