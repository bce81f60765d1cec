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
shrink, so counts whose memory floor overflows are skipped unsimulated, and the walk
stops at the first count slower than the one before (time is taken to be unimodal in the
count: the bubble shrinks, per-microbatch overheads grow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from tetrad.config import Config
from tetrad.layout import Layout
from tetrad.plan.cost import Planner, Prediction


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


def degrees(cfg: Config, world: int, gpus_per_node: int, space: Space) -> Iterator[dict]:
    """(dp, fsdp, tp, pp, cp) whose product is `world`, honouring `space`'s fixed degrees.
    cp only where the sequence splits into 2·cp chunks."""
    for tp in _choices(space.tp, [t for t in divisors(world) if t <= gpus_per_node]):
        pps = [p for p in divisors(world // tp) if p <= cfg.model.layers] if world % tp == 0 else []
        for pp in _choices(space.pp, pps):
            if world % (tp * pp):
                continue
            rest = world // (tp * pp)
            cps = [c for c in divisors(rest) if cfg.train.seq_len % (2 * c) == 0]
            for cp in _choices(space.cp, [1] + [c for c in cps if c > 1]):
                if rest % cp:
                    continue
                data = rest // cp
                for fsdp in _choices(space.fsdp, divisors(data)):
                    if data % fsdp == 0 and (space.dp is None or space.dp * fsdp == data):
                        deg = {"dp": data // fsdp, "fsdp": fsdp, "tp": tp, "pp": pp, "cp": cp}
                        for ep in _choices(space.ep, ep_degrees(cfg.model.experts, data, tp)):
                            yield deg | {"ep": ep}


def ep_degrees(experts: int, data: int, tp: int) -> list[int]:
    """Expert-parallel degrees a stage of `data` data ranks and `tp` tensor ranks allows
    (`layout.check_ep`): divisors of the expert count that divide the data ranks, or are
    a multiple of tp dividing data·tp. [1] for a dense model."""
    if not experts:
        return [1]
    return [e for e in divisors(experts)
            if data % e == 0 or (e % tp == 0 and data % (e // tp) == 0)]  # fmt: skip


def _schedules(cfg: Config, space: Space) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs for `cfg`'s degrees."""
    p, layers = cfg.parallel, cfg.model.layers
    if p.pp == 1:
        return [("1f1b", 1)]
    names = space.pp_schedule or ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
    names = [names] if isinstance(names, str) else names
    out = []
    for name in names:
        if name == "interleaved-1f1b":
            even = [v for v in range(2, 9) if layers % (p.pp * v) == 0]
            out += [(name, v) for v in _choices(space.virtual_stages, even)]
        elif name == "zb-v":
            out += [(name, 2)]
        else:
            out += [(name, 1)]
    return out


def families(cfg: Config, world: int, gpus_per_node: int, space: Space) -> Iterator[list[Config]]:
    """Valid layouts of `cfg`'s model and batch on `world` ranks, grouped into families
    that differ only in the microbatch count (ascending)."""
    for deg in degrees(cfg, world, gpus_per_node, space):
        zeros = _choices(space.zero_stage, [2, 3] if deg["fsdp"] > 1 else [3])
        for zero in zeros:
            sp = deg["tp"] > 1 and not cfg.model.moe  # MoE: tp without sp (layout.check_ep)
            base = _with(cfg, **deg, zero_stage=zero, sp=sp)
            data = base.parallel.data_ranks
            if cfg.train.global_batch % data:
                continue
            counts = [m for m in divisors(cfg.train.global_batch // data) if m >= deg["pp"]]
            for name, v in _schedules(base, space):
                family = [
                    c
                    for m in _choices(space.microbatches, counts)
                    if _valid(
                        c := _with(base, microbatches=m, pp_schedule=name, virtual_stages=v),
                        world,
                    )  # fmt: skip
                ]
                if family:
                    yield family


def _valid(cfg: Config, world: int) -> bool:
    try:
        Layout.build(cfg, world)
    except ValueError:
        return False
    return True


def _with(cfg: Config, **parallel) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def _best_of_family(planner: Planner, family: list[Config]) -> list[tuple[float, float, Config]]:
    """(step time, memory, layout) of the family's counts that fit, walked upward until
    the time stops improving."""
    out: list[tuple[float, float, Config]] = []
    capacity = planner.cluster.device.hbm_bytes
    for cand in family:
        if planner.memory_floor(cand) > capacity:
            continue
        pred = planner.predict(cand, detail=False)
        if not pred.memory.fits:
            continue
        if out and pred.step_time_s >= out[-1][0]:
            break
        out.append((pred.step_time_s, pred.memory.total, cand))
    return out


def search(
    planner: Planner, cfg: Config, world: int, space: Space = Space(), top: int = 10
) -> list[Prediction]:
    """The `top` fastest predicted layouts that fit in memory, fastest first."""
    found: list[tuple[float, float, int, Config]] = []
    capacity = planner.cluster.device.hbm_bytes
    fitted: set[tuple[int, int]] = set()  # (tp, pp) with a layout that fits at cp = 1
    for family in families(cfg, world, planner.cluster.gpus_per_node, space):
        first = family[0]
        p = first.parallel
        if p.cp > 1 and space.cp is None and (p.tp, p.pp) in fitted:
            continue  # those ranks as data parallelism fit, and are faster (no exchange)
        try:
            states = [planner.rank_facts(first, r).state.total for r in range(p.pp)]
        except ValueError:
            continue  # the runtime cannot build this model so (e.g. a module without a tp plan)
        if max(states) >= capacity:
            continue  # the model state alone overflows, whatever the microbatches
        for t, mem, cand in _best_of_family(planner, family):
            found.append((t, mem, len(found), cand))
            if p.cp == 1:
                fitted.add((p.tp, p.pp))
    found.sort(key=lambda x: x[:3])
    return [planner.predict(cand) for *_, cand in found[:top]]
