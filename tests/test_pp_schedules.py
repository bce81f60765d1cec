"""Pipeline schedules and their checker: pure, no processes."""

from __future__ import annotations

import pytest

from harness import valid_schedule as _valid
from tetrad.layout import SCHEDULES
from tetrad.parallel.pipeline.check import check_actions
from tetrad.parallel.pipeline.schedules import (
    Action,
    build_schedule,
    compute_only,
    placement,
    stage_to_rank,
)

GRID = [
    (name, pp, m, v)
    for name in SCHEDULES
    for pp in range(1, 9)
    for m in range(1, 17)
    for v in range(1, 5)
    if _valid(name, pp, m, v)
]


def _check(actions, name, pp, m, v, **kw):
    check_actions(actions, pp, m, v, placement(pp, v, name), **kw)


def _kinds(rank_actions):
    return " ".join(f"{a.kind}{a.microbatch}" for a in compute_only(rank_actions))


def test_names():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")


def test_grid_is_sound():
    """Every valid (schedule, pp 1..8, m 1..16, v 1..4) is complete and deadlock-free."""
    assert {name for name, *_ in GRID} == set(SCHEDULES)
    for name, pp, m, v in GRID:
        actions = build_schedule(name, pp, m, v)
        # zb-v sends both directions on one link out of order; p2p.program handles that
        _check(actions, name, pp, m, v, in_order=name != "zb-v")


def test_rendezvous_semantics():
    """Blocking sends: GPipe is safe; 1F1B (every rank sending while its peer sends) is
    not, which is why the runtime must post sends non-blocking."""
    for pp in range(1, 6):
        for m in (1, 3, 8):
            _check(build_schedule("gpipe", pp, m), "gpipe", pp, m, 1, rendezvous=True)
    with pytest.raises(ValueError, match="deadlock with blocking sends"):
        _check(build_schedule("1f1b", 2, 2), "1f1b", 2, 2, 1, rendezvous=True)


@pytest.mark.parametrize(
    "args, words",
    [
        (("nope", 2, 4, 1), ["'nope'"]),
        (("1f1b", 0, 4, 1), ["pp=0"]),
        (("1f1b", 2, 0, 1), ["microbatches=0"]),
        (("gpipe", 2, 4, 2), ["gpipe", "2"]),
        (("zb-h1", 2, 4, 3), ["zb-h1", "3"]),
        (("interleaved-1f1b", 4, 6, 2), ["microbatches=6", "pp=4"]),
        (("interleaved-1f1b", 2, 4, 1), ["virtual_stages", "1"]),
        (("zb-v", 2, 4, 1), ["virtual_stages=2", "1"]),
    ],
)
def test_invalid_requests_name_the_values(args, words):
    with pytest.raises(ValueError) as err:
        build_schedule(*args)
    for word in words:
        assert word in str(err.value)


def test_placement():
    assert [stage_to_rank(s, 4, 1, "1f1b") for s in range(4)] == [0, 1, 2, 3]
    assert [stage_to_rank(s, 2, 3, "interleaved-1f1b") for s in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [stage_to_rank(s, 4, 2, "zb-v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="stage 8"):
        stage_to_rank(8, 4, 2, "zb-v")


def test_1f1b_order():
    acts = build_schedule("1f1b", 4, 6)
    assert _kinds(acts[0]) == "F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 BW3 BW4 BW5"
    assert _kinds(acts[3]) == "F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4 F5 BW5"


def test_1f1b_pp2_one_microbatch():
    acts = build_schedule("1f1b", 2, 1)
    assert (
        " ".join(map(str, acts[0]))
        == "F(s0,mb0) SEND_F(s1,mb0)<->r1 RECV_B(s0,mb0)<->r1 BW(s0,mb0)"
    )
    assert (
        " ".join(map(str, acts[1]))
        == "RECV_F(s1,mb0)<->r0 F(s1,mb0) BW(s1,mb0) SEND_B(s0,mb0)<->r0"
    )


def test_gpipe_and_zb_h1_orders():
    assert _kinds(build_schedule("gpipe", 2, 3)[1]) == "F0 F1 F2 BW0 BW1 BW2"
    zb = build_schedule("zb-h1", 3, 4)
    # rank r defers W by r microbatches; the cool-down's W's fill 1F1B's bubble
    assert _kinds(zb[0]) == "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3"
    assert _kinds(zb[2]) == "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"


def test_interleaved_order_megatron():
    acts = build_schedule("interleaved-1f1b", 2, 4, 2)
    rank0 = [(a.kind, a.stage, a.microbatch) for a in compute_only(acts[0])]
    # forwards go through chunk 0 then chunk 1 in groups of pp microbatches
    assert rank0[:5] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2)]
    # the first backward is of the last chunk, after warm-up 2*(pp-1) + (v-1)*pp = 4
    assert rank0[5] == ("BW", 2, 0)


def test_transfers_hug_their_compute():
    for name, pp, m, v in [("1f1b", 4, 5, 1), ("interleaved-1f1b", 2, 4, 3), ("zb-v", 3, 6, 2)]:
        for rank_actions in build_schedule(name, pp, m, v):
            for i, a in enumerate(rank_actions):
                if a.kind.startswith("RECV"):
                    nxt = rank_actions[i + 1]
                    assert nxt.is_compute and (nxt.stage, nxt.microbatch) == (a.stage, a.microbatch)
                elif a.kind.startswith("SEND"):
                    assert rank_actions[i - 1].is_compute


def test_pp1_has_no_transfers():
    for name, v in [("1f1b", 1), ("interleaved-1f1b", 3), ("zb-v", 2)]:
        (only,) = build_schedule(name, 1, 4, v)
        assert all(a.is_compute for a in only)


# --- the checker catches what it promises to ------------------------------------------


def _swap(rank_actions, x, y):
    i, j = rank_actions.index(x), rank_actions.index(y)
    rank_actions[i], rank_actions[j] = rank_actions[j], rank_actions[i]


def _broken(mutate, name="1f1b", pp=2, m=2, v=1):
    actions = build_schedule(name, pp, m, v)
    mutate(actions)
    with pytest.raises(ValueError) as err:
        _check(actions, name, pp, m, v)
    return str(err.value)


def test_checker_missing_and_duplicate():
    assert "missing" in _broken(lambda a: a[1].remove(Action("F", 1, 1)))
    assert "duplicate" in _broken(lambda a: a[0].append(Action("F", 0, 0)))
    assert "missing" in _broken(lambda a: a[1].remove(Action("RECV_F", 1, 0, 0)))


def test_checker_order():
    msg = _broken(lambda a: _swap(a[0], Action("F", 0, 1), Action("BW", 0, 1)))
    assert "BW(s0,mb1)" in msg and "before F(s0,mb1)" in msg
    msg = _broken(lambda a: _swap(a[1], Action("RECV_F", 1, 1, 0), Action("F", 1, 1)))
    assert "before RECV_F(s1,mb1)" in msg
    msg = _broken(
        lambda a: _swap(a[0], Action("B", 0, 0), Action("W", 0, 0)), name="zb-h1", pp=2, m=2
    )
    assert "W(s0,mb0)" in msg and "before B(s0,mb0)" in msg
    # same-rank neighbours (zb-v's bottom of the V): F(s) must follow F(s-1)
    msg = _broken(
        lambda a: _swap(a[0], Action("F", 0, 0), Action("F", 1, 0)), name="zb-v", pp=1, m=1, v=2
    )
    assert "before F(s0,mb0)" in msg


def test_checker_placement_and_peers():
    def move_bw(actions):
        actions[0].append(actions[1].pop(actions[1].index(Action("BW", 1, 0))))

    assert "belongs on rank 1" in _broken(move_bw)
    msg = _broken(lambda a: a[0].__setitem__(1, Action("SEND_F", 1, 0, 0)))
    assert "peer 1" in msg


def test_checker_deadlock():
    def mutate(actions):
        # rank 0 waits for a gradient before shipping the activation that produces it
        send = actions[0].pop(actions[0].index(Action("SEND_F", 1, 0, 1)))
        actions[0].insert(actions[0].index(Action("BW", 0, 0)), send)

    assert "deadlock with non-blocking sends" in _broken(mutate, m=1)


def test_checker_in_order_links():
    actions = build_schedule("zb-v", 2, 3, 2)
    with pytest.raises(ValueError, match="in-order transports"):
        _check(actions, "zb-v", 2, 3, 2, in_order=True)
