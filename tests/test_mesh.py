"""Rank arithmetic of the mesh: pure functions, no processes."""

from __future__ import annotations

from itertools import product
from math import prod

import pytest

from tetrad.mesh import AXES, GROUP_AXES, Mesh, axis_groups, coords, rank_of


def deg(pp=1, dp=1, fsdp=1, tp=1, cp=1) -> dict[str, int]:
    return {"pp": pp, "dp": dp, "fsdp": fsdp, "cp": cp, "tp": tp}


COMBOS = [
    deg(),
    deg(dp=4),
    deg(tp=2, dp=2),
    deg(pp=2, tp=2),
    deg(pp=2, dp=2, fsdp=2),
    deg(pp=3, dp=1, fsdp=2, tp=2),
    deg(pp=2, dp=2, fsdp=2, tp=2),
    deg(cp=4),
    deg(cp=2, tp=2, dp=2),
    deg(pp=2, dp=1, fsdp=2, cp=2, tp=2),
]
IDS = ["x".join(str(d[a]) for a in AXES) for d in COMBOS]


@pytest.mark.parametrize("degrees", COMBOS, ids=IDS)
def test_coords_round_trip(degrees):
    world = prod(degrees.values())
    seen = set()
    for r in range(world):
        c = coords(r, degrees)
        assert all(0 <= c[a] < degrees[a] for a in AXES)
        assert rank_of(c, degrees) == r
        seen.add(tuple(c.values()))
    assert len(seen) == world  # a bijection onto the grid


def test_tp_innermost_pp_outermost():
    d = deg(pp=2, dp=2, fsdp=2, tp=2)
    assert [coords(r, d)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [coords(r, d)["pp"] for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    # a TP group is a run of adjacent ranks; a PP group strides by world / pp
    assert axis_groups(d, "tp")[0] == [0, 1]
    assert axis_groups(d, "pp")[0] == [0, 8]


@pytest.mark.parametrize("degrees", COMBOS, ids=IDS)
@pytest.mark.parametrize("name", sorted(GROUP_AXES))
def test_groups_partition_the_world(degrees, name):
    world = prod(degrees.values())
    groups = axis_groups(degrees, name)
    members = sorted(r for g in groups for r in g)
    assert members == list(range(world))
    size = prod(degrees[a] for a in GROUP_AXES[name])
    assert all(len(g) == size for g in groups)
    for g in groups:  # members differ only along the group's axes
        fixed = [a for a in AXES if a not in GROUP_AXES[name]]
        keys = {tuple(coords(r, degrees)[a] for a in fixed) for r in g}
        assert len(keys) == 1
        assert g == sorted(g)


def test_2x2x2x2_groups_explicitly():
    d = deg(pp=2, dp=2, fsdp=2, tp=2)
    assert axis_groups(d, "tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert axis_groups(d, "fsdp") == [[0, 2], [1, 3], [4, 6], [5, 7],
                                      [8, 10], [9, 11], [12, 14], [13, 15]]  # fmt: skip
    assert axis_groups(d, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7],
                                    [8, 12], [9, 13], [10, 14], [11, 15]]  # fmt: skip
    assert axis_groups(d, "pp") == [[i, i + 8] for i in range(8)]
    assert axis_groups(d, "data") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                      [9, 11, 13, 15]]  # fmt: skip
    assert axis_groups(d, "world") == [list(range(16))]


def test_cp_next_to_tp():
    """cp varies just slower than tp: a cp group strides by tp, inside one dp x fsdp cell."""
    d = deg(pp=2, dp=1, fsdp=2, cp=2, tp=2)
    assert axis_groups(d, "cp")[:2] == [[0, 2], [1, 3]]
    assert axis_groups(d, "fsdp")[0] == [0, 4]
    # gradients sum over every rank holding other tokens; sequences are dealt over dp x fsdp
    assert axis_groups(d, "data")[0] == [0, 2, 4, 6]
    assert axis_groups(d, "batch")[0] == [0, 4]
    assert axis_groups(d, "replica")[0] == [0, 2]  # dp x cp: a ZeRO shard's copies
    mesh = Mesh.plan(d, 14)
    assert mesh.coord == {"pp": 1, "dp": 0, "fsdp": 1, "cp": 1, "tp": 0}
    assert mesh["cp"].ranks == [12, 14] and mesh["cp"].rank == 1
    assert mesh["data"].ranks == [8, 10, 12, 14] and mesh["data"].rank == 3
    assert mesh["batch"].ranks == [10, 14] and mesh["batch"].rank == 1


def test_without_cp_data_is_batch():
    d = deg(pp=2, dp=2, fsdp=2, tp=2)
    assert axis_groups(d, "data") == axis_groups(d, "batch")
    assert axis_groups(d, "replica") == axis_groups(d, "dp")


def test_plan_groups_and_indices():
    d = deg(pp=2, dp=2, fsdp=2, tp=2)
    mesh = Mesh.plan(d, 13)  # coords pp=1, dp=1, fsdp=0, tp=1
    assert mesh.coord == {"pp": 1, "dp": 1, "fsdp": 0, "cp": 0, "tp": 1}
    assert mesh["tp"].ranks == [12, 13] and mesh["tp"].rank == 1
    assert mesh["dp"].ranks == [9, 13] and mesh["dp"].rank == 1
    assert mesh["fsdp"].ranks == [13, 15] and mesh["fsdp"].rank == 0
    assert mesh["data"].ranks == [9, 11, 13, 15] and mesh["data"].rank == 2
    assert mesh["pp"].ranks == [5, 13]
    assert mesh["world"].size == 16 and mesh.world == 16
    assert all(g.pg is None for g in mesh.groups.values())  # plan creates no process group


def test_plan_groups_agree_across_ranks():
    d = deg(pp=2, dp=1, fsdp=2, tp=2)
    for name in GROUP_AXES:
        for r, s in product(range(8), repeat=2):
            a, b = Mesh.plan(d, r)[name], Mesh.plan(d, s)[name]
            assert (r in b.ranks) == (a.ranks == b.ranks)


def test_every_rank_has_its_pipeline_ends_group():
    """The first and last stages' ranks share one (the tied embedding's); every other rank
    gets a group of itself, so a middle stage can ask for it too."""
    d = deg(pp=4, dp=1, fsdp=1, tp=2)
    ends = {r: Mesh.plan(d, r)["pp_ends"].ranks for r in range(8)}
    assert ends == {0: [0, 6], 6: [0, 6], 1: [1, 7], 7: [1, 7]} | {r: [r] for r in range(2, 6)}
    assert Mesh.plan(deg(pp=1, dp=2, fsdp=1, tp=1), 1)["pp_ends"].ranks == [1]


def test_bad_degrees_and_ranks():
    with pytest.raises(ValueError, match="rank 4 outside world of size 4"):
        coords(4, deg(dp=4))
    with pytest.raises(ValueError, match="degrees must give every axis"):
        coords(0, {"dp": 2, "tp": 2})
    with pytest.raises(ValueError, match="degrees must give every axis"):
        coords(0, deg(tp=0))
