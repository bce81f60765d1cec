"""Step time of one layout, from first principles (its memory: `plan.footprint`).

The model, per optimizer step (b microbatch size, s sequence, h hidden, t = tp):

- Compute: each pipeline stage's forward (F), input-gradient (B) and weight-gradient (W)
  FLOPs per microbatch, from the model's matmuls and attention (`ModelSpec.layer_costs`:
  B = W = F for the projections and MLP; attention has no weights, so its backward is all
  B), divided by tp and charged at `peak x efficiency` of the device.
- TP: two all-reduces of b·s·h forward and two backward per layer (8·b·s·h·(t-1)/t
  elements in bus terms; with SP all-gather + reduce-scatter, the same), on NVLink when
  the tp group fits in a node; exposed (tetrad does not overlap them), added to F and B.
- ZeRO-3: each block's parameters all-gathered before its forward and again before its
  backward, prefetched one block ahead: exposed is the first block's gather plus whatever
  the stage's compute cannot cover; added to F and B of every microbatch.
- PP: b·s·h activations per microbatch and boundary each way (1/t of it with SP), as
  the simulator's transfer delay. The simulator runs the schedule on the per-stage F/B/W
  costs, so the bubble of any schedule, balanced or not, comes out of the same action
  lists the runtime executes.
- DP / FSDP gradient reduction (all-reduce, or reduce-scatter and, for HSDP, an
  all-reduce of the shard) once per step on the data group's slowest link, hidden behind
  the last microbatch's backward (pp = 1; tetrad launches it after the schedule when
  pp > 1) but for the last block's share; ZeRO-1/2's parameter all-gather after the
  optimizer, exposed; the optimizer step itself, memory-bound (32 bytes per element).
- Memory (`plan.footprint`): model state exactly as `model_state_bytes`; activations
  from `plan.activations` times the microbatches in flight in the simulated timeline;
  and a stated overhead.

- CP: a rank holds s/cp tokens of each sequence (every per-token term is charged for
  them, attention for 1/cp of the causal square) and every attention layer receives the
  keys and values of the other cp - 1 shards forward and their gradients backward
  (`cp_exchange_bytes`), exposed unless the engine's ring overlaps them.

`Implementation` (`plan.engines`) says what an implementation overlaps, runs and keeps: `TETRAD`
is tetrad today; the others describe the published systems the planner is checked
against.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from tetrad.config import ModelConfig
from tetrad.layout import SPLIT_BACKWARD, Layout
from tetrad.models.families import spec_for
from tetrad.models.spec import check_recompute
from tetrad.parallel.pipeline.partition import stage_costs
from tetrad.parallel.pipeline.schedules import (
    Action,
    add_transfers,
    compute_orders,
    placement,
    stage_to_rank,
    steady_count,
)
from tetrad.parallel.pipeline.simulate import Costs, Dag
from tetrad.parallel.pipeline.stage import layer_split
from tetrad.plan.candidates import (
    block_kinds,
    cached,
    cp_exchange_bytes,
    describe,
    ep_bytes_per_layer,
    first_ep_groups,
    held_stages,
    model_key,
)
from tetrad.plan.compute import ComputeModel
from tetrad.plan.engines import TETRAD, Implementation
from tetrad.plan.footprint import Footprint, Memory, RankFacts
from tetrad.plan.hardware import Cluster, Link, at_efficiency
from tetrad.plan.peak import stage_input_bytes

OPTIMIZER_BYTES = 32  # AdamW per shard element: read grad, master, m, v; write master, m, v, param


@dataclass
class Prediction:
    """One layout's predicted step. Times in seconds; `breakdown` sums to `step_time_s`."""

    layout: dict[str, Any]
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    memory: Memory
    breakdown: dict[str, float] = field(default_factory=dict)
    step_time_range_s: tuple[float, float] | None = None
    tokens_per_s_range: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (memory in bytes, with its total and whether it fits)."""
        out = dataclasses.asdict(self)
        out["memory"].update(total=self.memory.total, fits=self.memory.fits,
                             allocated=self.memory.allocated)  # fmt: skip
        return out


@dataclass
class StageTimes:
    """Per global stage, seconds per microbatch of each component of F, B and W."""

    compute: dict[str, list[float]]
    tp: dict[str, list[float]]
    fsdp: dict[str, list[float]]
    cp: dict[str, list[float]]
    ep: dict[str, list[float]]

    def totals(self) -> dict[str, list[float]]:
        """Seconds per microbatch of every kind ("F", "B", "W", in that order) and stage:
        the compute, and the communication it exposes."""
        comms = (self.tp, self.fsdp, self.cp, self.ep)
        return {k: [c + sum(t[k][s] for t in comms) for s, c in enumerate(self.compute[k])]
                for k in "FBW"}  # fmt: skip

    def costs(self, comm: float) -> Costs:
        return Costs(*self.totals().values(), comm=comm)


class Planner:
    """Predicts layouts of one model on one cluster; caches the per-rank model facts that
    many layouts share (building the meta model is the slow part of a search)."""

    def __init__(self, cluster: Cluster, engine: Implementation = TETRAD, recompute: str = "none"):
        check_recompute(recompute)
        if not cluster.overlap:  # nothing runs beside the compute on this machine
            engine = dataclasses.replace(
                engine, tp_overlap=0.0, grad_overlap=False, param_gather_overlap=False,
                gather_overlap=False, cp_overlap=False,
            )  # fmt: skip
        self.cluster, self.engine, self.recompute = cluster, engine, recompute
        self.footprint = Footprint(cluster.device, recompute, engine)
        self.compute = ComputeModel(cluster.device, engine.kernels, sized=cluster.sized)
        self._splits: dict[tuple, list[int]] = {}
        self._schedules: dict[tuple, Dag] = {}
        self._orders: dict[tuple, list[list[Action]]] = {}
        self._cool_downs: dict[tuple, list[tuple[tuple[str, ...], bool, tuple]]] = {}
        self._links: dict[tuple, Link] = {}  # `Cluster.link`, `Cluster.group_link`
        # what a search asks of many layouts, each keyed by the fields it reads: a layout's
        # facts, per-microbatch times, a rank's gradient reduction, a step's
        # simulated makespan and busy times
        self._facts_of: dict[tuple, list[RankFacts]] = {}
        self._times: dict[tuple, dict[str, list[float]]] = {}
        self._reductions: dict[tuple, dict[str, float]] = {}
        self._simulated: dict[tuple, tuple[float, list[float], float]] = {}

    def on(self, cluster: Cluster) -> Planner:
        """A planner for `cluster` (the same engine and recompute) that shares this one's
        caches: layer splits, schedules and model facts do not depend on the device's
        speed, and rebuilding them is most of a small model's prediction."""
        out = Planner(cluster, self.engine, self.recompute)
        out._splits, out._schedules, out._orders = self._splits, self._schedules, self._orders
        out._cool_downs = self._cool_downs
        out.footprint.share_caches(self.footprint)
        return out

    def _link(self, stride: int, size: int) -> Link:
        """`self.cluster.link(stride, size)`, built once: a search asks it a million times."""
        return cached(self._links, (stride, size), self.cluster.link, stride, size)

    def _group_link(self, ranks: list[int]) -> Link:
        """`self.cluster.group_link(ranks)`, cached by what it reads of the group: whether
        its ends share a node, its first stride and its size."""
        node = self.cluster.gpus_per_node
        stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
        key = (ranks[0] // node == ranks[-1] // node, stride, len(ranks))
        return cached(self._links, key, self.cluster.group_link, ranks)

    def _schedule_key(self, lay: Layout) -> tuple:
        """What a schedule's action lists depend on: its name, pp, m, v and the engine's
        interleaved warm-up."""
        return (lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages,
                self.engine.interleaved_lag)  # fmt: skip

    def schedule(self, lay: Layout) -> Dag:
        """The schedule's action lists as the simulator times them (built once per
        schedule, pp, m, v and the engine's interleaved warm-up: a search times one
        schedule on many costs)."""
        key = self._schedule_key(lay)
        if key not in self._schedules:  # `build_schedule` on the orders memory read
            place = placement(lay.pp, lay.virtual_stages, lay.schedule)
            actions = [add_transfers(o, place, lay.stages) for o in self.order(lay)]
            self._schedules[key] = Dag.of(actions)
        return self._schedules[key]

    def held_order(self, lay: Layout) -> list[list[Action]]:
        """`order` of `lay`'s schedule at `steady_count` microbatches: what memory and the
        cool-down read off the order is the same there (a family's larger counts share it,
        and its moments are priced once)."""
        key = self._held_key(lay)
        return cached(self._orders, key, compute_orders, *key)

    def _held_key(self, lay: Layout) -> tuple:
        """`_schedule_key` at the schedule's steady count."""
        n = steady_count(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages)
        return (lay.schedule, lay.pp, n, lay.virtual_stages, self.engine.interleaved_lag)

    def order(self, lay: Layout) -> list[list[Action]]:
        """Each rank's compute actions in the order it runs them (built once per schedule,
        pp, m and v), which `schedule` simulates: a rank runs its actions in one order
        whatever they cost, so what is in flight when, all that memory reads off a
        timeline, is read off the order without simulating the step (`held_order`)."""
        key = self._schedule_key(lay)
        return cached(self._orders, key, compute_orders, *key)

    def split(self, lay: Layout, m: ModelConfig) -> list[int]:
        """Layers per global stage, as the runtime splits them (`stage.layer_split`)."""
        key = (model_key(m), lay.pp, lay.virtual_stages, lay.split, lay.split_measured, lay.seq_len)
        if key not in self._splits:
            uniform = (
                self.engine.split == "uniform" and lay.split is None and not lay.split_measured
            )
            self._splits[key] = (uniform and _uniform_split(lay, m)) or layer_split(lay, m)
        return self._splits[key]

    def facts(self, lay: Layout, m: ModelConfig) -> list[RankFacts]:
        """`Footprint.pipeline_facts` of `lay` (cached by the layout: a search asks for
        a candidate's several times, for its floors, its memory and its step)."""
        key = (model_key(m), lay)
        if key not in self._facts_of:
            self._facts_of[key] = self.footprint.pipeline_facts(lay, m, self.split(lay, m))
        return self._facts_of[key]

    def predict(
        self, lay: Layout, m: ModelConfig, detail: bool = True, memory: Memory | None = None
    ) -> Prediction:
        """Step time, throughput, MFU, memory and breakdown of layout `lay` of model `m`.

        detail=False skips the second simulation (without transfer delays) that splits
        the pipeline's idle time into bubble and p2p: the search's fast path. `memory`:
        `self.memory(lay, m)` where the caller has it already.
        """
        facts = self.facts(lay, m)
        times = self.stage_times(lay, m, facts)
        makespan, busy, bubble = self._simulate(lay, times.costs(self.p2p_time(lay, m)))
        free = self._simulate(lay, times.costs(0.0))[0] if detail else makespan
        tails = [self.after_schedule(lay, r, facts[r], times) for r in range(lay.pp)]
        busiest = max(range(lay.pp), key=lambda r: busy[r])
        pipe = {"makespan": makespan, "free": free, "busy": busy[busiest]}
        breakdown = self._breakdown(lay, times, busiest, pipe, tails)
        step = sum(breakdown.values())
        tokens = lay.global_batch * lay.seq_len
        flops = spec_for(m).flops_per_token(m, lay.seq_len) * tokens
        peak = self.cluster.device.peak_tflops[lay.dtype_name] * 1e12
        return Prediction(
            layout=describe(lay, self.recompute),
            step_time_s=step,
            tokens_per_s=tokens / step,
            tflops_per_gpu=flops / step / lay.world / 1e12,
            mfu=flops / step / lay.world / peak,
            bubble_fraction=bubble,
            memory=memory or self.memory(lay, m, facts),
            breakdown=breakdown,
        )

    def _simulate(self, lay: Layout, costs: Costs) -> tuple[float, list[float], float]:
        """(makespan, each rank's busy time, bubble fraction) of the schedule simulated on
        `costs`, as `Timeline` reads them off its events (cached by the schedule and the
        costs: the search's answer is predicted again in detail)."""
        key = (self._schedule_key(lay), tuple(costs.f), tuple(costs.b), tuple(costs.w), costs.comm)
        if key not in self._simulated:
            dag = self.schedule(lay)
            start, end = dag.times(costs)
            makespan = max(end, default=0.0) - min(start, default=0.0)
            busy = [sum(end[i] - start[i] for i in rank) for rank in dag.ranks]
            bubble = 1.0 - sum(busy) / (lay.pp * makespan) if makespan else 0.0
            self._simulated[key] = (makespan, busy, bubble)
        return self._simulated[key]

    def memory(self, lay: Layout, m: ModelConfig, facts: list[RankFacts] | None = None) -> Memory:
        """The fullest rank's memory (what `predict` reports), without timing the step."""
        facts = facts or self.facts(lay, m)
        return self.footprint.memory(lay, m, self.split(lay, m), facts, self.held_order(lay))

    def step_floor(self, lay: Layout, m: ModelConfig) -> float:
        """A lower bound of `predict(lay, m).step_time_s` without simulating the schedule: no
        rank finishes before its own work is done (the makespan is at least any rank's
        busy time), and the step adds the longest tail after the schedule (`step_floors`'
        first, without reading the schedule's order)."""
        return self._floors(lay, m, cool_down=False)[0]

    def step_floors(self, lay: Layout, m: ModelConfig) -> tuple[float, float]:
        """(`step_floor`, a higher lower bound that adds each rank's warm-up and
        cool-down). No compute of pp rank r can start before microbatch 0's forward has
        run through the stages ahead of r's first (every schedule places stage r first on
        rank r; a forward waits for the previous stage's, and a backward for its own
        forward). Nor can the step end before r's last backward (of stage s, microbatch
        j) has gone back through stages s-1, ..., 0 (each backward waits for the next
        stage's, sent when it ends) and, where W is split off, stage 0's W of j has run:
        the makespan is at least the warm-up, r's work up to that backward in its order,
        and that chain (`_cool_down_of`). What r runs after it (a split schedule's
        deferred Ws) may overlap the chain, so it is taken off the chain, not added.
        Transfers and host time only delay the simulated step. The warm-up falls as the
        count grows (the forwards shrink): the second floor may fall with it, and only
        the first grows with the count (`search` ends a walk on the first alone)."""
        return self._floors(lay, m, cool_down=True)

    def _floors(self, lay: Layout, m: ModelConfig, cool_down: bool) -> tuple[float, float]:
        """`step_floors`; without `cool_down`, its first alone is meant (the second then
        counts no chain)."""
        facts = self.facts(lay, m)
        times = self.stage_times(lay, m, facts)
        total = times.totals()
        total["BW"] = [b + w for b, w in zip(total["B"], total["W"])]
        # sums of the first i stages' terms, added in order as `sum` adds them
        ahead = {k: list(itertools.accumulate(v, initial=0)) for k, v in total.items()}
        tails: dict[tuple, float] = {}  # ranks with the same facts and stage times share it
        busy = started = tail = 0.0
        ends = self._cool_down_of(lay) if cool_down else [((), False, ())] * lay.pp
        for r, (kinds, w0, after) in enumerate(ends):
            stages = held_stages(lay, r)
            work = lay.microbatches * sum(total[k][s] for k in "FBW" for s in stages)
            if len(set(kinds)) == 1:
                chain = ahead[kinds[0]][len(kinds)]
            else:
                chain = sum(total[k][s] for s, k in enumerate(kinds))
            chain += w0 * total["W"][0]
            after_work = sum(c * total[k][s] for k, s, c in after)
            busy = max(busy, work)
            cool = max(0.0, chain - after_work)
            started = max(started, ahead["F"][stages[0]] + work + cool)
            key = (id(facts[r]), *(times.compute[k][s] for s in stages for k in "FBW"))
            if key not in tails:
                tails[key] = sum(self.after_schedule(lay, r, facts[r], times).values())
            tail = max(tail, tails[key])
        return busy + tail, started + tail

    def _cool_down_of(self, lay: Layout) -> list[tuple[tuple[str, ...], bool, tuple]]:
        """`cool_downs` of the schedule's order (one per schedule key, at its steady count:
        the same there, `steady_count`)."""
        key = self._held_key(lay)
        if key not in self._cool_downs:
            self._cool_downs[key] = cool_downs(self.held_order(lay))
        return self._cool_downs[key]

    def rank_activations(self, lay: Layout, m: ModelConfig, pp_rank: int) -> float:
        """Peak activation bytes of pp rank `pp_rank` (what `predict` counts in its memory)."""
        return self.footprint.rank_activations(
            lay, m, self.split(lay, m), self.held_order(lay), pp_rank
        )

    def with_range(self, lay: Layout, m: ModelConfig, pred: Prediction) -> Prediction:
        """`pred` with a step-time range: the layout predicted at the lowest and highest
        efficiency of the rows (or runs) the device was fitted to (`Cluster.spread`)."""
        lo, hi = self.cluster.spread
        eff = self.cluster.device.efficiency
        low, high = (  # the faster end first
            self.on(at_efficiency(self.cluster, eff * r))
            .predict(lay, m, False, pred.memory)
            .step_time_s  # the memory is the device's, whatever its speed
            for r in (hi, lo)
        )
        tokens = lay.global_batch * lay.seq_len
        return dataclasses.replace(
            pred, step_time_range_s=(low, high), tokens_per_s_range=(tokens / high, tokens / low)
        )

    def rank_facts(self, lay: Layout, m: ModelConfig, pp_rank: int) -> RankFacts:
        """Local parameter counts and exact model state of pp rank `pp_rank`."""
        return self.facts(lay, m)[pp_rank]

    def memory_total(
        self, lay: Layout, m: ModelConfig, facts: list[RankFacts] | None = None
    ) -> float:
        """`memory(lay, m).total`, without building the fullest rank's peak. `facts`:
        `self.facts(lay, m)`, or those of a layout that differs in the microbatches alone
        (they do not read them)."""
        facts = facts or self.facts(lay, m)
        return self.footprint.total(lay, m, self.split(lay, m), facts, self.held_order(lay))

    # --- compute and per-microbatch communication -----------------------------------------

    def stage_times(self, lay: Layout, m: ModelConfig, facts: list[RankFacts]) -> StageTimes:
        """Seconds per microbatch, per global stage: compute, exposed TP, exposed ZeRO-3."""
        compute = self._per_microbatch(self._stage_seconds, lay, m)
        tp = self._per_microbatch(self._tp_times, lay, m)
        fsdp = self._zero3_gathers(lay, m, facts, compute)
        if self.engine.reduce_every_microbatch:
            for s, seconds in enumerate(self._per_micro_reduction(lay, m, facts, compute)):
                fsdp["B"][s] += seconds
        cp = self._per_microbatch(self._cp_times, lay, m)
        ep = self._per_microbatch(self._ep_times, lay, m, lay.dp, lay.fsdp)
        if lay.schedule in SPLIT_BACKWARD and not self.engine.defers_w(lay):
            # W not deferred: B does the weight gradients itself
            folded = [b + w for b, w in zip(compute["B"], compute["W"])]
            compute = {"F": compute["F"], "B": folded, "W": [0.0] * len(folded)}
        return StageTimes(compute, tp, fsdp, cp, ep)

    def _per_microbatch(self, times, lay: Layout, m: ModelConfig, *more) -> dict[str, list[float]]:
        """`times(lay, m)`, one of the per-microbatch tables (not to be changed in place),
        cached by what they read: the model, the stage split, the microbatch's shape and
        the tp, cp and ep degrees (and `more`: the expert groups' dp and fsdp). Candidates
        that differ in the rest (dp and fsdp, ZeRO stage, schedule) share them."""
        key = (times.__name__, model_key(m), tuple(self.split(lay, m)), lay.tp, lay.sp, lay.cp,
               lay.ep, lay.microbatch_size, lay.local_seq, lay.seq_len, lay.compute_dtype,
               lay.fp8, lay.loss_chunk, lay.cp_attention, *more)  # fmt: skip
        return cached(self._times, key, times, lay, m)

    def _stage_seconds(self, lay: Layout, m: ModelConfig) -> dict[str, list[float]]:
        """F, B and W seconds of one microbatch on each global stage, on one tp rank."""
        dt, tokens = lay.dtype_name, lay.microbatch_tokens  # tokens: cp splits sequences
        fp8 = "fp8" if lay.fp8 else ""
        fwd = self._block(lay, m)
        selective = self.compute.selective_redo(m, lay.tp, tokens, fp8 or dt, fwd)
        redo = {"none": 0.0, "selective": selective, "full": fwd.total, "op": fwd.gemm / 2}
        bwd = self.compute.backward(fwd).total + redo[self.recompute]
        embed = tokens * m.dim * lay.element_bytes / self.cluster.device.hbm_Bps  # a lookup's write
        head = self.compute.head(m, lay.tp, tokens, dt)
        # a chunked loss computes the head's weight gradient in B, chunk by chunk
        head_w = 0.0 if self.engine.chunked_loss and lay.loss_chunk > 0 else head.gemm
        head_b = self.compute.backward(head).total + head.gemm - head_w
        per = {
            "F": [embed] + [fwd.total] * m.layers + [head.total],
            "B": [embed] + [bwd] * m.layers + [head_b],
            "W": [0.0] + [fwd.gemm] * m.layers + [head_w],
        }
        return {k: stage_costs(v, self.split(lay, m)) for k, v in per.items()}

    def _block(self, lay: Layout, m: ModelConfig):
        """One block's forward on one rank for one microbatch, by kernel kind."""
        fp8 = "fp8" if lay.fp8 else ""
        return self.compute.block_forward(
            m, lay.tp, lay.sp, lay.microbatch_tokens, lay.microbatch_size, lay.seq_len,
            lay.dtype_name, lay.cp, fp8, lay.ep, self.engine.routing_imbalance,
        )  # fmt: skip

    def _tp_times(self, lay: Layout, m: ModelConfig) -> dict[str, list[float]]:
        """Exposed TP seconds per microbatch per stage: 2 all-reduces of b·s·h per layer
        forward and 2 backward; the vocab-parallel embedding 1 forward, the head 1 backward
        (and 1 forward with SP, where it gathers the sequence). An attention whose region
        starts on narrower tensors (`ModelSpec.attention_entry`, r of h) moves r·h there:
        backward (its f) without SP, both ways with SP (the gather and its
        reduce-scatter, each half an all-reduce), and under SP an all-reduce of the
        weight gradients before the region."""
        split = self.split(lay, m)
        if lay.tp == 1:
            return {k: [0.0] * len(split) for k in "FBW"}
        nbytes = lay.microbatch_tokens * m.dim * lay.element_bytes
        link = self._link(1, lay.tp)
        one = link.time("all_reduce", lay.tp, nbytes) * (1.0 - self.engine.tp_overlap)
        entry = spec_for(m).attention_entry
        width, summed = entry(m) if entry else (m.dim, 0)
        r = width / m.dim
        per_f, per_b = ((r + 3) / 2, (r + 3) / 2) if lay.sp else (2.0, 1 + r)
        if lay.sp and summed:
            per_b += link.time("all_reduce", lay.tp, summed * lay.element_bytes) / one
        f = [per_f * n * one for n in split]
        bwd = [per_b * n * one for n in split]
        f[0] += one
        bwd[-1] += one
        if lay.sp:
            f[-1] += one
        return {"F": f, "B": bwd, "W": [0.0] * len(split)}

    def _cp_times(self, lay: Layout, m: ModelConfig) -> dict[str, list[float]]:
        """Exposed context-parallel seconds per microbatch per stage: every attention
        layer receives the keys and values of the other cp - 1 shards (a ring over the
        cp ranks, or an all-gather: (cp - 1)/cp of 2·b·s·kv·hd·c bytes, kv the rank's
        kv heads) forward, and the same for dk and dv backward; on the link the cp group
        spans (cp ranks tp apart). A ring runs each of its cp - 1 hops beside one block's
        attention (1/cp of the layer's): only what a hop takes beyond that block shows."""
        split = self.split(lay, m)
        out = {k: [0.0] * len(split) for k in "FBW"}
        if lay.cp == 1:
            return out
        nbytes = cp_exchange_bytes(lay, m) * lay.cp / (lay.cp - 1)  # the gathered buffer
        link = self._link(lay.tp, lay.cp)
        seconds = {"F": link.time("all_gather", lay.cp, nbytes),
                   "B": link.time("reduce_scatter", lay.cp, nbytes)}  # fmt: skip
        fwd = self._block(lay, m)
        window = {"F": fwd.attention, "B": self.compute.backward(fwd).attention}
        ring = self.engine.cp_overlap or (lay.cp_attention == "ring" and self.cluster.overlap)
        for kind in "FB":
            exposed = seconds[kind]
            if ring:  # each of the cp - 1 hops beside one block's attention
                hop, block = exposed / (lay.cp - 1), window[kind] / lay.cp
                exposed = (lay.cp - 1) * max(0.0, hop - block)
            out[kind] = [n * exposed for n in split]
        return out

    def _ep_times(self, lay: Layout, m: ModelConfig) -> dict[str, list[float]]:
        """Exposed expert-parallel seconds per microbatch per stage. Every MoE layer sends
        its tokens' k copies to their experts and the outputs back (dispatch and combine)
        forward, and both again backward (docs/moe.md, "Bytes per token per layer"): each
        all-to-all moves T·k·dim·c bytes per rank of which (ep - 1)/ep leave it, T the
        rank's tokens (1/tp of the microbatch's under tp, each tp rank dispatching its
        share), on the links the ep group spans (`Cluster.all_to_all`); before the
        dispatch the ranks exchange their per-expert counts (8·E bytes). Forward, the
        layer's shared experts compute while the dispatch travels (where communication
        runs beside compute): only what the dispatch takes beyond them shows."""
        split = self.split(lay, m)
        out = {k: [0.0] * len(split) for k in "FBW"}
        if lay.ep == 1:
            return out
        eng = self.engine
        group = list(range(lay.ep)) if eng.ep_inner else first_ep_groups(lay)[0]  # all alike
        buffer = ep_bytes_per_layer(lay, m) / 4 * lay.ep / (lay.ep - 1)  # one call's copies
        leaving = _node_copies(m, self.cluster.gpus_per_node, group) if eng.ep_dedup else 1.0
        one = self.cluster.all_to_all(group, buffer * eng.routing_imbalance, leaving)
        counts = self.cluster.all_to_all(group, 8.0 * m.experts)
        shared = self._shared_expert_seconds(lay, m) if self.cluster.overlap else 0.0
        forward, backward = max(0.0, one - shared) + one + counts, 2 * one
        if eng.ep_overlap and self.cluster.overlap:  # beside another microbatch's block
            fwd = self._block(lay, m)
            forward = max(0.0, forward - fwd.total)
            backward = max(0.0, backward - self.compute.backward(fwd).total)
        for stage in range(len(split)):
            moe = block_kinds(m, split, [stage])[1]
            out["F"][stage] = moe * forward
            out["B"][stage] = moe * backward
        return out

    def _shared_expert_seconds(self, lay: Layout, m: ModelConfig) -> float:
        """Forward GEMM seconds of one layer's shared experts on one rank for a microbatch
        (split over tp like a dense SwiGLU): the compute a dispatch all-to-all hides behind."""
        width = m.shared_experts * m.expert_dim / lay.tp
        if width == 0:
            return 0.0
        rate = self.cluster.device.flops_per_s(lay.dtype_name)
        return 3 * 2 * lay.microbatch_tokens * m.dim * width / rate

    def _zero3_gathers(
        self, lay: Layout, m: ModelConfig, facts: list[RankFacts], compute: dict[str, list[float]]
    ) -> dict[str, list[float]]:
        """Exposed ZeRO-3 block gathers per microbatch per stage: forward gathers hide
        behind F, backward re-gathers behind B + W, prefetched one block ahead, so the
        first block's gather is always exposed."""
        split = self.split(lay, m)
        out = {k: [0.0] * len(split) for k in "FBW"}
        if lay.fsdp == 1 or lay.zero_stage < 3:
            return out
        link = self._link(lay.tp * lay.cp, lay.fsdp)
        for stage, layers in enumerate(split):
            if layers == 0:
                continue
            fa = facts[stage_to_rank(stage, lay.pp, lay.virtual_stages, lay.schedule)]
            calls = _calls(fa.block, 1, self.engine.gather_bucket)
            # FP8 gathers: one byte a value of the FP8 weights (plan/fp8_gather.py)
            nbytes = fa.fp8_block_bytes or fa.block * lay.element_bytes
            one = link.time("all_gather", lay.fsdp, nbytes / calls)
            gather = layers * calls * one + self._expert_gathers(lay, fa, layers)
            hide = 1.0 if self.engine.gather_overlap else 0.0
            bwd = compute["B"][stage] + compute["W"][stage]
            out["F"][stage] = _exposed(gather, layers, hide * compute["F"][stage])
            out["B"][stage] = _exposed(gather, layers, hide * bwd)
        return out

    def _expert_gathers(self, lay: Layout, fa: RankFacts, layers: int) -> float:
        """Seconds of one pass's gathers of the expert units of `layers` blocks (their MoE
        share), each over the expert-data group, where ZeRO shards the experts."""
        if not fa.expert_unit:
            return 0.0
        group = first_ep_groups(lay)[1]
        link = self._group_link(group)
        moe = layers * fa.moe_units / max(fa.layer_units, 1)
        return moe * link.time("all_gather", len(group), fa.expert_unit * lay.element_bytes)

    def _per_micro_reduction(
        self, lay: Layout, m: ModelConfig, facts: list[RankFacts], compute: dict[str, list[float]]
    ) -> list[float]:
        """Exposed gradient reduction per microbatch per stage, for engines that reduce
        after every microbatch (FSDP2): hidden behind that microbatch's backward; where the
        engine reduces asynchronously, behind the next microbatch's forward too (its last
        unit waits at the end of the step: `after_schedule`)."""
        out = []
        for stage, layers in enumerate(self.split(lay, m)):
            rank = stage_to_rank(stage, lay.pp, lay.virtual_stages, lay.schedule)
            fa = facts[rank]
            share = (layers + 1) / (fa.layer_units + 1)  # this chunk's share of the rank
            seconds = sum(self._grad_reduction(lay, fa).values())
            if self.engine.reduce_async:  # the rank's reduction beside its whole microbatch
                busy = sum(compute[k][s] for k in "FBW" for s in held_stages(lay, rank))
                out.append(max(0.0, seconds - busy) * share)
            else:
                window = compute["B"][stage] + compute["W"][stage]
                out.append(_exposed(seconds * share, layers + 1, window))
        return out

    def p2p_time(self, lay: Layout, m: ModelConfig) -> float:
        """One activation (or its gradient) across one stage boundary."""
        if lay.pp == 1:
            return 0.0
        link = self.cluster.p2p_link(lay.dp * lay.fsdp * lay.cp * lay.tp)
        return link.time("send_recv", 2, stage_input_bytes(lay, m))

    # --- once per step, after the schedule ------------------------------------------------

    def _grad_reduction(self, lay: Layout, fa: RankFacts) -> dict[str, float]:
        """Seconds of one rank's gradient reduction over the data axes, unhidden, by
        axis: "fsdp" the reduce-scatter over the shard group, "dp" the all-reduce over
        the replicas (plain DP's whole gradients, or HSDP's shard). Cached by what it
        reads (not to be changed in place): it does not depend on the microbatch count."""
        key = (tuple(lay.degrees.values()), lay.ep, lay.reduce_bytes, fa.psi_dense,
               fa.layer_units, fa.psi_experts, fa.expert_shards)  # fmt: skip
        return cached(self._reductions, key, self._reduction, lay, fa)

    def _reduction(self, lay: Layout, fa: RankFacts) -> dict[str, float]:
        reps = lay.dp * lay.cp  # the replicas: cp ranks hold different tokens, the same weights
        experts = self._expert_grad_reduction(lay, fa)
        psi = fa.psi_dense
        if reps * lay.fsdp == 1:
            return {"dp": experts, "fsdp": 0.0}
        bucket = self.engine.reduce_bucket
        if lay.fsdp == 1:  # plain DP: the buckets in their reduce width; dp x cp contiguous
            n = _calls(psi, 1, bucket)
            ar = n * self._link(lay.tp, reps).time("all_reduce", reps, psi * lay.reduce_bytes / n)
            return {"dp": ar + experts, "fsdp": 0.0}
        n = _calls(psi, fa.layer_units + 1, bucket)  # one per unit, or per bucket
        link = self._link(lay.tp * lay.cp, lay.fsdp)
        rs = n * link.time("reduce_scatter", lay.fsdp, psi * lay.reduce_bytes / n)
        # the replica group dp x cp: cp ranks tp apart, dp ranks tp·cp·fsdp apart; priced
        # as one group over the span it covers
        outer = self._link(lay.tp * (lay.fsdp if lay.dp > 1 else 1), reps)
        hsdp = outer.time("all_reduce", reps, psi / lay.fsdp * 4)
        return {"dp": hsdp + experts, "fsdp": rs}

    def _expert_grad_reduction(self, lay: Layout, fa: RankFacts) -> float:
        """Seconds of the ep-sharded expert gradients' reduction over the expert-data
        group, the dp·fsdp·cp·tp / ep ranks of a stage that hold the same slice
        (`mesh.expert_groups`): without ZeRO an all-reduce of the whole gradients (fp32);
        under ZeRO, whose units of them are split over that group, a reduce-scatter (in
        the reduce dtype); their gathers are priced with ZeRO's others (`after_schedule`,
        `_zero3_gathers`)."""
        if not fa.psi_experts:
            return 0.0
        group = first_ep_groups(lay)[1]
        op = "all_reduce" if fa.expert_shards == 1 else "reduce_scatter"
        return self._group_link(group).time(op, len(group), fa.psi_experts * lay.reduce_bytes)

    def after_schedule(self, lay: Layout, pp_rank: int, fa: RankFacts, times: StageTimes) -> dict:
        """Exposed seconds of one pp rank after its pipeline work: gradient reduction,
        parameter gathers outside the microbatches, optimizer step."""
        eng = self.engine
        units = fa.layer_units + 1
        stages = held_stages(lay, pp_rank)
        bwd = sum(times.compute["B"][s] + times.compute["W"][s] for s in stages)
        fwd = sum(times.compute["F"][s] for s in stages)
        grad = {"dp": 0.0, "fsdp": 0.0}
        if not eng.reduce_every_microbatch:
            parts = self._grad_reduction(lay, fa)
            seconds = sum(parts.values())
            hidden = eng.grad_overlap and (lay.pp == 1 or eng.grad_overlap_pp)
            shown = _exposed(seconds, units, bwd if hidden else 0.0)
            # what shows is shared between the axes as their seconds are
            grad = {k: shown * v / seconds for k, v in parts.items()} if seconds else grad
        elif eng.reduce_async:  # the last microbatch's last unit, with nothing after it
            grad["fsdp"] = sum(self._grad_reduction(lay, fa).values()) / units
        gather = 0.0
        if lay.fsdp > 1:
            link = self._link(lay.tp * lay.cp, lay.fsdp)
            if lay.zero_stage < 3:  # the updated shards, dense and (sharded) experts
                seconds = link.time("all_gather", lay.fsdp, fa.psi_dense * lay.element_bytes)
                seconds += self._expert_gathers(lay, fa, fa.layer_units)
                gather = _exposed(seconds, units, fwd if eng.param_gather_overlap else 0.0)
            else:  # the root unit: gathered once per step, before the first forward
                gather = link.time("all_gather", lay.fsdp, fa.psi_root * lay.element_bytes)
                if fa.fp8_weights:  # their scales: one all-reduce (max) of an fp32 amax each
                    gather += link.time("all_reduce", lay.fsdp, 4 * fa.fp8_weights)
        shard = fa.psi_dense / lay.fsdp + fa.psi_experts / fa.expert_shards
        optimizer = OPTIMIZER_BYTES * shard / self.cluster.device.hbm_Bps
        return {"dp": grad["dp"], "fsdp": gather + grad["fsdp"], "optimizer": optimizer}

    def _breakdown(self, lay: Layout, times, busiest, pipe, tails) -> dict[str, float]:
        """Seconds by cause on the busiest pp rank; the parts sum to the step time."""
        stages = held_stages(lay, busiest)
        m = lay.microbatches

        def part(table: dict[str, list[float]]) -> float:
            return m * sum(table[k][s] for k in "FBW" for s in stages)

        tail = max(tails, key=lambda d: sum(d.values()))
        return {
            "compute": part(times.compute),
            "tp": part(times.tp),
            "cp": part(times.cp),
            "ep": part(times.ep),
            "fsdp": part(times.fsdp) + tail["fsdp"],
            "pp": pipe["makespan"] - pipe["free"],
            "bubble": pipe["free"] - pipe["busy"],
            "dp": tail["dp"],
            "optimizer": tail["optimizer"],
        }


# --- helpers ------------------------------------------------------------------------------


def cool_downs(orders: list[list[Action]]) -> list[tuple[tuple[str, ...], bool, tuple]]:
    """Per pp rank of a schedule's `orders`: the kinds ("BW" whole, "B" with W split off)
    of the backwards of stages 0, ..., s-1 for the microbatch j of its last backward (of
    stage s), whether stage 0 runs a W of j after them, and the (kind, stage, count) of the
    computes the rank runs after that backward (`Planner.step_floors`' cool-down)."""
    events = [e for rank in orders for e in rank]
    backward = {(e.stage, e.microbatch): e.kind for e in events if e.kind in ("B", "BW")}
    weights = {(e.stage, e.microbatch) for e in events if e.kind == "W"}
    ends = []
    for rank in orders:
        i = max(k for k, e in enumerate(rank) if e.kind in ("B", "BW"))
        last, j = rank[i].stage, rank[i].microbatch
        after = collections.Counter((e.kind, e.stage) for e in rank[i + 1 :])
        kinds = tuple(backward[s, j] for s in range(last))
        counts = tuple((k, s, c) for (k, s), c in after.items())
        ends.append((kinds, (0, j) in weights, counts))
    return ends


def _exposed(seconds: float, units: int, window: float) -> float:
    """Communication of `units` equal parts, each launched when its part of a `window` of
    compute is done: the last part always shows, the rest hides up to the window."""
    last = seconds / units
    return last + max(0.0, seconds - last - window)


def _calls(elems: float, units: int, bucket: float) -> int:
    """Collective calls a pass over `elems` elements makes: one per unit, or one per
    `bucket` elements where the engine buckets (0: no buckets)."""
    return max(1, math.ceil(elems / bucket)) if bucket else units


def _uniform_split(lay: Layout, m: ModelConfig) -> list[int] | None:
    """Megatron's split: L/S layers a stage, or, where S divides L + 2, the embedding and
    the loss counted as a layer each (one layer fewer on the first and last stages);
    None where neither divides."""
    layers, stages = m.layers, lay.pp * lay.virtual_stages
    if layers % stages == 0:
        return [layers // stages] * stages
    if stages > 1 and (layers + 2) % stages == 0 and (layers + 2) // stages > 1:
        k = (layers + 2) // stages
        return [k - 1] + [k] * (stages - 2) + [k - 1]
    return None


def _node_copies(m: ModelConfig, per_node: int, group: list[int]) -> float:
    """Share of a token's copies bound off its node that cross the network where the
    copies bound for one node travel once (DeepEP): of the k experts drawn uniformly
    without replacement from E, the expected number of other nodes that get at least one,
    over the expected copies bound off the node."""
    nodes = {r // per_node for r in group}
    if len(nodes) == 1:
        return 1.0
    e, k, off = m.experts, m.top_k, len(nodes) - 1
    held = e // len(nodes)  # experts a node holds
    miss = math.prod((e - held - i) / (e - i) for i in range(k))  # a node gets none
    return off * (1 - miss) / (k * off / len(nodes))
