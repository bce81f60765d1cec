"""Pipeline schedules as pure functions: one ordered list of actions per pp rank.

A schedule is data. `build_schedule` returns, for every pp rank, the compute actions
(F, B, W, BW) in the order the rank runs them, with the point-to-point transfers woven in:
a receive sits just before the compute that needs it, a send just after the compute that
produced it. The runtime executes the lists (`p2p.program` says when each transfer is
posted and waited for), the simulator times them and the checker proves them complete and
deadlock-free; all three read the same lists, so prediction and execution cannot disagree.

Stages are global model chunks 0..pp*v-1. `stage_to_rank` places them on ranks. Which
requests a schedule accepts is a rule of the layout (`layout.check_schedule`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from tetrad.layout import check_schedule

StageMb = tuple[int, int]  # (stage, microbatch): one microbatch through one stage
COMPUTE = ("F", "B", "W", "BW")
TRANSFERS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class Action(NamedTuple):
    """One step of a rank's program (a named tuple: a search builds millions).

    kind: "F" forward; "B" backward w.r.t. the stage input only (zero-bubble split);
        "W" weight gradient; "BW" full backward (B and W together); "SEND_F"/"RECV_F"
        an activation; "SEND_B"/"RECV_B" the gradient of an activation.
    stage: global stage index. For a transfer it is the stage that *consumes* the tensor:
        RECV_F(s) brings the input of stage s, SEND_F(s) ships it from stage s-1;
        RECV_B(s) brings the gradient of stage s's output, SEND_B(s) ships it from s+1.
        So (direction, stage, microbatch) names a tensor on both ends of the wire.
    microbatch: microbatch index, 0..m-1.
    peer: for transfers, the pp rank on the other end; None for compute.
    """

    kind: str
    stage: int
    microbatch: int
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"<->r{self.peer}"
        return f"{self.kind}(s{self.stage},mb{self.microbatch}){peer}"


def stage_to_rank(stage: int, pp: int, v: int, schedule: str) -> int:
    """The pp rank holding `stage`.

    Looped placement (every schedule but zb-v): stage k on rank k % pp, so with v = 1
    stage k is rank k. zb-v's V shape: chunk 0 goes down the ranks and chunk 1 comes
    back up, stage k < pp on rank k and stage k >= pp on rank 2*pp - 1 - k, so the first
    and the last stage (embedding and loss) share rank 0.
    """
    if not 0 <= stage < pp * v:
        raise ValueError(f"stage {stage} out of range for pp={pp}, v={v}")
    if schedule == "zb-v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def rank_stages(rank: int, pp: int, v: int, schedule: str) -> list[int]:
    """The stages a rank holds, in increasing order."""
    return [s for s in range(pp * v) if stage_to_rank(s, pp, v, schedule) == rank]


def placement(pp: int, v: int, name: str) -> Callable[[int], int]:
    """`stage_to_rank` bound to one layout: a function stage -> rank."""
    return lambda stage: stage_to_rank(stage, pp, v, name)


def build_schedule(
    name: str, pp: int, microbatches: int, virtual_stages: int = 1, lag: int = 2
) -> list[list[Action]]:
    """Per-rank action lists (compute and transfers interleaved) for schedule `name`.
    `lag`: interleaved warm-up forwards per downstream rank (`_interleaved`)."""
    orders = compute_orders(name, pp, microbatches, virtual_stages, lag)
    place = placement(pp, virtual_stages, name)
    return [add_transfers(order, place, pp * virtual_stages) for order in orders]


def compute_orders(
    name: str, pp: int, microbatches: int, virtual_stages: int = 1, lag: int = 2
) -> list[list[Action]]:
    """Per-rank compute actions of schedule `name`, in the order each rank runs them: what
    `build_schedule` returns without the transfers (the order alone fixes what a rank
    holds when, so memory can be read off it without timing anything)."""
    check_schedule(name, pp, microbatches, virtual_stages)
    if lag not in (1, 2):
        raise ValueError(f"interleaved warm-up lag must be 1 or 2, got lag={lag}")
    if name == "interleaved-1f1b":
        return _interleaved(pp, microbatches, virtual_stages, lag)
    return _ORDERS[name](pp, microbatches, virtual_stages)


def steady_count(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> int:
    """The fewest microbatches whose orders hold at each rank what `microbatches` give at
    their fullest, and end as they do: past the warm-up (at most 2·pp forwards of each
    chunk, `_interleaved`, `_zb_v`) every further microbatch repeats the steady phase
    and shifts the cool-down, so from pp·v microbatches on a rank's in-flight moments and
    the computes after its last backward no longer change (2·pp·v taken: twice that,
    tests/test_plan_activations.py). GPipe holds every microbatch: all of them."""
    if name == "gpipe":
        return microbatches
    return min(microbatches, 2 * pp * virtual_stages)


def compute_only(rank_actions: list[Action]) -> list[Action]:
    """Drop the transfers: the compute order of one rank."""
    return [a for a in rank_actions if a.is_compute]


def wire(a: Action) -> tuple[str, int, int]:
    """The tensor a transfer carries, the same key on both ends: (direction, stage, mb)."""
    return (a.kind[-1], a.stage, a.microbatch)


def add_transfers(order: list[Action], place: Callable[[int], int], n_stages: int) -> list[Action]:
    """Weave receives (just before) and sends (just after) around each compute action."""
    out: list[Action] = []
    ranks = [place(s) for s in range(n_stages)]
    for a in order:
        if a.kind == "W":  # its inputs and outputs stay on the stage
            out.append(a)
            continue
        # F takes its input from the stage before and feeds the next; B (or BW) the reverse
        step = 1 if a.kind == "F" else -1
        src, dst = a.stage - step, a.stage + step
        me = ranks[a.stage] if 0 <= a.stage < n_stages else place(a.stage)  # place's error
        if 0 <= src < n_stages and ranks[src] != me:
            out.append(Action(f"RECV_{a.kind[0]}", a.stage, a.microbatch, ranks[src]))
        out.append(a)
        if 0 <= dst < n_stages and ranks[dst] != me:
            out.append(Action(f"SEND_{a.kind[0]}", dst, a.microbatch, ranks[dst]))
    return out


# --- compute orders: one list of F/B/W/BW per rank --------------------------------------


def _gpipe(pp: int, m: int, v: int) -> list[list[Action]]:
    """All forwards, then all backwards: m microbatches of activations held."""
    return [
        [Action("F", r, i) for i in range(m)] + [Action("BW", r, i) for i in range(m)]
        for r in range(pp)
    ]


def _1f1b(pp: int, m: int, v: int) -> list[list[Action]]:
    """PipeDream-flush: warm-up forwards, then one forward one backward, then drain.

    Rank r runs pp-r-1 warm-up forwards, so it never holds more than pp-r microbatches.
    With m < pp the warm-up is cut to m and the schedule degenerates to GPipe's order.
    It is the interleaved schedule with one chunk per rank and one warm-up forward per
    downstream rank.
    """
    return _interleaved(pp, m, 1, lag=1)


def _interleaved(pp: int, m: int, v: int, lag: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B over v chunks per rank (looped placement).

    Microbatches go through the chunks in groups of pp: forward k of a rank is chunk
    (k // pp) % v of microbatch (k // (pp*v)) * pp + k % pp; backwards visit the chunks
    in reverse. Warm-up covers the v-1 extra chunk rounds plus 2 per downstream rank:
    one would do if transfers were free; the second hides the p2p round trip when they
    are not, at the memory Korthikanti et al. give: rank 0 holds v*pp + pp - 1 chunks
    (L·(1 + (pp-1)/(pp·v)) layers). That is the runtime's (`lag` 2); lag 1 keeps one
    per downstream rank, rank 0 then holding v*pp chunks (L layers, 1F1B's), and its
    transfers stall the next chunk round unless they are hidden otherwise, and it needs
    non-blocking sends (with blocking ones it deadlocks): the planner's description of
    an engine that runs so (`Implementation.interleaved_lag`), not tetrad's runtime.
    """
    total = m * v
    chunks = [(k // pp) % v for k in range(total)]  # forward k's chunk (backwards: reversed)
    microbatch = [(k // (pp * v)) * pp + k % pp for k in range(total)]
    orders = []
    for r in range(pp):
        warm = min((pp - r - 1) * lag + (v - 1) * pp, total)
        fwd = [Action("F", c * pp + r, i) for c, i in zip(chunks, microbatch)]
        bwd = [Action("BW", (v - 1 - c) * pp + r, i) for c, i in zip(chunks, microbatch)]
        steady = [a for pair in zip(fwd[warm:], bwd) for a in pair]  # one F, then one BW
        orders.append(fwd[:warm] + steady + bwd[total - warm :])
    return orders


def _zb_h1(pp: int, m: int, v: int) -> list[list[Action]]:
    """Zero bubble H1 (Qi et al. 2023): 1F1B's order with B and W split.

    B stays on the critical path; rank r defers each W by r microbatches, so the W's
    of the cool-down fill the bubble that 1F1B leaves there. In-flight activations are
    1F1B's (pp - r), plus r deferred weight gradients (r + 1 counting the newest).
    """
    orders = []
    for r, one_f_one_b in enumerate(_1f1b(pp, m, v)):
        order = []
        for a in one_f_one_b:  # each BW becomes its B, then the W of r microbatches before
            order.append(a if a.kind == "F" else Action("B", r, a.microbatch))
            if a.kind == "BW" and a.microbatch >= r:
                order.append(Action("W", r, a.microbatch - r))
        orders.append(order + [Action("W", r, i) for i in range(max(m - r, 0), m)])
    return orders


def _zb_v(pp: int, m: int, v: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, Sec. 6): two chunks per rank in a V, B/W split.

    Built for n = max(m, 2pp-1) microbatches (the fewest that fill the V), then the
    actions of microbatches >= m are dropped; the checker proves the result sound. With
    f = b = w per chunk and m >= 3pp/2 the only idle time is the (pp-1) chunk forwards
    before the bottom of the V gets its first input; each rank holds 2pp chunks of
    activations, 1F1B's memory.
    """
    n = max(m, 2 * pp - 1)
    return [[a for a in _zb_v_rank(r, pp, n) if a.microbatch < m] for r in range(pp)]


def _zb_v_rank(r: int, pp: int, n: int) -> list[Action]:
    c0, c1 = r, 2 * pp - 1 - r
    count: Counter[tuple[str, int]] = Counter()  # actions so far, per (kind, chunk)
    order: list[Action] = []

    def do(*ops: tuple[str, int]) -> None:
        for key in ops:
            order.append(Action(key[0], key[1], count[key]))
            count[key] += 1

    # warm-up: fill chunk 0 down the V, then chunk 1 back up; the bottom of the V
    # (rank pp-1) turns around at once
    for _ in range(2 * (pp - r) - 1):
        do(("F", c0))
    for _ in range(r):
        do(("F", c1), ("F", c0))
    for _ in range(pp - r):
        do(("F", c1), ("B", c1), ("W", c1))
    # steady state: one F, B and W of each chunk per round
    while count["F", c1] < count["F", c0] or count["F", c0] < n:
        if count["F", c0] < n:
            do(("F", c0))
        do(("B", c0), ("W", c0), ("F", c1), ("B", c1), ("W", c1))
    # cool-down: B's first (they are on the critical path), W's fill the gaps
    for _ in range(r):
        do(("B", c0), ("B", c1))
    for _ in range(pp - r):
        do(("B", c0), ("W", c0))
    for c in (c1, c0):
        while count["W", c] < count["B", c]:
            do(("W", c))
    return order


_ORDERS: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "gpipe": _gpipe,
    "1f1b": _1f1b,
    "zb-h1": _zb_h1,
    "zb-v": _zb_v,
}
