"""The transfer program the runtime issues, proven under NCCL's and gloo's semantics: pure."""

from __future__ import annotations

import pytest

from harness import valid_schedule as _valid
from tetrad.layout import SCHEDULES
from tetrad.parallel.pipeline.as_run import (
    Collective,
    as_run,
    last_backward_work,
    with_collectives,
)
from tetrad.parallel.pipeline.check import check_program
from tetrad.parallel.pipeline.p2p import Post, Wait, computes, program
from tetrad.parallel.pipeline.runtime import EARLY, LATE_SENDS
from tetrad.parallel.pipeline.schedules import (
    Action,
    build_schedule,
    compute_only,
    wire,
)

GRID = [
    (name, pp, m, v)
    for name in SCHEDULES
    for pp in (2, 3, 4, 8)
    for m in sorted({1, pp, 2 * pp + 1})
    for v in (1, 2, 3, 4)
    if _valid(name, pp, m, v)
]


def test_grid_covers_every_schedule():
    assert {name for name, *_ in GRID} == set(SCHEDULES)
    assert {(pp, v) for name, pp, _, v in GRID if name == "interleaved-1f1b"} >= {(8, 4), (2, 2)}


@pytest.mark.parametrize("transport", ["nccl", "gloo"])
def test_runtime_program_is_deadlock_free(transport):
    """Every schedule x pp {2,3,4,8} x m {1, pp, 2pp+1} x v, as the runtime issues it on
    that transport (receives posted one compute early on gloo, not on NCCL)."""
    early = EARLY["cuda" if transport == "nccl" else "cpu"]
    for name, pp, m, v in GRID:
        actions = build_schedule(name, pp, m, v)
        check_program(actions, program(actions), transport)
        check_program(actions, program(actions, early=early), transport)


@pytest.mark.parametrize("transport", ["nccl", "gloo"])
def test_runtime_program_with_late_sends_and_other_communicators(transport):
    """The grid again, as it runs: gradient sends waited for late (LATE_SENDS in flight),
    TP/CP collectives inside every F, B and BW, and DP/ZeRO reductions launched from each
    stage's last backward work, on the same stream as the transfers (NCCL's worst case)."""
    early = EARLY["cuda" if transport == "nccl" else "cpu"]
    for name, pp, m, v in GRID:
        actions = build_schedule(name, pp, m, v)
        finals = set().union(*(last_backward_work(acts) for acts in actions))
        try:
            check_program(
                actions,
                program(actions, early=early),
                transport,
                late=LATE_SENDS,
                inner={"F", "B", "BW"},
                finals=finals,
            )
        except ValueError as e:
            raise AssertionError(f"{name} pp={pp} m={m} v={v}: {e}") from None


def test_the_model_sees_what_it_adds():
    """as_run moves only gradient sends' waits, keeping LATE_SENDS in flight, and the
    collectives land where the runtime issues them."""
    actions = build_schedule("1f1b", 2, 4, 1)
    prog = program(actions)[1]
    run = as_run(prog, LATE_SENDS)
    waits = [a for i in run if isinstance(i, Wait) for a in i.ops]
    assert sorted(map(wire, waits)) == sorted(
        wire(a) for i in prog if isinstance(i, Wait) for a in i.ops
    )
    assert [i for i in run if not isinstance(i, Wait)] == [
        i for i in prog if not isinstance(i, Wait)
    ]
    late = [i for i in run if isinstance(i, Wait) and all(a.kind == "SEND_B" for a in i.ops)]
    assert late and late[-1] is run[-1]  # the last ones at the step's end
    full = with_collectives(prog, {"F"}, {("BW", 1, 3)})
    f = [k for k, i in enumerate(full) if isinstance(i, Action) and i.kind == "F"]
    assert all(full[k - 1] == Collective("tp/cp", needed=True) for k in f)
    k = next(
        k
        for k, i in enumerate(full)
        if isinstance(i, Action) and i.kind == "BW" and i.microbatch == 3
    )
    assert full[k + 1] == Collective("dp/fsdp", needed=False)
    assert sum(isinstance(i, Collective) for i in full) == len(f) + 1


def test_early_receives_are_for_gloo_only():
    """Posting receives early is safe on gloo for every schedule, and deadlocks NCCL for
    every schedule somewhere in the grid: why the runtime posts early only on CPU."""
    unsafe = set()
    for name, pp, m, v in GRID:
        actions = build_schedule(name, pp, m, v)
        early = program(actions, early=2)
        check_program(actions, early, "gloo")
        try:
            check_program(actions, early, "nccl")
        except ValueError:
            unsafe.add(name)
    assert unsafe == set(SCHEDULES)
    assert EARLY == {"cpu": 1, "cuda": 0}


def _old_program(actions, lookahead=1):
    """The runtime's former order: each receive posted `lookahead` computes before the one
    needing it, in a batch of its own; each compute's sends in a batch after it; every
    send waited for at the end."""
    out = []
    for acts in actions:
        comps = compute_only(acts)
        recvs = [[] for _ in comps]
        sends = [[] for _ in comps]
        k = -1
        for a in acts:
            k += a.is_compute
            if a.kind.startswith("SEND"):
                sends[k].append(a)
            elif a.kind.startswith("RECV"):
                recvs[k + 1].append(a)
        items = []
        for k, c in enumerate(comps):
            early = [r for j in range(k, min(k + lookahead, len(comps) - 1) + 1) for r in recvs[j]]
            posted = {wire(a) for item in items if isinstance(item, Post) for a in item.ops}
            if new := [r for r in early if wire(r) not in posted]:
                items.append(Post(tuple(new)))
            if recvs[k]:
                items.append(Wait(tuple(recvs[k])))
            items.append(c)
            if sends[k]:
                items.append(Post(tuple(sends[k])))
        all_sends = tuple(s for ss in sends for s in ss)
        out.append(items + ([Wait(all_sends)] if all_sends else []))
    return out


def test_old_order_deadlocks_under_nccl_but_not_gloo():
    """The checker's own test: 1F1B with pp = 2, m = 1, receives posted one step early.
    Rank 0's stream holds "recv B0" before "send F0", rank 1's "recv F0" before "send B0"."""
    actions = build_schedule("1f1b", 2, 1)
    old = _old_program(actions)
    check_program(actions, old, "gloo")  # gloo's receives block nothing but their waiter
    with pytest.raises(ValueError, match="deadlock under NCCL") as err:
        check_program(actions, old, "nccl")
    assert "rank 0" in str(err.value) and "rank 1" in str(err.value)


def test_old_order_fails_across_the_grid():
    """Not a corner case: the old order deadlocks NCCL for every schedule at m = 1."""
    failed = set()
    for name, pp, m, v in GRID:
        actions = build_schedule(name, pp, m, v)
        try:
            check_program(actions, _old_program(actions), "nccl")
        except ValueError:
            failed.add(name)
    assert failed == set(SCHEDULES)


def test_program_runs_the_schedule_and_pairs_batches():
    """Each rank runs its computes in the schedule's order; each batch holds a rank's
    sends together with the receives its peers post at the same point (1F1B's steady
    state: "send F, receive B" paired with the peer's "send B, receive F")."""
    actions = build_schedule("1f1b", 2, 4)
    prog = program(actions)
    for rank in range(2):
        assert computes(prog[rank]) == compute_only(actions[rank])
    mixed = [i for i in prog[0] if isinstance(i, Post) and len({a.kind for a in i.ops}) > 1]
    assert mixed and all({a.kind for a in b.ops} == {"SEND_F", "RECV_B"} for b in mixed)


def test_links_match_in_order():
    """On every link the sender's batches and the receiver's list the same tensors in the
    same order, zb-v (both directions on one link, out of compute order) included."""
    for name, pp, m, v in [("zb-v", 4, 9, 2), ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 3, 5, 1)]:
        prog = program(build_schedule(name, pp, m, v))
        for src in range(pp):
            for dst in range(pp):
                sent = [wire(a) for i in prog[src] if isinstance(i, Post) for a in i.ops
                        if a.kind.startswith("SEND") and a.peer == dst]  # fmt: skip
                got = [wire(a) for i in prog[dst] if isinstance(i, Post) for a in i.ops
                       if a.kind.startswith("RECV") and a.peer == src]  # fmt: skip
                assert sent == got


def test_checker_catches_bad_programs():
    actions = build_schedule("1f1b", 2, 2)
    good = program(actions)

    def broken(rank, edit):
        prog = [list(p) for p in good]
        edit(prog[rank])
        with pytest.raises(ValueError) as err:
            check_program(actions, prog, "nccl")
        return str(err.value)

    def drop_wait(items):
        items[:] = [i for i in items if not isinstance(i, Wait)]

    assert "waited differ" in broken(1, drop_wait)

    def swap_receives(items):  # rank 1 posts "recv F0" where rank 0 sends F1: wrong tensor
        f0, f1 = Action("RECV_F", 1, 0, 0), Action("RECV_F", 1, 1, 0)
        swap = {f0: f1, f1: f0}
        items[:] = [Post(tuple(swap.get(a, a) for a in x.ops)) if isinstance(x, Post) else x
                    for x in items]  # fmt: skip

    assert "waited before posted" in broken(1, swap_receives)
    inter = build_schedule("interleaved-1f1b", 2, 4, 2)
    prog = program(inter)
    i, batch = next(
        (i, x)
        for i, x in enumerate(prog[1])
        if isinstance(x, Post) and [a.kind for a in x.ops] == ["RECV_F"] * 2
    )
    prog[1][i] = Post(batch.ops[::-1])  # two receives from rank 0 in one batch, swapped
    with pytest.raises(ValueError, match="sent as SEND_F.* but received as RECV_F"):
        check_program(inter, prog, "nccl")

    def wait_late(items):  # a receive waited only after the compute that needs it
        first = next(i for i, x in enumerate(items) if isinstance(x, Wait))
        items.insert(first + 2, items.pop(first))

    assert "before waiting" in broken(1, wait_late)
    with pytest.raises(ValueError, match="transport"):
        check_program(actions, good, "mpi")


def test_pp1_programs_are_computes_only():
    (only,) = program(build_schedule("zb-v", 1, 3, 2))
    assert all(isinstance(i, Action) for i in only)


def test_sends_are_freed_slack_computes_later():
    actions = build_schedule("1f1b", 4, 8)
    for slack in (0, 1, 3):
        prog = program(actions, slack=slack)
        check_program(actions, prog, "gloo")
        check_program(actions, prog, "nccl")
        for items in prog:
            n = 0
            posted_at = {}
            for item in items:
                if isinstance(item, Action):
                    n += 1
                elif isinstance(item, Post):
                    posted_at |= {wire(a): n for a in item.ops if a.kind.startswith("SEND")}
                else:
                    for a in item.ops:
                        if a.kind.startswith("SEND"):
                            assert n == min(posted_at[wire(a)] + slack, len(computes(items)))
