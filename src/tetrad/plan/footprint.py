"""Memory per device of a layout: exact model state, activations in flight, overhead.

- Model state is `plan.memory`'s, to the byte: the same local parameters (a rank's blocks
  are assembled from a one-block meta model, since every block has the same local
  shapes) through the same per-group `group_bytes`.
- Activations: `plan.activations`' per-layer bytes, per stage, times the microbatches in
  flight on each rank in the simulated timeline (zero-bubble W inputs included).
- Overhead, stated: the transients alive at the rank's peak moment (`plan.peak`: the
  loss chunk, one block's backward, ZeRO's gathered parameters and unsharded gradients,
  the pipeline's receive pool, each term named); the device's workspace (cuBLAS and NCCL
  buffers); and `ALLOCATOR` of everything that comes and goes within a step, for the
  caching allocator's fragmentation. Model state + activations + the transients is what
  an allocator counts as allocated at its peak (`Memory.allocated`); the total adds what
  the device reserves beyond it (and what the peak's moment holds reserved for a stated
  reason, `Peak.reserved`: an eager loss's freed logits).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from tetrad.config import ModelConfig
from tetrad.devices import Device
from tetrad.layout import Layout
from tetrad.models.families import spec_for
from tetrad.models.spec import Saved
from tetrad.parallel.groups import param_groups
from tetrad.parallel.model_state import (
    ModelState,
    expert_names,
    groups_state,
    local_parameters,
)
from tetrad.parallel.pipeline.schedules import Action, rank_stages
from tetrad.plan import activations as act
from tetrad.plan.candidates import block_kinds, cached, held_stages, model_key
from tetrad.plan.engines import Implementation
from tetrad.plan.fp8_gather import block_gathers, fp8_weights
from tetrad.plan.peak import Peak, PeakSettings, busiest_moment, with_optimizer_step

# The caching allocator reserves more than the live tensors: fragmentation of what is
# allocated and freed within a step. A stated share, not fitted per row (torchtitan's eager
# and compiled runs of one layout, with the same tensors, differ by 7%).
ALLOCATOR = 0.10


@dataclass
class Memory:
    """Bytes per device on the fullest rank: model state, activations, overhead."""

    model_state: float
    activations: float
    overhead: float
    capacity: float
    peak: Peak | None = None  # the moment of the peak and its transients, term by term

    @property
    def total(self) -> float:
        """The peak the device must hold: what the fit check and the search compare."""
        return self.model_state + self.activations + self.overhead

    @property
    def allocated(self) -> float:
        """The allocator's peak of live tensors (CUDA's max_memory_allocated; on CPU what
        tests/test_plan_peak.py measures): state + activations + the peak's transients."""
        return self.model_state + self.activations + (self.peak.transient if self.peak else 0.0)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass
class RankFacts:
    """One pp rank's local model: element counts (blocks, the rest) and its state."""

    psi_layers: int
    psi_root: int
    layer_units: int
    state: ModelState
    # elements of expert weights under ep (in psi_layers): outside the fsdp units, in ZeRO
    # units of their own over the expert-data group (docs/moe.md)
    psi_experts: int = 0
    # ranks those expert units are sharded over: |ep_data| under ZeRO, 1 when held whole
    expert_shards: int = 1
    moe_units: int = 0  # MoE blocks held (each one expert unit)
    # under --fp8-all-gather: bytes one block unit's gather moves (n·w, the mean over the
    # rank's blocks: plan/fp8_gather.py), and the FP8 weights whose scales it all-reduces
    fp8_block_bytes: float = 0.0
    fp8_weights: int = 0

    @property
    def psi(self) -> int:
        return self.psi_layers + self.psi_root

    @property
    def psi_dense(self) -> int:
        """Elements the data axes reduce and ZeRO shards: all but the ep-sharded experts."""
        return self.psi - self.psi_experts

    @property
    def block(self) -> float:
        """Elements of one block's ZeRO unit (the experts under ep are not in it)."""
        return (self.psi_layers - self.psi_experts) / max(self.layer_units, 1)

    @property
    def psi_scattered(self) -> int:
        """Elements whose gradients ZeRO accumulates whole and reduce-scatters: the dense
        part, and the experts where they have ZeRO units of their own (held whole, their
        gradients are in the state)."""
        return self.psi_dense + (self.psi_experts if self.expert_shards > 1 else 0)

    @property
    def expert_unit(self) -> float:
        """Elements of one MoE block's expert unit where ZeRO gathers and reduce-scatters
        it as it does a block (sharded over ep_data); 0 where the experts are held whole."""
        if self.expert_shards == 1:
            return 0.0
        return self.psi_experts / max(self.moe_units, 1)


class Footprint:
    """Memory of layouts of one model on one device kind, as `engine` runs them; caches what
    layouts share."""

    def __init__(self, device: Device, recompute: str, engine: Implementation):
        self.device, self.recompute, self.engine = device, recompute, engine
        self._facts: dict[tuple, RankFacts] = {}
        self._places: dict[tuple, list[RankFacts]] = {}
        self._template: dict[tuple, tuple] = {}
        self._fp8: dict[tuple, frozenset[str]] = {}  # a model's FP8 weights (fp8_weights)
        # a search asks the same activations of many degree sets (dp, fsdp, ep do not
        # change them): a stage's bytes by what they read, peaks by timeline and bytes
        self._stage_bytes: dict[tuple, tuple] = {}
        self._states: dict[tuple, ModelState] = {}  # a block's or root's state (`_facts_by_kind`)
        self._in_flight: dict[int, tuple[list[list[Action]], list[act.InFlight], dict]] = {}
        self._moments: dict[tuple, tuple[RankFacts, Peak, float, float]] = {}  # `_RankPeaks`

    def share_caches(self, other: Footprint) -> None:
        """Use `other`'s caches of model facts (they depend on the model and layout only)."""
        self._facts, self._template = other._facts, other._template
        self._places, self._fp8 = other._places, other._fp8

    # --- model state ------------------------------------------------------------------------

    def pipeline_facts(self, lay: Layout, m: ModelConfig, split: list[int]) -> list[RankFacts]:
        """Counts and exact model state of every pp rank (coordinate 0 on the other axes;
        fsdp rank 0 holds the most elements). Looked up first by what the ranks' place is
        made of but for the rank (a search asks a few hundred places tens of thousands of
        times; the layouts of a family, which differ in the microbatch count alone, share
        it), then by what a rank's blocks are (places with the same blocks share them)."""
        state = self._state_key(lay, m)
        place = (state, tuple(split), lay.pp, lay.virtual_stages, lay.schedule)
        known = self._places.get(place)
        if known is None:  # one lookup: the key is long (the model's fields)
            known = [self._rank_facts(lay, m, split, r, state) for r in range(lay.pp)]
            self._places[place] = known
        return known

    def _state_key(self, lay: Layout, m: ModelConfig) -> tuple:
        """What a rank's facts read of `lay` and `m` besides the blocks it holds and whether
        it holds the first and the last stage: the model, tp, the ZeRO shards and stage,
        the dtype, the ep slice (`mesh.expert_groups`: ep, and whether its group spans
        the tp ranks), the expert shards, the residuals, the FP8 gather."""
        shards = self.shards(lay)
        return (model_key(m), lay.tp, shards, lay.zero_stage, lay.compute_dtype, lay.ep,
                lay.ep_spans_tp, _expert_shards(lay, m, shards), _residual_shape(lay),
                lay.fp8_all_gather)  # fmt: skip

    def _rank_facts(
        self, lay: Layout, m: ModelConfig, split: list[int], pp_rank: int, state: tuple
    ) -> RankFacts:
        """Pipeline rank `pp_rank`'s facts; `state`: `_state_key(lay, m)`, made once a place."""
        stages = held_stages(lay, pp_rank)
        kinds = block_kinds(m, split, stages)
        first, last = 0 in stages, len(split) - 1 in stages
        key = (state, kinds, first, last)
        if key not in self._facts:
            shards = self.shards(lay)
            facts = self._facts_by_kind(lay, m, kinds, first, last, state)
            whole = _residual_shape(lay) is not None  # its dp buckets span blocks
            if lay.fp8_all_gather or whole:  # what reads every parameter at once
                named, replicated = self._local_parameters(lay, m, kinds, first, last)
                if whole:
                    facts.state = _state(lay, m, named, replicated, shards)
                gathers = self._fp8_gathers(lay, m, named, replicated, shards)
                facts.fp8_block_bytes, facts.fp8_weights = gathers
            self._facts[key] = facts
        return self._facts[key]

    def _facts_by_kind(self, lay: Layout, m: ModelConfig, kinds: tuple[int, int], first: bool,
                       last: bool, key: tuple) -> RankFacts:  # fmt: skip
        """`RankFacts` of a rank holding `kinds` blocks, from one block of each kind and
        the root, without listing every block (a search builds thousands): the counts
        summed per kind, and the state (`_state` of the rank's parameters) as the sum of
        each block's and the root's, in the order `_local_parameters` lists them (the
        root, dense blocks, then MoE blocks), so both are what the whole list gives, to
        the byte: ZeRO's units are the blocks and the root, each priced alone, and
        unsharded state is per parameter, so each kind of block is priced once for every
        layout of the same tp, shards, stage, dtype and ep (`key`). Not the state where a
        compressed reduction keeps residuals (its dp buckets span blocks: `_rank_facts`
        prices it whole)."""
        root, blocks, replicated = self._pieces(lay, m, first, last)
        experts = expert_names(replicated)

        def count(named, only=None) -> int:
            return sum(math.prod(s) for n, s in named if only is None or n in only)

        held = [(kinds[0], blocks[0][1], False), (kinds[1], blocks[-1][1], True)]
        layers = sum(n * count(block) for n, block, _ in held)
        psi_experts = count(root, experts) + sum(n * count(block, experts) for n, block, _ in held)
        axes = tuple(replicated[n] for n, _ in root)
        state = self._part_state(key + (tuple(root), axes), lay, m, root, replicated)
        for n, block, moe in held:  # dense blocks first, as `_local_parameters` lists them
            state = _added(state, self._part_state(key + (moe,), lay, m, block, replicated), n)
        spread = _expert_shards(lay, m, self.shards(lay)) if psi_experts else 1
        return RankFacts(layers, count(root), sum(kinds), state, psi_experts, spread, kinds[1])

    def _part_state(self, key: tuple, lay: Layout, m: ModelConfig, part, replicated):
        return cached(self._states, key, _state, lay, m, part, replicated, self.shards(lay))

    def _fp8_gathers(self, lay: Layout, m: ModelConfig, named, replicated, shards: int):
        """(bytes of a block unit's FP8 gather, FP8 weights) under --fp8-all-gather."""
        if not lay.fp8_all_gather:
            return 0.0, 0
        inside = cached(self._fp8, model_key(m), fp8_weights, m)
        return block_gathers(named, replicated, shards, m, inside, lay.element_bytes)

    def shards(self, lay: Layout) -> int:
        """Ranks the ZeRO state is sharded over: fsdp, or fsdp x cp for an engine whose
        sharding group takes the cp ranks in (they hold the same weights), at fsdp 1 too
        (torchtitan shards over dp_shard x cp whatever dp_shard is)."""
        return lay.fsdp * lay.cp if self.engine.shards_over_cp else lay.fsdp

    def _local_parameters(
        self, lay: Layout, m: ModelConfig, kinds: tuple[int, int], first: bool, last: bool
    ):
        """`memory.local_parameters` of a rank holding `kinds` = (dense, MoE) blocks (and
        the embedding if `first`, the final norm and head if `last`), from a model of one
        block of each kind: building the whole stack on the meta device for every layout
        would make a search slow. Under ep the template's data ranks are one ep group's,
        so its experts are the slice a rank holds (spanning tp where the layout's does)."""
        root, blocks, replicated = self._pieces(lay, m, first, last)
        spec = spec_for(m)
        embedding = sum(n.startswith(spec.embedding + ".") for n, _ in root)  # first in root
        out, reps = root[:embedding], {n: replicated[n] for n, _ in root}
        for k, kind in enumerate([0] * kinds[0] + [-1] * kinds[1]):  # dense blocks first
            prefix, block = blocks[kind]
            for n, s in block:
                out.append((spec.block_prefix(k) + n[len(prefix) :], s))
                reps[out[-1][0]] = replicated[n]
        return out + root[embedding:], reps

    def _pieces(self, lay: Layout, m: ModelConfig, first: bool, last: bool):
        """(the root parameters the rank keeps, embedding first; each kind of block's
        (prefix, parameters) in the template, dense first; the template's replicated
        axes by name): what `_local_parameters` assembles a rank from."""
        template_layers = min(m.layers, m.dense_layers + 1) if m.moe else 1
        key = (model_key(m), lay.tp, lay.ep, lay.ep_spans_tp)
        if key not in self._template:
            one = dataclasses.replace(m, layers=template_layers)
            self._template[key] = local_parameters(_template_layout(lay), one, 0)
        named, replicated = self._template[key]
        spec = spec_for(m)
        templates = [spec.block_prefix(i) for i in range(template_layers)]
        blocks = [(pre, [(n, s) for n, s in named if n.startswith(pre)]) for pre in templates]
        # the root parameters the stage keeps, as `ModelSpec.prune` leaves them
        keep = spec.stage_parameters([n for n, _ in named], [], first, last)
        root = [(n, s) for n, s in named if spec.block_of(n) is None and n in keep]
        root.sort(key=lambda p: not p[0].startswith(spec.embedding + "."))  # embedding first
        return root, blocks, replicated

    # --- activations and the total ----------------------------------------------------------

    def stage_activations(self, lay: Layout, m: ModelConfig, split: list[int]) -> list[float]:
        """Bytes one microbatch leaves on each global stage after its forward. Under
        context parallelism everything is per local token (s/cp of each sequence), and
        an all-gather core keeps the gathered keys and values of the whole sequence."""
        dt, shards, kernels = lay.dtype_name, self.engine.sp_saves_shards, self.engine.kernels
        b, s = lay.microbatch_size, lay.local_seq
        family = spec_for(m).activations
        layer_bytes = act.total_bytes(self._layer(lay, m), b, s, lay.tp, lay.sp)
        if kernels.attention == "unfused" and self.recompute in ("none", "op"):
            scores = family.attention_scores(m, lay.seq_len)
            layer_bytes += act.total_bytes(scores, b, s, lay.tp)
        gathers = self.engine.cp_gathers_kv and lay.cp_attention != "ring"  # tetrad's ring: its own
        if lay.cp > 1 and gathers and self.recompute not in ("full", "op"):
            gathered = family.cp_gathered_kv(m, lay.tp, dt, lay.cp, lay.seq_len, kernels.gqa_native)
            layer_bytes += act.total_bytes(gathered, b, s, lay.tp, lay.sp)
        chunked = self.engine.chunked_loss and lay.loss_chunk > 0
        head = family.head(m, lay.tp, dt, sp_shards=shards, chunked=chunked)
        out = [n * layer_bytes for n in split]
        out[0] += act.total_bytes(family.embedding(lay.tp, dt), b, s, lay.tp, lay.sp)
        out[-1] += act.total_bytes(head, b, s, lay.tp, lay.sp)
        return out

    def _layer(self, lay: Layout, m: ModelConfig) -> list[Saved]:
        """What one block saves for its backward (the family's `Saved` list)."""
        kernels = self.engine.kernels
        return spec_for(m).activations.layer(
            m, lay.tp, lay.dtype_name, self.recompute, sp_shards=self.engine.sp_saves_shards,
            fused=kernels.fused, gqa_native=kernels.gqa_native,
        )  # fmt: skip

    def stage_shared(self, lay: Layout, m: ModelConfig, split: list[int]) -> list[float]:
        """Of `stage_activations`, the bytes a stage's microbatches in flight share (kept
        once, however many): the block items the family names `SHARED_ACROSS_MICROBATCHES`
        (tetrad's Llama: each layer's rotary tables, made once and read by every backward),
        where the engine keeps them once (`Implementation.shares_tables`), not under
        context parallelism (whose core makes its tables at each call)."""
        names = spec_for(m).activations.SHARED_ACROSS_MICROBATCHES
        if not self.engine.shares_tables or lay.cp > 1 or not names:
            return [0.0] * len(split)
        shared = [it for it in self._layer(lay, m) if it.name in names]
        one = act.total_bytes(shared, lay.microbatch_size, lay.local_seq, lay.tp, lay.sp)
        return [n * one for n in split]

    def stage_pending_w(self, lay: Layout, m: ModelConfig, split: list[int]) -> list[float]:
        """Bytes a microbatch keeps on each stage between its B and its W: the blocks'
        deferred linears, and on the last stage the head's unless a chunked loss computes
        its weight gradient in B."""
        b, s = lay.microbatch_size, lay.local_seq
        family = spec_for(m).activations
        one = act.total_bytes(family.pending_w(m, lay.tp, lay.dtype_name), b, s, lay.tp, lay.sp)
        out = [n * one for n in split]
        if not (self.engine.chunked_loss and lay.loss_chunk > 0):
            head = family.pending_w_head(m, lay.tp, lay.dtype_name)
            out[-1] += act.total_bytes(head, b, s, lay.tp, lay.sp)
        return out

    def rank_activations(
        self, lay: Layout, m: ModelConfig, split: list[int], orders: list[list[Action]],
        pp_rank: int,
    ) -> float:  # fmt: skip
        """Peak activation bytes of pp rank `pp_rank` over the (simulated) step: its
        microbatches in flight, and each stage's output until its send is done."""
        return self._in_flight_bytes(orders, self._stage_bytes_held(lay, m, split))[pp_rank]

    def _stage_bytes_held(self, lay: Layout, m: ModelConfig, split: list[int]) -> tuple:
        """(activations, pending W inputs, output being sent, the part of the activations
        microbatches in flight share) of a microbatch per stage (cached by what they read:
        a search's layouts of other dp degrees share them)."""
        key = (model_key(m), lay.compute_dtype, lay.microbatch_size, lay.local_seq,
               lay.seq_len, lay.tp, lay.sp, lay.cp, lay.cp_attention, lay.loss_chunk,
               tuple(split), self.engine.defers_w(lay))  # fmt: skip
        return cached(self._stage_bytes, key, self._stage_bytes_of, lay, m, split)

    def _stage_bytes_of(self, lay: Layout, m: ModelConfig, split: list[int]) -> tuple:
        per_stage = self.stage_activations(lay, m, split)
        pending = self.stage_pending_w(lay, m, split) if self.engine.defers_w(lay) else []
        sending = spec_for(m).activations.stage_output(m, lay.dtype_name)
        out = act.total_bytes(sending, lay.microbatch_size, lay.local_seq, lay.tp, lay.sp)
        sent = [out] * (len(split) - 1) + [0.0]  # the last stage sends no activation
        shared = self.stage_shared(lay, m, split)
        return tuple(per_stage), tuple(pending), tuple(sent), tuple(shared)

    def _in_flight_bytes(self, orders: list[list[Action]], held_bytes: tuple) -> list[float]:
        """Each pp rank's peak activation bytes (`act.InFlight` of its order, made once
        per order and priced once per `_stage_bytes_held`: both are kept, by the search's
        caches and here, so their ids stay their own)."""
        held = self._in_flight.get(id(orders))
        if held is None or held[0] is not orders:
            held = (orders, [act.InFlight(order) for order in orders], {})
            self._in_flight[id(orders)] = held
        priced = held[2].get(id(held_bytes))
        if priced is None or priced[0] is not held_bytes:
            priced = (held_bytes, [flight.peak(*held_bytes) for flight in held[1]])
            held[2][id(held_bytes)] = priced
        return priced[1]

    def memory(
        self, lay: Layout, m: ModelConfig, split: list[int], facts: list[RankFacts],
        orders: list[list[Action]],
    ) -> Memory:  # fmt: skip
        """The fullest pp rank's memory: model state + activations in flight + overhead."""
        fullest, _ = self._fullest(lay, m, split, facts, orders)
        acts = self._in_flight_bytes(orders, self._stage_bytes_held(lay, m, split))[fullest]
        peak = _RankPeaks(self, lay, m).of(fullest, facts[fullest], acts)
        return Memory(float(facts[fullest].state.total), acts, self._overhead(peak, acts),
                      self.device.hbm_bytes, peak)  # fmt: skip

    def total(
        self, lay: Layout, m: ModelConfig, split: list[int], facts: list[RankFacts],
        orders: list[list[Action]],
    ) -> float:  # fmt: skip
        """`memory(...).total`, the same sum, without building the fullest rank's peak (a
        search asks it of tens of thousands of layouts, most of which do not fit)."""
        return self._fullest(lay, m, split, facts, orders)[1]

    def _fullest(
        self, lay: Layout, m: ModelConfig, split: list[int], facts: list[RankFacts],
        orders: list[list[Action]],
    ) -> tuple[int, float]:  # fmt: skip
        """(the first pp rank of the largest total, as `max` takes it; that total)."""
        in_flight = self._in_flight_bytes(orders, self._stage_bytes_held(lay, m, split))
        peaks, fullest, most = _RankPeaks(self, lay, m), 0, -math.inf
        totals = {}
        for r, acts in enumerate(in_flight):
            key = (id(facts[r]), peaks.ends[r], acts)  # ranks alike in all the total reads
            if key not in totals:
                overhead = peaks.overhead(r, facts[r], acts)
                totals[key] = float(facts[r].state.total) + acts + overhead
            if totals[key] > most:
                fullest, most = r, totals[key]
        return fullest, most

    def _overhead(self, peak: Peak, acts: float) -> float:
        """Workspace + the peak's transients + the allocator's share of transients and
        activations."""
        return self._overhead_of(peak.transient, peak.reserved_bytes, acts)

    def _overhead_of(self, transient: float, reserved: float, acts: float) -> float:
        share = ALLOCATOR * max(transient + acts, 0.0)
        return self.device.workspace_bytes + transient + reserved + share

    def peak(self, lay: Layout, m: ModelConfig, pp_rank: int, fa: RankFacts, acts: float) -> Peak:
        """The moment of pp rank `pp_rank`'s allocator peak and its transients (`plan.peak`):
        the largest of its moments (`peak.busiest_moment`, `peak.with_optimizer_step`)."""
        moment = busiest_moment(lay, m, pp_rank, self._peak_settings(lay, m, fa))
        return with_optimizer_step(moment, acts)

    def _peak_settings(self, lay: Layout, m: ModelConfig, fa: RankFacts) -> PeakSettings:
        return PeakSettings(
            self.engine, self.recompute, *self._zero_buffers(lay, m, fa),
            _late_grads(lay, fa, self.shards(lay)), self._accumulated_grads(lay, fa),
        )  # fmt: skip

    def _accumulated_grads(self, lay: Layout, fa: RankFacts) -> float:
        """Bytes of ZeRO-2/3's whole unsharded gradients accumulated over microbatches (of
        `_zero_buffers`' gradients): from the first microbatch's backward to the
        reduction, so every moment of a later microbatch holds them, its loss included."""
        whole = self.shards(lay) > 1 and lay.zero_stage >= 2 and lay.microbatches > 1
        if whole and _no_sync(self.engine, lay):
            return lay.reduce_bytes * fa.psi_scattered
        if not whole or self.engine.reduce_every_microbatch:
            return 0.0
        return lay.element_bytes * fa.psi_scattered

    def _zero_buffers(self, lay: Layout, m: ModelConfig, fa: RankFacts) -> tuple[float, float]:
        """(ZeRO-3's gathered compute parameters, ZeRO-2/3's unsharded gradients), bytes
        alive at the peak.

        Whole units: the root and `zero_blocks` = (blocks gathered, blocks of gradients
        awaiting their reduce-scatter): FSDP's (2, 2), one block prefetched while one
        computes; tetrad's (1, 0): its backward prefetch starts at a block's middle, off
        the peak, and a block's flat gradient lands at the end of its backward, when its
        activations are freed; the root's gradient lives from the head's backward to the
        embedding's. All of them where tetrad accumulates whole over microbatches (under
        ZeRO-3 with a unit's incoming microbatch gradient besides, measured). An
        engine that caps its live parameters (DeepSpeed) keeps at most that many
        gathered, but never less than one module (its largest linear), and two reduce
        buckets of gradients."""
        c, eng = lay.element_bytes, self.engine
        if self.shards(lay) == 1:
            return 0.0, 0.0
        if _no_sync(eng, lay):  # the stage's weights gathered, its gradients whole in fp32
            gathered = c * fa.psi_scattered if lay.zero_stage == 3 else 0.0
            return gathered, lay.reduce_bytes * fa.psi_scattered
        gathered_blocks, grad_blocks = eng.zero_blocks
        gathered = grads = 0.0
        block = fa.block + fa.expert_unit  # a block's units: its own, and its experts'
        if lay.zero_stage == 3:
            gathered = gathered_blocks * block + fa.psi_root
            if eng.max_live_params:
                gathered = max(min(gathered, eng.max_live_params), _largest_linear(lay, m))
        if lay.zero_stage >= 2:  # unsharded gradients awaiting their reduce-scatter
            # with pp > 1 a stage reduces at its last backward work (whatever m): whole
            whole = (lay.microbatches > 1 or lay.pp > 1) and not eng.reduce_every_microbatch
            units = grad_blocks * block + fa.psi_root
            grads = fa.psi_scattered if whole else units
            if whole and lay.zero_stage == 3 and eng.zero3_incoming_grad:
                grads += block + fa.psi_root  # the microbatch's, before the sum
            if eng.max_live_params and eng.reduce_bucket and not whole:
                grads = max(min(units, 2 * eng.reduce_bucket), _largest_linear(lay, m))
        return c * gathered, c * grads


class _RankPeaks:
    """`Footprint.peak` of one layout's pp ranks: a rank's moments in the forward and
    backward read its place only through whether it holds the first and the last stage
    (`peak.busiest_moment`), and only the optimizer step's reads its activations, so the
    ranks of a pipeline with the same facts share the rest."""

    def __init__(self, footprint: Footprint, lay: Layout, m: ModelConfig):
        self.footprint, self.lay, self.m, self.seen = footprint, lay, m, {}
        self.ends = _ends(lay.pp, lay.virtual_stages, lay.schedule)
        self.shape = (
            model_key(m), lay.tp, lay.sp, lay.microbatch_size, lay.local_seq, lay.seq_len,
            lay.compute_dtype, lay.loss_chunk, footprint.shards(lay), lay.zero_stage,
            lay.microbatches > 1, lay.pp > 1, lay.reduce_bytes,
        )  # fmt: skip

    def of(self, pp_rank: int, fa: RankFacts, acts: float) -> Peak:
        return with_optimizer_step(self._moment(pp_rank, fa)[0], acts)

    def overhead(self, pp_rank: int, fa: RankFacts, acts: float) -> float:
        """`Footprint._overhead` of `of(pp_rank, fa, acts)`, from the busiest moment's
        sums, as `with_optimizer_step` compares them (a search asks it of every rank of
        tens of thousands of layouts; the Peak is built for the fullest rank alone)."""
        _, transient, reserved = self._moment(pp_rank, fa)
        step = -acts if acts else 0  # the optimizer step's one term, where it is not 0
        if step + 0 > transient + reserved:
            transient, reserved = step, 0
        return self.footprint._overhead_of(transient, reserved, acts)

    def _moment(self, pp_rank: int, fa: RankFacts) -> tuple[Peak, float, float]:
        """`busiest_moment` of the rank, with its transient and reserved bytes, kept by
        the footprint by what it reads (`peak.busiest_moment` and `_peak_settings`): the
        rank's facts, whether it holds the first and the last stage, the microbatch's
        shape, tp, dtypes, the loss chunk and what ZeRO's buffers read. The counts of a
        family and the ranks of a pipeline share most (a search asks tens of thousands)."""
        lay = self.lay
        mine = (id(fa), self.ends[pp_rank])  # fa lives as long as self
        if mine in self.seen:
            return self.seen[mine]
        key = (*mine, *self.shape)
        seen = self.footprint._moments.get(key)
        if seen is None or seen[0] is not fa:  # fa kept: its id stays its own
            settings = self.footprint._peak_settings(lay, self.m, fa)
            moment = busiest_moment(lay, self.m, pp_rank, settings)
            seen = (fa, moment, moment.transient, moment.reserved_bytes)
            self.footprint._moments[key] = seen
        self.seen[mine] = seen[1:]
        return seen[1:]


@functools.cache
def _ends(pp: int, v: int, schedule: str) -> tuple[tuple[bool, bool], ...]:
    """Per pp rank: whether it holds the first stage, and the last."""
    last = pp * v - 1
    return tuple(
        (0 in stages, last in stages)
        for stages in (rank_stages(r, pp, v, schedule) for r in range(pp))
    )


def _added(state: ModelState, part: ModelState, n: int) -> ModelState:
    """`state` with `part` added `n` times, one at a time; whole bytes (ints, as the state's
    are) n times at once, the same sum (a search sums thousands of 94-block stacks)."""
    ours, theirs = state.parts, part.parts
    if all(isinstance(v, int) for v in ours + theirs):
        return ModelState(*(a + n * b for a, b in zip(ours, theirs)))
    for _ in range(n):
        state = state + part
    return state


def _no_sync(eng: Implementation, lay: Layout) -> bool:
    """Whether `eng` runs ZeRO under pp as torch's pipelining runs FSDP2 (`pp_no_sync`)."""
    return eng.pp_no_sync and lay.pp > 1 and lay.zero_stage >= 2


def _late_grads(lay: Layout, fa: RankFacts, shards: int) -> float:
    """Gradient bytes of the model state that exist only from the reduction to the
    optimizer step, not in the forward and backward: the fp32 gradients of mixed
    precision (`model_state.replicated_bytes`) and ZeRO's fp32 gradient shards. What
    persists is the full gradient in the compute dtype, kept by plain data parallelism
    and ZeRO-1 (in fp32 that is all of it). `shards`: the ranks the state is sharded
    over (`Footprint.shards`)."""
    persists = shards == 1 or lay.zero_stage == 1
    held = lay.element_bytes * fa.psi if persists else 0.0
    return max(float(fa.state.grads) - held, 0.0)


def _largest_linear(lay: Layout, m: ModelConfig) -> float:
    """Elements of a block's largest weight on one tp rank (an MLP matrix)."""
    return max(m.dim * m.hidden_dim, m.dim * m.dim) / lay.tp


def _residual_shape(lay: Layout) -> tuple | None:
    """What a compressed reduction's residuals depend on (`model_state.residual_bytes`):
    the format, the ranks summed over, the buckets; None without them (with them, a
    rank's state is priced whole, not block by block: their dp buckets span blocks)."""
    if not (lay.compress and lay.error_feedback):
        return None
    return lay.compress, lay.data, lay.expert_data, lay.bucket_bytes, lay.first_bucket_bytes


def _state(lay: Layout, m: ModelConfig, named, replicated, shards: int) -> ModelState:
    """`model_state.model_state_bytes`'s sum over parameter groups (`groups_state`), on
    given local parameters (shard rank 0 of each group's shards): under ZeRO the experts
    have their own units, sharded over the ranks holding the same experts (ep_data),
    beside the rest's."""
    experts = expert_names(replicated)
    spread = _expert_shards(lay, m, shards)
    groups = param_groups([n for n, _ in named], experts, lay.zero_stage, shards, spread)
    return groups_state(groups, named, replicated, lay, m, lambda g: 0)


def _expert_shards(lay: Layout, m: ModelConfig, shards: int) -> int:
    """Ranks the expert weights' ZeRO state is split over: under ZeRO (`shards` > 1) their
    expert-data group, the dp·fsdp·cp·tp / ep ranks of a stage holding the same slice
    (`mesh.expert_groups`); without it, or experts, none (1: the facts of a dense model's
    layouts stay shared across dp)."""
    if shards == 1 or not m.moe:
        return 1
    return lay.expert_data


def _template_layout(lay: Layout) -> Layout:
    """`lay` on one pp rank of one stage whose data ranks are one ep group's (no fsdp, no
    cp): its experts are the slice a rank of `lay` holds (spanning tp where `lay`'s do)."""
    ep_data = lay.ep // lay.tp if lay.ep_spans_tp else lay.ep
    degrees = {"pp": 1, "dp": ep_data, "fsdp": 1, "cp": 1, "tp": lay.tp}
    return dataclasses.replace(
        lay, degrees=degrees, virtual_stages=1, split=None, split_measured=False,
        local_seq=lay.seq_len, microbatch_size=lay.global_batch // (ep_data * lay.microbatches),
    )  # fmt: skip
