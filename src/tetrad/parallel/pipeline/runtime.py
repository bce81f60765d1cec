"""The pipeline runtime: execute this rank's schedule, one `Step` at a time.

A step posts its receives early (non-blocking, in the order the peer sends them), waits
for the ones its compute needs, runs the compute (F, B, W or BW) and posts its sends
non-blocking. Tensors that cross stages on the same rank (zb-v's V turn) go through the
same mailbox as received ones, without a transfer. Every compute is timed, so a step's
measured timeline can be compared with the simulator's prediction for the same lists.

A stage output is freed as soon as its send is done (Megatron's trick): the autograd node
stays, the tensor's storage is swapped for an empty one, and backward starts from the
node's gradient edge, which needs no shape check against the freed data. gloo completes
a send only once the peer has posted the matching receive, so the runtime waits for a
send at the first step by which, in the schedule's unit-cost simulation, that receive is
posted (`send_releases`): a wait the simulated run already satisfies cannot close a cycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from tetrad.comm import Comm, Work
from tetrad.config import DTYPES, Config
from tetrad.mesh import Mesh
from tetrad.models.batch import Microbatch
from tetrad.parallel.pipeline.measure import ActivationMeter
from tetrad.parallel.pipeline.schedules import (
    Action,
    Step,
    build_schedule,
    stage_to_rank,
    steps,
    wire,
)
from tetrad.parallel.pipeline.simulate import Costs, simulate
from tetrad.parallel.pipeline.stage import Chunk
from tetrad.parallel.pipeline.timeline import Event
from tetrad.parallel.pipeline.weightgrad import WeightGradStore, defer_weight_grads
from tetrad.parallel.runner import GradSync, LossFn, RunResult

Key = tuple[int, int]  # (stage, microbatch)
Wire = tuple[str, int, int]  # (direction, stage, microbatch): a tensor on the wire


@dataclass(kw_only=True)
class StepState(RunResult):
    """Everything one optimizer step's schedule keeps between actions (and its result)."""

    micro: list[Microbatch]
    denom: torch.Tensor
    box: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    recvs: dict[tuple[str, int, int], tuple[Work, torch.Tensor]] = field(default_factory=dict)
    sends: dict[Wire, tuple[Work, torch.Tensor]] = field(default_factory=dict)  # in flight
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    in_flight: int = 0
    peak_in_flight: int = 0

    @property
    def peak_act_bytes(self) -> int:
        """Activations: saved for backward, awaiting send or W."""
        return self.peak_activation_bytes


class PipelineRuntime:
    """Runs one rank's steps against its chunks of the model (the engine's `Runner`)."""

    def __init__(
        self,
        model,
        chunks: list[Chunk],
        rank_steps: list[Step],
        mesh: Mesh,
        comm: Comm,
        act_shape: tuple[int, ...],
        loss_fn,
        store: WeightGradStore | None,
        releases: list[tuple[Wire, ...]] | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.model, self.mesh, self.comm, self.loss_fn = model, mesh, comm, loss_fn
        self.chunks = {c.stage: c for c in chunks}
        self.rank_steps, self.act_shape, self.store = rank_steps, act_shape, store
        # per step, the sends to wait for (and free) before its compute; None: at the end
        self.releases = releases or [() for _ in rank_steps]
        self.meter = ActivationMeter()
        self.holds_loss = any(c.last for c in chunks)
        # the compute dtype, given: built before the data axis casts the parameters to it
        self.dtype = dtype or next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    def run(self, micro: list[Microbatch], denom: torch.Tensor, grads: GradSync) -> StepState:
        """Execute the whole schedule for one optimizer step. Gradient reductions wait
        for its end (`grads.finish`): a stage's last backward is not the step's."""
        grads.sync = False
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        st = StepState(loss=loss, micro=micro, denom=denom)
        self.meter.reset(self.model.parameters())
        for step, release in zip(self.rank_steps, self.releases):
            self._post(st, step.post)
            for a in step.wait:
                work, buf = st.recvs.pop(wire(a))
                work.wait()
                st.box[wire(a)] = buf
            self._release(st, release)
            t0 = time.time()
            self._compute(st, step.compute)
            c = step.compute
            st.events.append(Event(c.kind, c.stage, c.microbatch, t0, time.time()))
            self._send(st, step.sends)
        self._release(st, tuple(st.sends))
        st.peak_activation_bytes = self.meter.peak
        return st

    # --- transfers ----------------------------------------------------------------------
    def _peer(self, a: Action) -> int:
        return self.mesh["pp"].ranks[a.peer]

    def _post(self, st: StepState, recvs: tuple[Action, ...]) -> None:
        ops, keys = [], []
        for a in recvs:
            buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
            ops.append(("recv", buf, self._peer(a)))
            keys.append((wire(a), buf))
        works = self.comm.batch_p2p(ops, self.mesh["pp"])
        for (key, buf), work in zip(keys, works):
            st.recvs[key] = (work, buf)

    def _send(self, st: StepState, sends: tuple[Action, ...]) -> None:
        ops = []
        for a in sends:
            t = st.box.pop(wire(a))
            ops.append(("send", t, self._peer(a)))
        works = self.comm.batch_p2p(ops, self.mesh["pp"])
        for a, work, (_, t, _) in zip(sends, works, ops):
            st.sends[wire(a)] = (work, t)
            out = st.outputs.get((a.stage - 1, a.microbatch)) if a.kind == "SEND_F" else None
            if out is not None and self.meter.references(out) == 1:  # only our own hold:
                # autograd did not save the output, so the send buffer may own its storage
                out.data = torch.empty(0, dtype=out.dtype, device=out.device)

    def _release(self, st: StepState, keys: tuple[Wire, ...]) -> None:
        """Wait for these sends; dropping their buffers frees the sent tensors."""
        for key in keys:
            work, _ = st.sends.pop(key)
            work.wait()
            self.meter.drop(key)

    # --- compute ------------------------------------------------------------------------
    def _compute(self, st: StepState, a: Action) -> None:
        if a.kind == "F":
            self._forward(st, a.stage, a.microbatch)
        elif a.kind in ("B", "BW"):
            self._backward(st, a.stage, a.microbatch, split=a.kind == "B")
        elif a.kind == "W":
            self._weight_grads((a.stage, a.microbatch))
            self.meter.drop(("W", a.stage, a.microbatch))
        else:
            raise ValueError(f"unknown compute action {a}")

    def _forward(self, st: StepState, s: int, i: int) -> None:
        chunk, mb = self.chunks[s], st.micro[i]
        if chunk.first:
            x = mb.inputs.to(self.device)
        else:
            x = st.box.pop(("F", s, i)).requires_grad_(True)
            st.inputs[(s, i)] = x
        with self.meter.saving():
            out = self.model.forward_span(x, list(chunk.layers), chunk.first, chunk.last)
            if chunk.last:
                loss = self.loss_fn(out, mb.targets.to(self.device)) / st.denom
        if chunk.last:
            st.loss += loss.detach().double()
            st.outputs[(s, i)] = loss
        else:
            st.outputs[(s, i)] = out
            st.box[("F", s + 1, i)] = out.detach()  # sent, or handed to the local next stage
            self.meter.hold(("F", s + 1, i), [out])  # until its send is done, or its backward
        st.in_flight += 1
        st.peak_in_flight = max(st.peak_in_flight, st.in_flight)

    def _backward(self, st: StepState, s: int, i: int, split: bool) -> None:
        chunk = self.chunks[s]
        out = st.outputs.pop((s, i))
        if self.store is not None:
            self.store.key = (s, i)
        if chunk.last:
            torch.autograd.backward(out)
        else:  # from the gradient edge: `out`'s storage may already be freed
            grad = st.box.pop(("B", s, i))
            torch.autograd.backward(torch.autograd.graph.get_gradient_edge(out), grad)
            if ("F", s + 1, i) not in st.sends:  # handed to a local next stage, never sent
                self.meter.drop(("F", s + 1, i))
        if self.store is not None:
            self.store.key = None
            if not split:
                self._weight_grads((s, i))
            else:  # the inputs and output gradients W will need stay alive until then
                filed = self.store.pending.get((s, i), [])
                self.meter.hold(("W", s, i), [t for _, x, g in filed for t in (x, g)])
        if not chunk.first:
            x = st.inputs.pop((s, i))
            st.box[("B", s - 1, i)] = x.grad  # gradient of stage s-1's output
        st.in_flight -= 1

    def _weight_grads(self, key: Key) -> None:
        # the filed inputs require grad: outside no_grad, each weight gradient would record
        # a graph holding every microbatch's inputs until zero_grad (and DP's bucket views
        # refuse in-place adds of such tensors)
        with torch.no_grad():
            self.store.flush(key)


def send_releases(
    actions: list[list[Action]], all_steps: list[list[Step]], rank: int
) -> list[tuple[Wire, ...]]:
    """For each of `rank`'s steps, the sends (wire keys) to wait for before its compute.

    A send from step k is waited at the first later step whose compute starts, in the
    unit-cost simulation of the same lists, no earlier than the peer posts the matching
    receive. That simulated run satisfies every such wait, so they add no cycle to the
    schedule's dependencies and cannot deadlock it; sends with no such step wait at the
    end. Real costs that differ from unit ones can only delay a release, never hang it.
    """
    tl = simulate(actions, Costs(f=1.0, b=1.0, w=1.0, comm=0.0))
    posted: dict[Wire, float] = {}  # a receive is posted when its step's predecessor ends
    for r, rank_steps in enumerate(all_steps):
        for t, step in enumerate(rank_steps):
            for a in step.post:
                posted[wire(a)] = tl.ranks[r][t - 1].end if t > 0 else 0.0
    starts = [e.start for e in tl.ranks[rank]]
    out: list[list[Wire]] = [[] for _ in starts]
    for k, step in enumerate(all_steps[rank]):
        for a in step.sends:
            later = [j for j in range(k + 1, len(starts)) if starts[j] >= posted[wire(a)]]
            if later:
                out[later[0]].append(wire(a))
    return [tuple(keys) for keys in out]


def build_pipeline(
    model: nn.Module, cfg: Config, mesh: Mesh, comm: Comm, chunks: list[Chunk], loss_fn: LossFn
) -> PipelineRuntime:
    """This rank's pipeline: its schedule's steps, and the split backward if it has W."""
    p = cfg.parallel
    actions = build_schedule(p.pp_schedule, p.pp, p.microbatches, p.virtual_stages)
    store = None
    if any(a.kind == "W" for a in actions[mesh["pp"].rank]):
        store = WeightGradStore()
        defer_weight_grads(model, store)
    seq = cfg.train.seq_len // (p.tp if p.sp else 1)
    all_steps, rank = steps(actions, lookahead=1), mesh["pp"].rank
    return PipelineRuntime(
        model,
        chunks,
        all_steps[rank],
        mesh,
        comm,
        (cfg.microbatch_size, seq, cfg.model.dim),
        loss_fn,
        store,
        send_releases(actions, all_steps, rank),
        DTYPES[cfg.train.dtype],
    )


def tied_across_stages(cfg: Config, mesh: Mesh) -> bool:
    """Whether the tied embedding lives on two ranks (first and last stage) whose
    gradients must be summed; zb-v's V puts both stages on one rank."""
    p = cfg.parallel
    if not cfg.model.tie_embeddings or p.pp == 1:
        return False
    first = stage_to_rank(0, p.pp, p.virtual_stages, p.pp_schedule)
    last = stage_to_rank(p.pp * p.virtual_stages - 1, p.pp, p.virtual_stages, p.pp_schedule)
    return first != last and mesh["pp_ends"].size > 1
