"""The pipeline runtime: execute this rank's program, one item at a time.

The program (`p2p.program`) says when to post each batch of sends and receives, when to
wait for them and when to compute; it is the one the checker proves deadlock-free under
NCCL's and gloo's semantics. Tensors that cross stages on the same rank (zb-v's V turn)
go through the same mailbox as received ones, without a transfer. Every compute is timed
on the device (`devices.Clock`), so a step's measured timeline can be compared with the
simulator's prediction for the same lists.

A stage output is freed as soon as its send is done (Megatron's trick): the autograd node
stays, the tensor's storage is swapped for an empty one, and backward starts from the
node's gradient edge, which needs no shape check against the freed data.

Gradient reductions overlap the rest of the schedule: the last B, BW or W of each stage
(its last microbatch's backward work) runs inside `grads.final(names)`, naming the
parameters whose gradients it completes, so DP buckets and ZeRO units launch their
reductions during it or right after it, not after the schedule; `grads.finish` then only
waits (and launches what no action completed: a parameter the schedule never touched).
Every async collective of the step is recorded (`Comm.trace`): the timeline's
communication lane.

Per-action overhead is kept off the schedule's path: the loop never waits for the device
(on a GPU, computes and transfers are only enqueued; the runtime's one host read is the
trainer's, after the schedule; what the model's layers read is theirs: docs/architecture.md),
the step's inputs and targets go to the device once,
before the loop, and receive buffers are reused across microbatches: a buffer returns to
the pool once nothing the meter counts (autograd's saved tensors, deferred-W inputs)
still refers to it, which is after the backward that consumed it. The meter's saved-tensor
hooks run only on the steps that count (`train.meter_every`: the first, by default);
the steps between free and pool by what the last counting step saw, and count only the
runtime's own holds. A step's graph may differ from the counted one (a data-dependent
branch), so each such decision is checked where it acts, by reference counts: an output
is freed only if nothing else holds it, a pooled buffer reused only if nothing else refers
to its storage; when a check fails the runtime does the safe thing and the next step counts.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from tetrad.comm import Comm, Flight, Work
from tetrad.devices import Clock
from tetrad.layout import Layout
from tetrad.mesh import Mesh
from tetrad.models.batch import Microbatch
from tetrad.models.spec import ModelSpec
from tetrad.parallel.activation_meter import ActivationMeter, alone, held_as_is
from tetrad.parallel.pipeline.edge import backward_from, backward_takes_edges
from tetrad.parallel.pipeline.p2p import Post, Wait, Wire, program
from tetrad.parallel.pipeline.schedules import (
    Action,
    StageMb,
    build_schedule,
    placement,
    wire,
)
from tetrad.parallel.pipeline.stage import Chunk
from tetrad.parallel.pipeline.timeline import Event
from tetrad.parallel.pipeline.weightgrad import WeightGradStore, defer_weight_grads
from tetrad.parallel.runner import Denominator, GradSync, LossFn, RunResult

# receives posted this many computes early, so their transfer overlaps the compute: gloo
# (CPU) posts each on its own; on NCCL's in-order stream only 0 is safe (see p2p.py)
EARLY = {"cpu": 1, "cuda": 0}
# gradient sends left in flight past their program's wait, at most (their buffers: one
# activation gradient each, on top of what the planner counts)
LATE_SENDS = 2
# the timeline's communication lane: its kind for each async collective
LANE = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "all_to_all": "A2A"}


@dataclass(kw_only=True)
class PipelineStep(RunResult):
    """Everything one optimizer step's schedule keeps between actions (and its result)."""

    denom: Denominator
    box: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    recvs: dict[tuple[str, int, int], tuple[Work, torch.Tensor]] = field(default_factory=dict)
    sends: dict[Wire, tuple[Work, torch.Tensor]] = field(default_factory=dict)  # in flight
    inputs: dict[StageMb, torch.Tensor] = field(default_factory=dict)
    outputs: dict[StageMb, torch.Tensor] = field(default_factory=dict)
    # this step's microbatch inputs and targets, on the device (moved once, before the loop)
    inputs_of: list = field(default_factory=list)
    targets_of: list = field(default_factory=list)
    parked: dict[StageMb, list[torch.Tensor]] = field(default_factory=dict)  # until their W
    late: list[Wire] = field(default_factory=list)  # gradient sends past their wait, in flight
    # timed computes: (kind, stage, microbatch, start mark, end mark) of `clock`
    marks: list = field(default_factory=list)
    clock: Clock | None = None
    flights: list[Flight] = field(default_factory=list)  # the step's async collectives

    @property
    def events(self) -> list[Event]:
        """The timed computes in seconds; read only when looked at, since on a GPU that
        waits for them (the step's own host sync has usually done so already)."""
        read = self.clock.seconds
        return [Event(k, s, mb, read(t0), read(t1)) for k, s, mb, t0, t1 in self.marks]

    @property
    def comm_events(self) -> list[Event]:
        """The step's async collectives as timeline events (kind AR, RS, AG or A2A, on the
        host's clock; stage and microbatch -1), launched to completed."""
        return [
            Event(LANE[f.op], -1, -1, f.start, f.end if f.end is not None else f.start)
            for f in self.flights
            if f.op in LANE
        ]


class PipelineRuntime:
    """Runs one rank's program against its chunks of the model (the engine's `Runner`).

    Built from the rank's schedule: with W actions its
    model's weight gradients are deferred (`defer_weight_grads`). `dim`: the model's
    hidden size (what crosses a stage boundary per token); `spec`: its family's, which
    names the parameters each stage's backward completes."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        mesh: Mesh,
        comm: Comm,
        chunks: list[Chunk],
        loss_fn: LossFn,
        dim: int,
        meter_every: int,
        spec: ModelSpec,
    ):
        actions = build_schedule(
            layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages
        )
        mine = actions[mesh["pp"].rank]
        self.store = WeightGradStore() if any(a.kind == "W" for a in mine) else None
        if self.store is not None:
            defer_weight_grads(model, self.store, spec)
        backward_takes_edges()  # probed here, once: not a first call inside the schedule loop
        if comm.device.type == "cuda":
            # NCCL creates a communicator on its first use, with every member; torch requires
            # that batched p2p not be that first use unless every rank joins the same batch
            comm.barrier(mesh["pp"])
        self.items = program(actions, early=EARLY[comm.device.type])[mesh["pp"].rank]
        self.model, self.mesh, self.comm, self.loss_fn = model, mesh, comm, loss_fn
        self.chunks = {c.stage: c for c in chunks}
        # this rank's share of a microbatch, in the compute dtype (given: built before the
        # data axis casts the parameters to it)
        self.act_shape = (layout.microbatch_size, layout.act_seq, dim)
        self.dtype = layout.compute_dtype
        self.meter, self.meter_every = ActivationMeter(), meter_every
        self.holds_loss = any(c.last for c in chunks)
        self.device = next(model.parameters()).device
        self.clock = Clock(self.device)
        # (kind, stage, microbatch) -> the parameters whose gradients that action completes
        names = [n for n, _ in model.named_parameters()]
        self.finals = final_actions(mine, chunks, names, spec)
        self.pool: list[torch.Tensor] = []  # free receive buffers, reused across microbatches
        self.allocated = 0  # receive buffers ever allocated (the pool's size, at most)

    def run(self, micro: list[Microbatch], denom: Denominator, grads: GradSync) -> PipelineStep:
        """Execute the whole schedule for one optimizer step. A stage's reductions start
        with its last backward work (`grads.final`); `grads.finish` waits for them."""
        grads.reduce_in_backward(False)  # only `final`: a stage's last backward is not the step's
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        st = PipelineStep(loss=loss, denom=denom, clock=self.clock)
        self.comm.trace_into(st.flights)  # until the next step: finish's waits land in it too
        first = any(c.first for c in self.chunks.values())
        # a copy on every device (a GPU's already): a microbatch is a view of the step's
        # batch, whose whole storage the meter would count where autograd saves the view
        move = lambda t: t.to(self.device, non_blocking=True, copy=True)  # noqa: E731
        st.inputs_of = [move(mb.inputs) for mb in micro] if first else []
        st.targets_of = [move(mb.targets) for mb in micro] if self.holds_loss else []
        self.meter.measure(self.meter_every)
        self.meter.reset([*self.model.parameters(), *grads.held().params])
        for item in self.items:
            if isinstance(item, Post):
                self._post(st, item.ops)
            elif isinstance(item, Wait):
                self._wait(st, item.ops)
            else:
                t0 = self.clock.mark()
                names = self.finals.get((item.kind, item.stage, item.microbatch))
                # a stage's last backward work (`names`): its reductions start now
                with grads.final(names) if names is not None else nullcontext():
                    self._compute(st, item)
                st.marks.append((item.kind, item.stage, item.microbatch, t0, self.clock.mark()))
        self._reap(st, block=True)
        st.peak_activation_bytes = self.meter.finish()
        return st

    # --- transfers ----------------------------------------------------------------------
    def _post(self, st: PipelineStep, ops: tuple[Action, ...]) -> None:
        """One batch: each send's tensor from the mailbox, a pooled buffer for each receive."""
        batch = []
        for a in ops:
            send = a.kind.startswith("SEND")
            tensor = st.box.pop(wire(a)) if send else self._buffer()
            batch.append(("send" if send else "recv", tensor, self.mesh["pp"].ranks[a.peer]))
        works = self.comm.batch_p2p(batch, self.mesh["pp"])
        for a, work, (op, t, _) in zip(ops, works, batch, strict=True):
            (st.sends if op == "send" else st.recvs)[wire(a)] = (work, t)
            out = st.outputs.get((a.stage - 1, a.microbatch)) if a.kind == "SEND_F" else None
            if out is not None and self._frees(a.stage - 1, out):
                out.data = torch.empty(0, dtype=out.dtype, device=out.device)

    def _frees(self, s: int, out: torch.Tensor) -> bool:
        """Whether stage s's sent output may give up its storage to the send buffer: only
        our own hold counts it, autograd did not save it (learned on a counting step),
        and, checked on every step, nothing else holds the output itself (autograd saving
        it as an input would read the emptied tensor) and it is not a received input
        passed through (a leaf: emptying it would empty a pooled buffer)."""
        if self.meter.learned(("saved", s), lambda: self.meter.references(out) != 1):
            return False
        if out.grad_fn is None or held_as_is(out):
            self.meter.recount()  # not the counted step's graph
            return False
        return True

    def _buffer(self) -> torch.Tensor:
        """A receive buffer: a free one from the pool, or a new one. The pool holds what
        the counted step's graph let go of; a buffer that, on this step, something still
        refers to (a different graph kept it) is left to the allocator instead of being
        overwritten, and the next step counts again."""
        while self.pool:
            buf = self.pool.pop()
            if alone(buf):
                # autograd reading it as saved after all (held as is: `alone` cannot see
                # that) now fails loudly on the version check instead of reading new data
                torch.autograd.graph.increment_version(buf)
                return buf
            self.meter.recount()
        self.allocated += 1
        return torch.empty(self.act_shape, dtype=self.dtype, device=self.device)

    def _release(
        self,
        buf: torch.Tensor,
        st: PipelineStep | None = None,
        key: StageMb = (0, 0),
        role: str = "",
    ) -> None:
        """Back to the pool, unless something still refers to it: a deferred W holding
        it (an output gradient that passed through a residual unchanged) parks it until
        that W has run (`st`, `key`); anything else (autograd, seen on a step that counts
        saved tensors and remembered per stage for the steps that do not) leaves it to
        the allocator."""
        # after a backward (`st`): does autograd still hold stage key[0]'s `role` buffer?
        held = lambda: self.meter.references(buf) > self.meter.holds(buf)  # noqa: E731
        if st is not None and self.meter.learned(("kept", key[0], role), held):
            return
        if self.meter.references(buf) == 0:
            buf.requires_grad_(False)
            buf.grad = None
            self.pool.append(buf)
        elif st is not None:
            st.parked.setdefault(key, []).append(buf)

    def _wait(self, st: PipelineStep, ops: tuple[Action, ...]) -> None:
        """Receives land in the mailbox (waited for: a compute needs them). A stage
        output's send is waited for here, then freed, as the planner's activation model
        has it (`plan.activations.peak_in_flight`). A gradient's send is only reaped: if
        done, dropped; if not, it stays in flight, is looked at again at every later
        wait, and is waited for at the step's end. Blocking on it would idle this rank
        until its peer posts the matching receive (sends are rendezvous on gloo and
        NCCL), time the schedule does not ask for; a later host wait cannot deadlock
        anything, since every transfer is already posted in the proven order. At most
        `LATE_SENDS` stay in flight."""
        for a in ops:
            if a.kind.startswith("RECV"):
                work, buf = st.recvs.pop(wire(a))
                work.wait()
                st.box[wire(a)] = buf
            elif a.kind == "SEND_F":
                work, _ = st.sends.pop(wire(a))
                work.wait()
                self.meter.drop(wire(a))
            else:
                st.late.append(wire(a))
        self._reap(st)

    def _reap(self, st: PipelineStep, block: bool = False) -> None:
        """Finish the late sends that are done, and the oldest beyond `LATE_SENDS` (all
        of them if `block`), freeing their buffers. gloo reports a p2p work done only
        once waited for, so there the bound is what frees them during the step."""
        pending = []
        for k, key in enumerate(st.late):
            work, _ = st.sends[key]
            if block or len(st.late) - k > LATE_SENDS or work.done():
                work.wait()
                del st.sends[key]
                self.meter.drop(key)
            else:
                pending.append(key)
        st.late = pending

    # --- compute ------------------------------------------------------------------------
    def _compute(self, st: PipelineStep, a: Action) -> None:
        if a.kind == "F":
            self._forward(st, a.stage, a.microbatch)
        elif a.kind in ("B", "BW"):
            self._backward(st, a.stage, a.microbatch, split=a.kind == "B")
        elif a.kind == "W":
            self.store.flush((a.stage, a.microbatch))
            self.meter.drop(("W", a.stage, a.microbatch))
            for buf in st.parked.pop((a.stage, a.microbatch), []):
                self._release(buf)
        else:
            raise ValueError(f"unknown compute action {a}")

    def _forward(self, st: PipelineStep, s: int, i: int) -> None:
        chunk = self.chunks[s]
        if chunk.first:
            x = st.inputs_of[i]
        else:
            x = st.box.pop(("F", s, i)).requires_grad_(True)
            st.inputs[(s, i)] = x
        with self.meter.saving():
            out = self.model.forward_span(x, list(chunk.layers), chunk.first, chunk.last)
            if chunk.last:  # the last stage's output is its loss
                out = self.loss_fn(out, st.targets_of[i]) / st.denom.value()
        st.outputs[(s, i)] = out
        if chunk.last:
            st.loss += out.detach().double()
        else:
            st.box[("F", s + 1, i)] = out.detach()  # sent, or handed to the local next stage
            self.meter.hold(("F", s + 1, i), [out])  # until its send is done, or its backward

    def _backward(self, st: PipelineStep, s: int, i: int, split: bool) -> None:
        chunk = self.chunks[s]
        out = st.outputs.pop((s, i))
        grad = None if chunk.last else st.box.pop(("B", s, i))
        with self.store.filing((s, i)) if self.store is not None else nullcontext():
            if chunk.last:
                torch.autograd.backward(out)
            else:  # from its autograd node: `out`'s storage may already be freed
                backward_from(out, grad)
        if not chunk.last and ("F", s + 1, i) not in st.sends:
            self.meter.drop(("F", s + 1, i))  # handed to a local next stage, never sent
        if self.store is not None:
            if not split:
                self.store.flush((s, i))
            else:  # the inputs and output gradients W will need stay alive until then
                filed = self.store.pending.get((s, i), [])
                self.meter.hold(("W", s, i), [t for f in filed for t in (f.x, f.grad)])
        if not chunk.first:
            x = st.inputs.pop((s, i))
            st.box[("B", s - 1, i)] = x.grad  # gradient of stage s-1's output
            if (s - 1) not in self.chunks:  # received, not handed over by a local stage
                self._release(x, st, (s, i), "input")
        if grad is not None and (s + 1) not in self.chunks:
            self._release(grad, st, (s, i), "grad")


def final_actions(
    actions: list[Action], chunks: list[Chunk], names: list[str], spec: ModelSpec
) -> dict[tuple[str, int, int], frozenset[str]]:
    """For each compute action, the parameters whose gradients are complete once it has
    run: those of the stages whose last backward work (B, BW or W) it is, less any a
    later action still adds to (a parameter two of the rank's stages share). A stage's
    parameters (of `names`, this rank's) are its family's `spec.stage_parameters`: its
    blocks, the embedding on the first stage, the final norm and the head (or the
    embedding it is tied to) on the last."""
    chunk = {c.stage: c for c in chunks}
    last: dict[str, tuple[str, int, int]] = {}
    for a in actions:
        if a.kind in ("B", "BW", "W"):
            c = chunk[a.stage]
            for name in spec.stage_parameters(names, c.layers, c.first, c.last):
                last[name] = (a.kind, a.stage, a.microbatch)
    return {k: frozenset(n for n in last if last[n] == k) for k in dict.fromkeys(last.values())}


def tied_across_stages(layout: Layout, tied: bool, mesh: Mesh) -> bool:
    """Whether a tied embedding (`tied`: the model ties one) lives on two ranks (first and
    last stage) whose gradients must be summed; zb-v's V puts both stages on one rank."""
    if not tied or layout.pp == 1:
        return False
    place = placement(layout.pp, layout.virtual_stages, layout.schedule)
    return place(0) != place(layout.stages - 1) and mesh["pp_ends"].size > 1
