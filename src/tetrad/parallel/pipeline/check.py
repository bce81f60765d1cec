"""A pure checker for pipeline schedules: complete, causally ordered, deadlock-free.

`check_schedule` raises ValueError with a precise message, or returns None. It proves:

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
4. Progress under the runtime's semantics: sends are non-blocking (buffered) and a
   receive blocks until its matching send has executed. Posting receives earlier than
   they are waited on does not change this, since posting blocks nothing.

Optional proofs:

- `in_order=True`: on every link src -> dst the SENDs leave in the order the RECVs are
  waited on, so a transport that matches messages in order and ignores tags (NCCL) can
  post each receive just in time. All schedules here pass except zb-v, whose links
  carry activations and gradients both ways; `schedules.steps` gives a posting order
  that is in link order for every schedule.
- `rendezvous=True`: progress when a send blocks until the receiver reaches the
  matching receive (a synchronous, unbuffered send). gpipe passes; the others only
  when pp = 1 or m = 1, since in a 1F1B-style steady state neighbours send to each
  other at once. The runtime must therefore not use blocking sends.
"""

from __future__ import annotations

from collections.abc import Callable

from tetrad.parallel.pipeline.schedules import COMPUTE, TRANSFERS, Action, wire

Key = tuple[str, int, int]  # (kind, stage, microbatch)


def check_schedule(
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
    for rank, rank_actions in enumerate(actions):
        for a in rank_actions:
            _check_placement(a, rank, n_stages, microbatches, stage_to_rank)
    where = _index(actions)
    _check_coverage(where, n_stages, microbatches, stage_to_rank)
    _check_causality(where, n_stages, microbatches, stage_to_rank)
    _check_progress(actions, rendezvous=False)
    if in_order:
        _check_channel_order(actions)
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
    ends = _transfer_ends(a, n_stages, place)
    if ends is None:
        raise ValueError(f"rank {rank}: {a} crosses no stage boundary")
    if ends != (rank, a.peer):
        raise ValueError(f"rank {rank}: {a} must run on rank {ends[0]} with peer {ends[1]}")
    if ends[0] == ends[1]:
        raise ValueError(f"rank {rank}: {a} sends to its own rank")


def _transfer_ends(a: Action, n: int, place: Callable[[int], int]) -> tuple[int, int] | None:
    """(rank that runs it, peer) for a transfer, or None if the edge does not exist."""
    s = a.stage
    producer = s - 1 if a.kind.endswith("_F") else s + 1
    if not 0 <= producer < n:
        return None
    if a.kind.startswith("SEND"):
        return place(producer), place(s)
    return place(s), place(producer)


def _index(actions: list[list[Action]]) -> dict[Key, tuple[int, int]]:
    """(rank, position) of every action; placement makes keys unique across ranks."""
    where: dict[Key, tuple[int, int]] = {}
    for rank, rank_actions in enumerate(actions):
        for i, a in enumerate(rank_actions):
            key = (a.kind, a.stage, a.microbatch)
            if key in where:
                raise ValueError(f"rank {rank}: duplicate {a} at positions {where[key][1]} and {i}")
            where[key] = (rank, i)
    return where


def _check_coverage(
    where: dict[Key, tuple[int, int]], n_stages: int, m: int, place: Callable[[int], int]
) -> None:
    expected: set[Key] = set()
    for s in range(n_stages):
        for mb in range(m):
            expected |= _expected_keys(s, mb, n_stages, place, where)
    if missing := expected - where.keys():
        raise ValueError(f"missing actions: {_fmt(missing)}")
    if extra := where.keys() - expected:
        raise ValueError(f"unexpected actions: {_fmt(extra)}")


def _expected_keys(s: int, mb: int, n: int, place: Callable[[int], int], seen: dict) -> set[Key]:
    keys: set[Key] = {("F", s, mb)}
    split = ("B", s, mb) in seen or ("W", s, mb) in seen
    if split and ("BW", s, mb) in seen:
        raise ValueError(f"stage {s} mb {mb} has both BW and a split B/W")
    keys |= {("B", s, mb), ("W", s, mb)} if split else {("BW", s, mb)}
    if s > 0 and place(s - 1) != place(s):
        keys |= {("SEND_F", s, mb), ("RECV_F", s, mb)}
    if s < n - 1 and place(s + 1) != place(s):
        keys |= {("SEND_B", s, mb), ("RECV_B", s, mb)}
    return keys


def _check_causality(
    where: dict[Key, tuple[int, int]], n_stages: int, m: int, place: Callable[[int], int]
) -> None:
    """Every (earlier, later) pair, both on one rank, must appear in that order."""
    for s in range(n_stages):
        for mb in range(m):
            for first, then in _ordered_pairs(s, mb, n_stages, place, where):
                if where[first] > where[then]:
                    rank = where[then][0]
                    raise ValueError(
                        f"rank {rank}: {_fmt([then])} (position {where[then][1]}) runs "
                        f"before {_fmt([first])} (position {where[first][1]})"
                    )


def _ordered_pairs(
    s: int, mb: int, n: int, place: Callable[[int], int], where: dict
) -> list[tuple[Key, Key]]:
    def bwd(stage: int) -> Key:
        return ("BW", stage, mb) if ("BW", stage, mb) in where else ("B", stage, mb)

    pairs = [(("F", s, mb), bwd(s))]
    if bwd(s)[0] == "B":
        pairs.append((bwd(s), ("W", s, mb)))
    if s > 0 and place(s - 1) != place(s):
        pairs += [(("RECV_F", s, mb), ("F", s, mb)), (bwd(s), ("SEND_B", s - 1, mb))]
    elif s > 0:
        pairs.append((("F", s - 1, mb), ("F", s, mb)))
    if s < n - 1 and place(s + 1) != place(s):
        pairs += [(("F", s, mb), ("SEND_F", s + 1, mb)), (("RECV_B", s, mb), bwd(s))]
    elif s < n - 1:
        pairs.append((bwd(s + 1), bwd(s)))
    return pairs


def _check_progress(actions: list[list[Action]], *, rendezvous: bool) -> None:
    """Run every rank's list to the end, or report where each rank is stuck."""
    pc = [0] * len(actions)
    sent: set[Key] = set()
    moved = True
    while moved:
        moved = False
        for rank in range(len(actions)):
            while pc[rank] < len(actions[rank]) and _can_run(rank, actions, pc, sent, rendezvous):
                a = actions[rank][pc[rank]]
                if a.kind.startswith("SEND"):
                    sent.add(wire(a))
                pc[rank] += 1
                moved = True
    stuck = [
        f"rank {r} at {acts[pc[r]]} (position {pc[r]})"
        for r, acts in enumerate(actions)
        if pc[r] < len(acts)
    ]
    if stuck:
        mode = "blocking" if rendezvous else "non-blocking"
        raise ValueError(f"deadlock with {mode} sends: " + "; ".join(stuck))


def _can_run(
    rank: int, actions: list[list[Action]], pc: list[int], sent: set[Key], rendezvous: bool
) -> bool:
    a = actions[rank][pc[rank]]
    if a.kind.startswith("RECV"):
        return wire(a) in sent
    if a.kind.startswith("SEND") and rendezvous:
        # a blocking send completes only once the peer sits at the matching receive
        peer = actions[a.peer]
        return (
            pc[a.peer] < len(peer)
            and wire(peer[pc[a.peer]]) == wire(a)
            and (peer[pc[a.peer]].kind.startswith("RECV"))
        )
    return True


def _check_channel_order(actions: list[list[Action]]) -> None:
    """Per link, the order of sends must equal the order the receiver waits."""
    sends: dict[tuple[int, int], list[Key]] = {}
    recvs: dict[tuple[int, int], list[Key]] = {}
    for rank, acts in enumerate(actions):
        for a in acts:
            if a.kind.startswith("SEND"):
                sends.setdefault((rank, a.peer), []).append(wire(a))
            elif a.kind.startswith("RECV"):
                recvs.setdefault((a.peer, rank), []).append(wire(a))
    for link, order in sends.items():
        posted = recvs.get(link, [])
        for i, (x, y) in enumerate(zip(order, posted)):
            if x != y:
                raise ValueError(
                    f"link {link[0]}->{link[1]}: message {i} is sent as {x} "
                    f"but received as {y} (in-order transports would mismatch)"
                )


def _fmt(keys: object) -> str:
    return ", ".join(f"{k}(s{s},mb{mb})" for k, s, mb in sorted(keys))
