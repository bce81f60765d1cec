"""Layout search: the layouts tetrad can run for a world size, ranked by predicted step time.

Enumerated: tp (a divisor of the world, at most one node), pp (a divisor of what is
left, at most the layer count), cp (a divisor of what is left whose 2·cp chunks divide
the sequence), the data ranks split into dp x fsdp, for a mixture of experts the ep
degree (a divisor of the expert count the data ranks, or whole tp groups of them, can
hold: `layout.check_ep`), the ZeRO stage 2 or
3 (when fsdp > 1), the pipeline schedule with its virtual stages (interleaved: v from 2
to 8 with even chunks, pp·v dividing the layers), and the microbatch count (a divisor of
the batch per data rank; at least pp when pp > 1). Each candidate must pass
`Layout.build` (which holds every rule the runtime has, ZeRO's composability too). A
`Space` fixes any of these instead.

Pruned, as never better in this model: SP off when tp > 1 (SP moves the same bus bytes
with less memory and 1/t of the pipeline's p2p); GPipe (1F1B's bubble, more memory);
ZeRO-1 (ZeRO-2's traffic, more memory); cp > 1 for a (tp, pp) that already fits at
cp = 1 (the same ranks as data parallelism do the same per-rank work and gradient
traffic without the key/value exchange: cp only buys memory, or a batch too small to
split). Degrees whose model state alone overflows the
device are dropped before any schedule is simulated. Within a family (everything fixed but the
microbatch count) counts are walked upward: activation memory falls as microbatches
shrink, so counts whose memory overflows are skipped unsimulated, and the walk
stops at the first count slower than the one before (time is taken to be unimodal in the
count: the bubble shrinks, per-microbatch overheads grow).

Pruned, as unable to win (the answer is the unpruned search's, tested): a count whose
`Planner.step_floor` (the busiest rank's own work plus the longest tail, no simulation)
is slower than the `top`-th best time found so far ends its family's walk, since the
floor does not fall as the count grows; families are walked by their first count's
floor, lowest first, until one is slower (`_walk`). Memory is read off each rank's action
order at the schedule's steady count (`Planner.held_order`, its moments priced by
`activations.InFlight`), not a simulated timeline, and asked before a count's floors;
candidates are validated only when a walk reaches them and their memory fits.
`search(jobs=N)` walks the families in N processes, the same answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from tetrad.config import ModelConfig
from tetrad.layout import Layout, ep_fits
from tetrad.plan.candidates import candidate
from tetrad.plan.cost import Planner, Prediction
from tetrad.plan.footprint import Memory


@dataclass(frozen=True)
class Space:
    """What to enumerate. A degree given here is fixed; None lets the search choose.
    Likewise zero_stage, microbatches and virtual_stages; pp_schedule is one name or a
    tuple of names to choose from."""

    dp: int | None = None
    fsdp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero_stage: int | None = None
    pp_schedule: str | tuple[str, ...] | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(fixed: int | str | None, options: list) -> list:
    return [fixed] if fixed is not None else options


def degrees(m: ModelConfig, seq_len: int, world: int, gpus_per_node: int,
            space: Space) -> Iterator[dict]:  # fmt: skip
    """(dp, fsdp, tp, pp, cp) whose product is `world`, honouring `space`'s fixed degrees.
    cp only where the sequence splits into 2·cp chunks."""
    for tp in _choices(space.tp, [t for t in divisors(world) if t <= gpus_per_node]):
        pps = [p for p in divisors(world // tp) if p <= m.layers] if world % tp == 0 else []
        for pp in _choices(space.pp, pps):
            if world % (tp * pp):
                continue
            rest = world // (tp * pp)
            cps = [c for c in divisors(rest) if seq_len % (2 * c) == 0]
            for cp in _choices(space.cp, [1] + [c for c in cps if c > 1]):
                if rest % cp:
                    continue
                data = rest // cp
                for fsdp in _choices(space.fsdp, divisors(data)):
                    if data % fsdp == 0 and (space.dp is None or space.dp * fsdp == data):
                        deg = {"dp": data // fsdp, "fsdp": fsdp, "tp": tp, "pp": pp, "cp": cp}
                        for ep in _choices(space.ep, ep_degrees(m.experts, data, tp)):
                            yield deg | {"ep": ep}


def ep_degrees(experts: int, data: int, tp: int) -> list[int]:
    """Expert-parallel degrees a stage of `data` data ranks and `tp` tensor ranks allows
    (`layout.check_ep`): divisors of the expert count that divide the data ranks, or are
    a multiple of tp dividing data·tp. [1] for a dense model."""
    if not experts:
        return [1]
    return [e for e in divisors(experts) if ep_fits(e, data, tp)]


def _schedules(layers: int, pp: int, space: Space) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs for `pp` ranks of a stack of `layers`."""
    if pp == 1:
        return [("1f1b", 1)]
    names = space.pp_schedule or ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
    names = [names] if isinstance(names, str) else names
    out = []
    for name in names:
        if name == "interleaved-1f1b":
            even = [v for v in range(2, 9) if layers % (pp * v) == 0]
            out += [(name, v) for v in _choices(space.virtual_stages, even)]
        else:  # zb-v: two chunks a rank
            out.append((name, 2 if name == "zb-v" else 1))
    return out


Candidate = dict[str, Any]  # a candidate's parallel settings, not yet validated


def families(base: Layout, m: ModelConfig, world: int, gpus_per_node: int,
             space: Space) -> Iterator[list[Candidate]]:  # fmt: skip
    """Candidate layouts of model `m` with `base`'s batch and sequence on `world` ranks,
    grouped into families that differ only in the microbatch count (ascending). Not yet
    validated: `valid` builds the Layouts of those that pass `Layout.build`, as a walk
    reaches them (validating every count up front was a search's largest cost)."""
    gb = base.global_batch
    for deg in degrees(m, base.seq_len, world, gpus_per_node, space):
        for zero in _choices(space.zero_stage, [2, 3] if deg["fsdp"] > 1 else [3]):
            sp = deg["tp"] > 1
            data = deg["dp"] * deg["fsdp"]
            if gb % data:
                continue
            counts = [n for n in divisors(gb // data) if n >= deg["pp"]]
            for name, v in _schedules(m.layers, deg["pp"], space):
                family = [
                    deg | {"zero_stage": zero, "sp": sp, "microbatches": n, "pp_schedule": name,
                           "virtual_stages": v}
                    for n in _choices(space.microbatches, counts)
                ]  # fmt: skip
                if family:
                    yield family


def valid(base: Layout, m: ModelConfig, family: list[Candidate]) -> Iterator[tuple[int, Layout]]:
    """(index, layout) of the family's candidates that pass `Layout.build`, in order."""
    for k, cand in enumerate(family):
        try:
            yield k, candidate(base, m, **cand)
        except ValueError:
            continue


def _counts(family: list[Candidate], first: Layout) -> Iterator[tuple[int, Layout]]:
    """(index, layout) of each of the family's candidates, not validated: `first`, a
    valid one's layout, with the candidate's microbatch count (what `candidate` builds
    where the count is valid: the counts differ in nothing else,
    tests/test_plan_speed.py)."""
    for k, cand in enumerate(family):
        n = cand["microbatches"]
        size = first.global_batch // (first.data_ranks * n)
        yield k, dataclasses.replace(first, microbatches=n, microbatch_size=size)


class _Ranking:
    """The layouts found so far, and the time a layout must beat to enter the top.

    Entries are keyed (time, memory, family, count): the last two are the enumeration
    order, so ties break the same way whichever layouts pruning left unsimulated.
    `shared`: the `top` best times every process of a search has found, fastest first (a
    shared array: `_in_processes`), which the threshold reads and `add` keeps; without it
    a list of this ranking's own."""

    def __init__(self, top: int, shared: Any = None):
        self.top = top
        self.found: list[tuple[float, float, int, int, Layout]] = []
        # the `top` best times, ascending (inf until found): `shared`'s where there is one
        self.fastest = [math.inf] * max(top, 0) if shared is None else shared
        self.lock = contextlib.nullcontext() if shared is None else shared.get_lock()

    def add(self, t: float, mem: float, family: int, count: int, cand: Layout) -> None:
        self.found.append((t, mem, family, count, cand))
        if self.top > 0:
            with self.lock:
                if t < self.fastest[-1]:
                    self.fastest[:] = sorted([*self.fastest[:-1], t])

    @property
    def threshold(self) -> float:
        """The `top`-th best time found so far (inf until `top` are found): a layout
        slower than it cannot be in the answer, whatever comes later."""
        return self.fastest[-1] if self.top > 0 else -math.inf  # -inf: nothing is asked for

    def within(self, floor: float) -> bool:
        """Whether a layout whose step is at least `floor` could enter the answer."""
        return floor * (1 - 1e-9) <= self.threshold

    def best(self) -> list[tuple[float, float, int, int, Layout]]:
        """The `top` best entries (time, memory, family, count, layout), best first."""
        return sorted(self.found, key=lambda f: f[:4])[: max(self.top, 0)]


def _walk_family(planner: Planner, base: Layout, m: ModelConfig, family: list[Candidate],
                 first: Layout, index: int, ranking: _Ranking, prune: bool) -> bool:  # fmt: skip
    """Add the family's counts that fit to `ranking`, walked upward until the time stops
    improving; whether any count it priced fits.

    With `prune`, the walk ends at the first count whose `Planner.step_floor` (a lower
    bound of its step, unsimulated) is slower than the ranking's threshold: the floor
    does not fall as the count grows (every per-microbatch term is a fixed cost plus
    one that shrinks with the microbatch, and the hidden windows shrink with it:
    `tests/test_plan_search.py` checks it), so no later count can enter the answer
    either. A count whose higher floor (with the pipeline's warm-up and cool-down:
    `step_floors`) is slower cannot enter the answer itself, but may fall below a later
    count that can and so end the walk before it: it waits, unpriced, until such a count
    comes, and is walked then, in its place (at the walk's end it is not needed: what it
    would add is slower than the threshold, which only falls). The answer is the unpruned
    walk's.

    A count's memory is asked before its floors (its total, then, once validated, its
    memory; a count is validated only once its total fits): a count that does not fit adds
    nothing, and the floor that would have ended the walk there ends it at the next count
    that fits, whose floor is no lower (the threshold has not moved between them), so the
    walk adds what it did; a large model's counts mostly do not fit, and their memory is
    cheaper than their floors."""
    last, waiting, fits = math.inf, [], False
    for k, cand, memory in _fitting(planner, base, m, family, first):
        if prune:
            floor, started = planner.step_floors(cand, m)
            if not ranking.within(floor):
                break
            if not ranking.within(started):
                waiting.append((k, cand, memory))
                continue
        for j, lay, mem in waiting + [(k, cand, memory)]:
            step = planner.predict(lay, m, detail=False, memory=mem).step_time_s
            if step >= last:
                return True
            last, fits = step, True
            ranking.add(step, mem.total, index, j, lay)
        waiting = []
    return fits


def _fitting(planner: Planner, base: Layout, m: ModelConfig, family: list[Candidate],
             first: Layout) -> Iterator[tuple[int, Layout, Memory]]:  # fmt: skip
    """(index, layout, memory) of the family's counts that fit in memory, in order: a
    count's memory total asked first (its schedule's order is all it needs besides the
    family's), then the count validated (where it fits: most counts of a large model do
    not), then its memory built."""
    capacity, facts = planner.cluster.device.hbm_bytes, planner.facts(first, m)
    for k, cand in _counts(family, first):
        try:
            if planner.memory_total(cand, m, facts) > capacity:
                continue
            cand = candidate(base, m, **family[k])
        except ValueError:  # a count its schedule does not take, or the layout does not
            continue
        memory = planner.memory(cand, m)
        if memory.fits:
            yield k, cand, memory


def _first_valid(base: Layout, m: ModelConfig, family: list[Candidate]) -> Layout | None:
    """The layout of the family's first candidate that passes `Layout.build` (None: none)."""
    return next(valid(base, m, family), (0, None))[1]


def _state_fits(planner: Planner, m: ModelConfig, lay: Layout | None) -> bool:
    """Whether the runtime can build the model on the ranks of `lay`, a family's first
    valid count (None: a family none of whose counts is valid has nothing to walk), and
    every pp rank's model state alone fits (it does not depend on the count). A model with
    a module its tp plan lacks (Qwen3's QK-norm under tp, today) cannot be built, and is
    left out rather than failing the search."""
    if lay is None:
        return False
    try:
        facts = planner.facts(lay, m)
    except ValueError:
        return False
    return max(fa.state.total for fa in facts) < planner.cluster.device.hbm_bytes


def _fits_somewhere(planner: Planner, base: Layout, m: ModelConfig,
                    families: list[tuple[list[Candidate], Layout]]) -> bool:  # fmt: skip
    """Whether any count of any of `families` (each with its first valid layout) fits."""
    return any(next(_fitting(planner, base, m, f, first), None) for f, first in families)


def search(
    planner: Planner, base: Layout, m: ModelConfig, world: int, space: Space = Space(),
    top: int = 10, prune: bool = True, jobs: int = 1,
) -> list[Prediction]:  # fmt: skip
    """The `top` fastest predicted layouts of model `m` with `base`'s batch, sequence,
    dtypes and loss chunk on `world` ranks that fit in memory, fastest first.

    prune=False simulates every count the walk reaches (the reference the pruned search is
    tested against: the same answer). jobs > 1 walks the families in that many processes
    (`_in_processes`), the same answer, where processes can be forked (one elsewhere).
    Each prediction has its step-time range (`priced`)."""
    listed = list(enumerate(families(base, m, world, planner.cluster.gpus_per_node, space)))
    groups = _by_pp(listed)
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():  # not on Windows
        found = _in_processes(jobs, groups, (planner, base, m, space, top, prune))
    else:
        ordered = [f for group in groups for f in group]
        found = [(f, None) for f in _walk(ordered, planner, base, m, space, top, prune)]
    best = sorted(found, key=lambda f: f[0][:4])[: max(top, 0)]
    return [pred or priced(planner, entry[-1], m) for entry, pred in best]


def priced(planner: Planner, lay: Layout, m: ModelConfig) -> Prediction:
    """`lay`'s prediction in detail, with its step-time range (`Planner.with_range`)."""
    return planner.with_range(lay, m, planner.predict(lay, m))


def _walk(listed: list[tuple[int, list[Candidate]]], planner: Planner, base: Layout,
          m: ModelConfig, space: Space, top: int, prune: bool,
          shared: Any = None) -> list[tuple]:  # fmt: skip
    """The `top` best (time, memory, family, count, layout) of the (index, family) pairs
    `listed`, against one ranking (`_Ranking`'s `shared`). With `prune` the families whose
    state fits are walked by their first count's step floor, lowest first (the likeliest
    fastest first, so the threshold falls early), until one is over the threshold: no
    count of it or of any after it can enter the answer (`_walk_family`). The answer does
    not depend on the order: the ranking breaks ties by the enumeration's index, and the
    cp rule reads every cp = 1 family of its (tp, pp), collected first."""
    ranking = _Ranking(top, shared)
    at_cp1: dict[tuple[int, int], list] = {}  # (tp, pp) -> cp = 1 (family, first layout)
    fitted: dict[tuple[int, int], bool] = {}  # (tp, pp): a cp = 1 layout fits
    walks = []
    for index, family in listed:
        first = _first_valid(base, m, family)
        if not _state_fits(planner, m, first):
            continue  # no count of it can be built, or fit
        if first.cp == 1:
            at_cp1.setdefault((first.tp, first.pp), []).append((family, first))
        walks.append((planner.step_floor(first, m) if prune else 0.0, index, family, first))
    for floor, index, family, first in sorted(walks, key=lambda w: w[:2]):
        if not ranking.within(floor):
            break  # nor can any after it
        key = (first.tp, first.pp)
        if first.cp > 1 and space.cp is None:
            if key not in fitted:  # asked only where the answer could change the result
                fitted[key] = _fits_somewhere(planner, base, m, at_cp1.get(key, []))
            if fitted[key]:
                continue  # those ranks as data parallelism fit, and are faster (no exchange)
        if _walk_family(planner, base, m, family, first, index, ranking, prune) and first.cp == 1:
            fitted[key] = True  # a cp = 1 layout of (tp, pp) fits: no need to look for one
    return ranking.best()


def _by_pp(listed: list[tuple[int, list[Candidate]]]) -> list[list[tuple[int, list[Candidate]]]]:
    """The (index, family) pairs grouped by pp, each group in enumeration order, the
    costliest groups (counts x pp) first: the walk's order. What `_walk` carries from one
    family to the next (the cp rule's) is per (tp, pp), so each group is walked as in
    enumeration order, and the answer does not depend on the groups' order (ties break by
    the enumeration's index); the deep pipelines of a large model, walked first, find fast
    layouts early, which prunes the rest more (Llama 3 70B on 256 GPUs: 12.0 s of CPU in
    enumeration order, 8 s so)."""
    groups: dict[int, list[tuple[int, list[Candidate]]]] = {}
    for index, family in listed:
        groups.setdefault(family[0]["pp"], []).append((index, family))
    return sorted(groups.values(), key=lambda g: -sum(len(f) * f[0]["pp"] for _, f in g))


def _in_processes(jobs: int, groups: list[list[tuple[int, list[Candidate]]]], work: tuple) -> list:
    """`_walk` of `groups` in `jobs` forked processes (each inherits the planner and its
    caches, and the pp groups share no orders or rank facts), each group taken by the
    next process free and walked against a ranking of its own, whose threshold is also the
    best `top` times of all (shared memory): a layout is pruned only where `top` others
    are faster, so none of the answer is, and the answer is the union's `top` best.
    `work`: `_walk`'s arguments after the families, which each process is given once, as
    it starts (forked: not pickled)."""
    context = multiprocessing.get_context("fork")
    shared = context.Array("d", [math.inf] * max(work[-2], 0))
    with ProcessPoolExecutor(jobs, context, _take_work, ((*work, shared),)) as pool:
        return [found for part in pool.map(_walk_group, groups) for found in part]


_work: tuple = ()  # in a search's process only: `_walk`'s arguments after the families


def _take_work(work: tuple) -> None:
    global _work
    _work = work


def _walk_group(group: list[tuple[int, list[Candidate]]]) -> list[tuple]:
    """(entry, its `priced` prediction or None) of `_walk` of one group: an entry no
    slower than the best `top` times of all so far (which only fall) may be in the answer,
    and is priced here, by the caches that found it (the parent's are cold)."""
    planner, _, m, _, top, _, shared = _work
    found, threshold = _walk(group, *_work), shared[-1] if top > 0 else -math.inf
    return [(f, priced(planner, f[-1], m) if f[0] <= threshold else None) for f in found]
