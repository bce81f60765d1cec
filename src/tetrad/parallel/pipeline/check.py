"""A pure checker for pipeline schedules: complete, causally ordered, deadlock-free.

`check_actions` raises ValueError with a precise message, or returns None. It proves:

1. Placement: every compute action runs on the rank holding its stage; every transfer
   runs on the right end of the right link, with the right peer, and never to itself.
2. Coverage: every (stage, microbatch) has exactly one F, and exactly one BW or exactly
   one B and one W; every cross-rank edge has exactly one SEND and one matching RECV
   (same direction, stage and microbatch) on the peer, and there are no others.
3. Causality: on each rank a compute follows the receive that brings its input, a send
   follows the compute that made its tensor, B (or BW) follows F, W follows B, and where
   neighbouring stages share a rank, F(s) follows F(s-1) and B(s) follows B(s+1).
   With the matching of 2, every F therefore runs after the previous stage's F and
   every B after the next stage's B, across ranks too.
4. Progress of the lists themselves (the simulator's semantics): sends are buffered and
   a receive blocks until its matching send has executed. Whether the transfers as the
   runtime issues them progress on a real transport is `check_program`'s question.

Optional proofs:

- `in_order=True`: on every link src -> dst the SENDs leave in the order the RECVs are
  waited on, so a transport that matches messages in order and ignores tags (NCCL) can
  post each receive just in time. All schedules here pass except zb-v, whose links
  carry activations and gradients both ways; `p2p.program` orders each link's
  transfers alike on both ends for every schedule.
- `rendezvous=True`: progress when a send blocks until the receiver reaches the
  matching receive (a synchronous, unbuffered send). gpipe passes; the others only
  when pp = 1 or m = 1, since in a 1F1B-style steady state neighbours send to each
  other at once. The runtime must therefore not use blocking sends.

`check_program` proves what the runtime actually issues (`p2p.program`: batches posted,
waits, computes) against a transport's semantics:

- "nccl": per rank, one stream runs the batches in issue order; a batch starts once the
  batch before it completed and the computes issued before it ran (the stream waits for
  the compute stream when a batch is posted); a transfer completes once its batch and
  its peer's matching batch have both started, and a batch once all of its transfers
  did; a wait holds the compute stream until the whole batch completes (one work per
  batch). Messages on a link match in issue order, whatever their tags.
- "gloo": one host thread per rank; posting never blocks; waiting for a receive blocks
  until the matching send is posted, waiting for a send until the matching receive is.

`check_program(..., late=L, inner=..., finals=...)` models two more things the runtime does
(`as_run.py` rewrites each program into what actually runs):

- late gradient sends: a SEND_B's wait is not where the program has it; the runtime keeps
  the send in flight and waits for it once more than L others are (or at the step's
  end). Its `done()` poll may wait for it sooner: both the program's point and the
  latest point are checked, and waiting between the two adds no constraint the first
  lacks (progress here is monotone: every event's preconditions are conjunctions).
- other communicators: the collectives of TP and CP inside a compute (the compute needs
  them: `inner`), and the DP/ZeRO reductions a stage's last backward work launches
  (`finals`: nothing in the schedule waits for them; the step's end does). Under "nccl"
  each is a batch of its own on the rank's one stream, in issue order with the p2p
  batches: the worst case, in which the GPU runs one communicator's kernels at a time.
  Its group peers (the same pipeline rank of another tp, cp or dp index) run the same
  program, so it completes once this rank starts it. Under gloo a collective blocks only
  its own caller until those same peers arrive, which they do: nothing is added.
  On one in-order stream such a collective only makes the compute after it wait for the
  batches posted before it, and every batch a peer could be waiting for from this rank is
  queued behind those same batches anyway: the grid passing with them is expected, and
  the check keeps it so should the runtime start waiting in a new place.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from itertools import product

from tetrad.parallel.pipeline.as_run import ActionKey, Collective, as_run, with_collectives
from tetrad.parallel.pipeline.p2p import Item, Post, Wait, computes
from tetrad.parallel.pipeline.program_sim import simulate_program
from tetrad.parallel.pipeline.schedules import COMPUTE, TRANSFERS, Action, compute_only, wire
from tetrad.parallel.pipeline.simulate import Costs, run_all

Link = tuple[int, int]  # (sending rank, receiving rank)
Op = tuple[int, Action]  # (rank, a transfer it issues)


def check_actions(
    actions: list[list[Action]],
    pp: int,
    microbatches: int,
    virtual_stages: int,
    stage_to_rank: Callable[[int], int],
    *,
    rendezvous: bool = False,
    in_order: bool = False,
) -> None:
    """Raise ValueError unless `actions` is a sound schedule (see the module docstring)."""
    if len(actions) != pp:
        raise ValueError(f"expected {pp} rank lists, got {len(actions)}")
    n_stages = pp * virtual_stages
    where: dict[ActionKey, tuple[int, int]] = {}  # (rank, position) of every action
    for rank, rank_actions in enumerate(actions):
        for i, a in enumerate(rank_actions):
            _check_placement(a, rank, n_stages, microbatches, stage_to_rank)
            key = (a.kind, a.stage, a.microbatch)  # placed: unique across ranks
            if key in where:
                raise ValueError(f"rank {rank}: duplicate {a} at positions {where[key][1]} and {i}")
            where[key] = (rank, i)
    expected, pairs = _rules(where, n_stages, microbatches, stage_to_rank)
    if missing := expected - where.keys():  # coverage (2)
        raise ValueError(f"missing actions: {_fmt(missing)}")
    if extra := where.keys() - expected:
        raise ValueError(f"unexpected actions: {_fmt(extra)}")
    for first, then in pairs:  # causality (3): each pair, both on one rank, in order
        if where[first] > where[then]:
            raise ValueError(
                f"rank {where[then][0]}: {_fmt([then])} (position {where[then][1]}) runs "
                f"before {_fmt([first])} (position {where[first][1]})"
            )
    _check_progress(actions, rendezvous=False)
    if in_order:  # an in-order transport matches each link's messages in send order
        _match([[a for a in acts if not a.is_compute] for acts in actions])
    if rendezvous:
        _check_progress(actions, rendezvous=True)


def _check_placement(
    a: Action, rank: int, n_stages: int, m: int, place: Callable[[int], int]
) -> None:
    if a.kind not in COMPUTE + TRANSFERS:
        raise ValueError(f"rank {rank}: unknown action kind {a.kind!r} in {a}")
    if not (0 <= a.stage < n_stages and 0 <= a.microbatch < m):
        raise ValueError(f"rank {rank}: {a} outside stages 0..{n_stages - 1}, mb 0..{m - 1}")
    if a.is_compute:
        if place(a.stage) != rank:
            raise ValueError(f"rank {rank}: {a} belongs on rank {place(a.stage)}")
        return
    producer = a.stage - 1 if a.kind.endswith("_F") else a.stage + 1
    if not 0 <= producer < n_stages:
        raise ValueError(f"rank {rank}: {a} crosses no stage boundary")
    sender, receiver = place(producer), place(a.stage)
    ends = (sender, receiver) if a.kind.startswith("SEND") else (receiver, sender)
    if ends != (rank, a.peer):
        raise ValueError(f"rank {rank}: {a} must run on rank {ends[0]} with peer {ends[1]}")
    if ends[0] == ends[1]:
        raise ValueError(f"rank {rank}: {a} sends to its own rank")


def _rules(
    where: dict, n: int, m: int, place: Callable[[int], int]
) -> tuple[set[ActionKey], list[tuple[ActionKey, ActionKey]]]:
    """The actions a sound schedule holds, and the pairs of them that one rank must run
    in that order: per (stage, microbatch), and per boundary between stages s-1 and s."""

    def bwd(stage: int, mb: int) -> ActionKey:
        return ("BW", stage, mb) if ("BW", stage, mb) in where else ("B", stage, mb)

    keys: set[ActionKey] = set()
    pairs: list[tuple[ActionKey, ActionKey]] = []
    for s, mb in product(range(n), range(m)):
        f, b, w = ("F", s, mb), bwd(s, mb), ("W", s, mb)
        split = ("B", s, mb) in where or w in where
        if split and ("BW", s, mb) in where:
            raise ValueError(f"stage {s} mb {mb} has both BW and a split B/W")
        keys |= {f, ("B", s, mb), w} if split else {f, ("BW", s, mb)}
        pairs += [(f, b), (b, w)] if split else [(f, b)]
        if s == 0:
            continue
        if place(s - 1) != place(s):  # a transfer each way across the boundary
            send_f, recv_f = ("SEND_F", s, mb), ("RECV_F", s, mb)
            send_b, recv_b = ("SEND_B", s - 1, mb), ("RECV_B", s - 1, mb)
            keys |= {send_f, recv_f, send_b, recv_b}
            pairs += [
                (("F", s - 1, mb), send_f),
                (recv_f, f),
                (b, send_b),
                (recv_b, bwd(s - 1, mb)),
            ]
        else:  # neighbours on one rank: F(s) after F(s-1), B(s-1) after B(s)
            pairs += [(("F", s - 1, mb), f), (b, bwd(s - 1, mb))]
    return keys, pairs


def _check_progress(actions: list[list[Action]], *, rendezvous: bool) -> None:
    """Run every rank's list to the end, or report where each rank is stuck."""
    at = [0] * len(actions)  # each rank's position
    sent: set[ActionKey] = set()

    def step(a: Action, rank: int) -> bool:
        if a.kind.startswith("RECV") and wire(a) not in sent:
            return False
        if a.kind.startswith("SEND"):
            # a blocking send completes only once the peer sits at the matching receive
            peer = actions[a.peer][at[a.peer] : at[a.peer] + 1]
            if rendezvous and not (
                peer and peer[0].kind.startswith("RECV") and wire(peer[0]) == wire(a)
            ):
                return False
            sent.add(wire(a))
        at[rank] += 1
        return True

    mode = "blocking" if rendezvous else "non-blocking"
    run_all(actions, step, f"deadlock with {mode} sends")


# --- the programs the runtime issues ------------------------------------------------------


def check_program(
    actions: list[list[Action]],
    programs: list[list[Item]],
    transport: str = "nccl",
    *,
    late: int | None = None,
    inner: Collection[str] = (),
    finals: Collection[ActionKey] = (),
) -> None:
    """Raise ValueError unless `programs` run `actions` to the end on `transport`
    ("nccl" or "gloo"; see the module docstring). `late`: the runtime's bound on gradient
    sends left in flight (None: waited where the program says); `inner`: the compute
    kinds holding collectives of another communicator; `finals`: the computes that
    launch reductions of another communicator."""
    if transport not in ("nccl", "gloo"):
        raise ValueError(f"unknown transport {transport!r}; expected 'nccl' or 'gloo'")
    if len(programs) != len(actions):
        raise ValueError(f"expected {len(actions)} rank programs, got {len(programs)}")
    for rank, (acts, items) in enumerate(zip(actions, programs)):
        _check_items(rank, acts, items)
    # each rank's transfers in the order it posts them
    match = _match([[a for i in items if isinstance(i, Post) for a in i.ops] for items in programs])
    variants = [programs] if late is None else [programs, [as_run(p, late) for p in programs]]
    for progs in variants:
        if transport == "nccl":
            _nccl_progress([with_collectives(p, inner, finals) for p in progs], match)
        else:  # gloo's: a wait lasts until both ends are posted, as program_sim times it
            try:
                simulate_program(progs, Costs())
            except ValueError as e:
                raise ValueError(f"deadlock under gloo's semantics: {e}") from None


def _check_items(rank: int, acts: list[Action], items: list[Item]) -> None:
    """The program runs the rank's computes in order, posts each of its transfers once
    (a send after the compute making it) and waits for each once, after posting it, a
    receive before the compute that needs it."""
    if computes(items) != compute_only(acts):
        raise ValueError(f"rank {rank}: the program's computes differ from the schedule's")
    # where each compute runs, and each transfer is posted and waited for
    ran: dict[Action, int] = {}
    posted: dict[Action, int] = {}
    waited: dict[Action, int] = {}
    for i, item in enumerate(items):
        for a in (item,) if isinstance(item, Action) else item.ops:
            if isinstance(item, Action):
                ran.setdefault(a, i)
            elif isinstance(item, Post):
                if a in posted:
                    raise ValueError(f"rank {rank}: {a} posted twice")
                posted[a] = i
            elif a not in posted or a in waited:
                raise ValueError(f"rank {rank}: {a} waited before posted, or twice")
            else:
                waited[a] = i
    transfers = {a for a in acts if not a.is_compute}
    if posted.keys() != transfers or waited.keys() != transfers:
        raise ValueError(f"rank {rank}: transfers posted or waited differ from the schedule's")
    for j, a in enumerate(acts):
        if a.is_compute:
            continue
        near = acts[j - 1] if a.kind.startswith("SEND") else acts[j + 1]
        if a.kind.startswith("SEND") and posted[a] < ran[near]:
            raise ValueError(f"rank {rank}: {a} posted before {near} makes its tensor")
        if a.kind.startswith("RECV") and waited[a] > ran[near]:
            raise ValueError(f"rank {rank}: {near} runs before waiting for {a}")


def _match(transfers: list[list[Action]]) -> dict[Op, Op]:
    """Pair the k-th send on each link with the k-th receive (in-order matching), given
    each rank's transfers in the order it posts them."""
    links: dict[Link, tuple[list[Op], list[Op]]] = {}  # per link: its sends, its receives
    for rank, ops in enumerate(transfers):
        for a in ops:
            send = a.kind.startswith("SEND")
            link = (rank, a.peer) if send else (a.peer, rank)
            links.setdefault(link, ([], []))[not send].append((rank, a))
    match: dict[Op, Op] = {}
    for (src, dst), (out, into) in links.items():
        if len(out) != len(into):
            raise ValueError(f"link {src}->{dst}: {len(out)} sends, {len(into)} receives")
        for i, (s, r) in enumerate(zip(out, into)):
            if wire(s[1]) != wire(r[1]):
                raise ValueError(
                    f"link {src}->{dst}: message {i} is sent as {s[1]} but received as "
                    f"{r[1]} (in-order transports would hand it to the wrong tensor)"
                )
            match[s], match[r] = r, s
    return match


def _batches(
    items: list[Item | Collective],
) -> tuple[list[tuple[Action, ...]], list[int], list[int]]:
    """Per batch: its p2p ops and the computes issued before it; per compute: the last
    batch waited for before it (-1: none). A collective is a batch of no p2p op (it
    starts when the stream reaches it; its peers, in step, start it too)."""
    ops: list[tuple[Action, ...]] = []
    before, need = [], []
    batch_of: dict[Action, int] = {}
    last = -1
    for item in items:
        if isinstance(item, Wait):
            last = max([last] + [batch_of[a] for a in item.ops])
        elif isinstance(item, Action):
            need.append(last)
        else:  # a batch: a Post, or a Collective (no p2p op)
            if isinstance(item, Collective) and item.needed:
                last = len(ops)
            posted = item.ops if isinstance(item, Post) else ()
            batch_of |= dict.fromkeys(posted, len(ops))
            ops.append(posted)
            before.append(len(need))
    return ops, before, need


def _nccl_progress(programs: list[list[Item]], match: dict[Op, Op]) -> None:
    """Run the streams (see the module docstring) to the end, or report where they stop."""
    shape = [_batches(items) for items in programs]
    batch_of = [{a: b for b, ops in enumerate(batches) for a in ops} for batches, _, _ in shape]
    head = [0] * len(programs)  # per rank: the batch its stream runs now
    done = [0] * len(programs)  # per rank: computes run

    def started(rank: int, b: int) -> bool:
        return b < head[rank] or (b == head[rank] and done[rank] >= shape[rank][1][b])

    def peers_started(r: int) -> bool:
        peers = [match[(r, a)] for a in shape[r][0][head[r]]]
        return all(started(p, batch_of[p][a]) for p, a in peers)

    moved = True
    while moved:
        moved = False
        for r, (batches, _, need) in enumerate(shape):
            while True:
                if done[r] < len(need) and need[done[r]] < head[r]:
                    done[r] += 1
                elif head[r] < len(batches) and started(r, head[r]) and peers_started(r):
                    head[r] += 1
                else:
                    break
                moved = True
    stuck = [
        f"rank {r}: stream at batch {head[r]} of {len(batches)}, compute {done[r]} of {len(need)}"
        for r, (batches, _, need) in enumerate(shape)
        if head[r] < len(batches) or done[r] < len(need)
    ]
    if stuck:
        raise ValueError("deadlock under NCCL's semantics: " + "; ".join(stuck))


def _fmt(keys: object) -> str:
    return ", ".join(f"{k}(s{s},mb{mb})" for k, s, mb in sorted(keys))
