"""The pipeline runtime: execute this rank's schedule, one `Step` at a time.

A step posts its receives early (non-blocking, in the order the peer sends them), waits
for the ones its compute needs, runs the compute (F, B, W or BW) and posts its sends
non-blocking. Tensors that cross stages on the same rank (zb-v's V turn) go through the
same mailbox as received ones, without a transfer. Every compute is timed, so a step's
measured timeline can be compared with the simulator's prediction for the same lists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tetrad.comm import Comm, Work
from tetrad.mesh import Mesh
from tetrad.parallel.pipeline.schedules import Action, Step, wire
from tetrad.parallel.pipeline.stage import Chunk
from tetrad.parallel.pipeline.timeline import Event
from tetrad.parallel.pipeline.weightgrad import WeightGradStore
from tetrad.train.data import Microbatch

Key = tuple[int, int]  # (stage, microbatch)


@dataclass
class StepState:
    """Everything one optimizer step's schedule keeps between actions."""

    micro: list[Microbatch]
    denom: float
    box: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    recvs: dict[tuple[str, int, int], tuple[Work, torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[Work, torch.Tensor]] = field(default_factory=list)
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    events: list[Event] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


class PipelineRuntime:
    """Runs one rank's steps against its chunks of the model."""

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
    ):
        self.model, self.mesh, self.comm, self.loss_fn = model, mesh, comm, loss_fn
        self.chunks = {c.stage: c for c in chunks}
        self.rank_steps, self.act_shape, self.store = rank_steps, act_shape, store
        self.holds_last = any(c.last for c in chunks)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    def run(self, micro: list[Microbatch], denom: float) -> StepState:
        """Execute the whole schedule for one optimizer step."""
        st = StepState(micro, denom)
        for step in self.rank_steps:
            self._post(st, step.post)
            for a in step.wait:
                work, buf = st.recvs.pop(wire(a))
                work.wait()
                st.box[wire(a)] = buf
            t0 = time.time()
            self._compute(st, step.compute)
            c = step.compute
            st.events.append(Event(c.kind, c.stage, c.microbatch, t0, time.time()))
            self._send(st, step.sends)
        for work, _ in st.sends:
            work.wait()
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
        st.sends.extend(zip(works, [t for _, t, _ in ops]))

    # --- compute ------------------------------------------------------------------------
    def _compute(self, st: StepState, a: Action) -> None:
        if a.kind == "F":
            self._forward(st, a.stage, a.microbatch)
        elif a.kind in ("B", "BW"):
            self._backward(st, a.stage, a.microbatch, split=a.kind == "B")
        elif a.kind == "W":
            self.store.flush((a.stage, a.microbatch))
        else:
            raise ValueError(f"unknown compute action {a}")

    def _forward(self, st: StepState, s: int, i: int) -> None:
        chunk, mb = self.chunks[s], st.micro[i]
        if chunk.first:
            x = mb.inputs.to(self.device)
        else:
            x = st.box.pop(("F", s, i)).requires_grad_(True)
            st.inputs[(s, i)] = x
        out = self.model.forward_span(x, list(chunk.layers), chunk.first, chunk.last)
        if chunk.last:
            loss = self.loss_fn(out, mb.targets.to(self.device)) / st.denom
            st.loss += loss.detach().double().cpu()
            st.outputs[(s, i)] = loss
        else:
            st.outputs[(s, i)] = out
            st.box[("F", s + 1, i)] = out.detach()  # sent, or handed to the local next stage
        st.in_flight += 1
        st.peak_in_flight = max(st.peak_in_flight, st.in_flight)

    def _backward(self, st: StepState, s: int, i: int, split: bool) -> None:
        chunk = self.chunks[s]
        out = st.outputs.pop((s, i))
        grad = None if chunk.last else st.box.pop(("B", s, i))
        if self.store is not None:
            self.store.key = (s, i)
        torch.autograd.backward(out, grad)
        if self.store is not None:
            self.store.key = None
            if not split:
                self.store.flush((s, i))
        if not chunk.first:
            x = st.inputs.pop((s, i))
            st.box[("B", s - 1, i)] = x.grad  # gradient of stage s-1's output
        st.in_flight -= 1


def attach_pipeline(engine, cfg, chunks: list[Chunk]) -> PipelineRuntime:
    """Give `engine` this rank's pipeline: schedule, runtime, split backward, tied embedding."""
    from tetrad.parallel.pipeline.schedules import build_schedule, steps
    from tetrad.parallel.pipeline.weightgrad import WeightGradStore, defer_weight_grads

    p, mesh = cfg.parallel, engine.mesh
    actions = build_schedule(p.pp_schedule, p.pp, p.microbatches, p.virtual_stages)
    store = None
    if any(a.kind == "W" for a in actions[mesh["pp"].rank]):
        store = WeightGradStore()
        defer_weight_grads(engine.model, store)
    seq = cfg.train.seq_len // (p.tp if p.sp else 1)
    runtime = PipelineRuntime(
        engine.model,
        chunks,
        steps(actions, lookahead=1)[mesh["pp"].rank],
        mesh,
        engine.comm,
        (cfg.microbatch_size, seq, cfg.model.dim),
        lambda logits, targets: engine.loss_fn(logits, targets),
        store,
    )
    if cfg.model.tie_embeddings and engine.model.tok_embeddings is not None:
        name = "tok_embeddings.weight"
        # counted once in the grad norm: on the first stage's rank (pp coordinate 0)
        engine.replicated[name] = tuple(engine.replicated[name]) + ("pp",)
        engine.tied_across_stages = mesh["pp_ends"].size > 1
    engine.pipeline = runtime
    return runtime


def stage_param_names(cfg, pp_rank: int) -> list[str]:
    """Logical names of the parameters `pp_rank` holds (pure: built on the meta device)."""
    from tetrad.models.llama import Llama
    from tetrad.parallel.pipeline.stage import prune, rank_chunks

    with torch.device("meta"):
        model = prune(Llama(cfg.model), rank_chunks(cfg, pp_rank))
    return [n for n, _ in model.named_parameters()]


def gather_stages(state: dict[str, torch.Tensor], cfg, mesh: Mesh, comm: Comm):
    """Every stage's full tensors on every rank: each broadcast from its holder over pp."""
    from tetrad.models.init import full_shape

    out: dict[str, torch.Tensor] = {}
    pp = mesh["pp"]
    for r in range(pp.size):
        for name in stage_param_names(cfg, r):
            if name in out:
                continue  # a tied embedding held by two stages: the first one's value
            t = state[name] if r == pp.rank else torch.empty(full_shape(name, cfg.model))
            comm.broadcast(t, r, pp)
            out[name] = t
    return out
