"""The device mesh: five degrees -> each rank's coordinates -> its process groups.

Axis order, outermost first, is (pp, dp, fsdp, cp, tp). TP is innermost so a TP group is
a run of adjacent ranks, which torchrun places on one node: TP communicates inside every
layer and needs the fastest links (NVLink). CP comes next: it exchanges keys and values
inside every attention layer, so it wants the next-fastest links. PP is outermost because
it sends the least (one activation per microbatch per boundary), so it is the axis that
tolerates crossing the slowest links between nodes. This is Megatron's tp-cp-dp-pp order.

The arithmetic (`coords`, `rank_of`, `axis_groups`) is pure and tested without processes;
`Mesh.build` only turns its answers into `torch.distributed` groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Protocol

AXES = ("pp", "dp", "fsdp", "cp", "tp")  # outermost first
# "batch" (dp x fsdp): the ranks that read different sequences of the batch. "data" (dp x
# fsdp x cp): the ranks that hold different tokens, so the ones whose gradients (and token
# counts) are summed: a cp rank holds part of every sequence of its batch rank. "replica"
# (dp x cp): what a ZeRO shard is replicated over (the fsdp shards' all-reduce).
# "world" is every rank (the one-scalar agreements: loss, grad norm, skip). Each axis is a
# group of its own too.
GROUP_AXES = {axis: (axis,) for axis in AXES} | {
    "batch": ("dp", "fsdp"),
    "data": ("dp", "fsdp", "cp"),
    "replica": ("dp", "cp"),
    "world": AXES,
}


class MeshShape(Protocol):
    """What `Mesh.build` reads of a `Layout` (or a `ParallelConfig`): the five degrees and
    the expert-parallel degree. A protocol, so the mesh sits below the layout."""

    @property
    def degrees(self) -> Any: ...

    @property
    def ep(self) -> int: ...


def coords(rank: int, degrees: dict[str, int]) -> dict[str, int]:
    """Coordinates of `rank` on each axis (tp varies fastest)."""
    if set(degrees) != set(AXES) or any(d < 1 for d in degrees.values()):
        raise ValueError(f"degrees must give every axis {AXES} a value >= 1, got {degrees}")
    world = prod(degrees.values())
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of size {world}")
    out = {}
    for axis in reversed(AXES):
        rank, out[axis] = divmod(rank, degrees[axis])
    return {axis: out[axis] for axis in AXES}


def rank_of(coord: dict[str, int], degrees: dict[str, int]) -> int:
    """Inverse of `coords`."""
    rank = 0
    for axis in AXES:
        rank = rank * degrees[axis] + coord[axis]
    return rank


def axis_groups(degrees: dict[str, int], group: str) -> list[list[int]]:
    """Partition of all ranks into groups that differ only along `group`'s axes."""
    varying = GROUP_AXES[group]
    buckets: dict[tuple[int, ...], list[int]] = {}
    for r in range(prod(degrees.values())):
        c = coords(r, degrees)
        key = tuple(c[a] for a in AXES if a not in varying)
        buckets.setdefault(key, []).append(r)
    return list(buckets.values())


def ep_spans_tp(data: int, ep: int) -> bool:
    """Whether an ep group takes whole tp groups: the `data` ranks of a stage (dp·fsdp·cp)
    are too few to hold its ep ranks alone (`expert_groups`)."""
    return ep > 1 and data % ep != 0


def expert_groups(degrees: dict[str, int], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ep groups (ranks that together hold every expert, the i-th member the i-th
    slice) and the expert-data groups (ranks of a stage holding the same slice: their
    expert gradients are summed), each in ascending rank order as torch numbers a group.
    The tp ranks of a stage split the tokens they hold alike before dispatching them
    (`parallel.expert`), so an expert-data group spans tp too.

    Inside a pipeline stage the data ranks are ordered fsdp fastest, then dp, then cp, and
    an ep group is a run of them: it borrows sharded-data ranks first (they already split
    the model state), then dp, then cp. When ep is more than those provide (`layout.check_ep`
    allows it as a multiple of tp) the group takes whole tp groups, and the experts are no
    longer replicated over tp. `Layout.check_ep` has checked `ep`."""
    tp = degrees["tp"]
    data = degrees["dp"] * degrees["fsdp"] * degrees["cp"]
    spans_tp = ep_spans_tp(data, ep)
    width = ep // tp if spans_tp else ep  # data ranks per ep group
    ep_of: dict[tuple[int, ...], list[int]] = {}
    edp_of: dict[tuple[int, int], list[int]] = {}  # (stage, slot in its ep group)
    for r in range(prod(degrees.values())):
        c = coords(r, degrees)
        b = (c["cp"] * degrees["dp"] + c["dp"]) * degrees["fsdp"] + c["fsdp"]
        key = (c["pp"], b // width) if spans_tp else (c["pp"], c["tp"], b // width)
        ep = ep_of.setdefault(key, [])
        edp_of.setdefault((c["pp"], len(ep)), []).append(r)  # its slot: the members before it
        ep.append(r)
    return list(ep_of.values()), list(edp_of.values())


def pp_end_groups(degrees: dict[str, int]) -> list[list[int]]:
    """First and last rank of every pipeline group (they share a tied embedding)."""
    if degrees["pp"] == 1:
        return []
    return [[g[0], g[-1]] for g in axis_groups(degrees, "pp")]


@dataclass
class Group:
    """One process group as seen from one rank: its members, this rank's index, the handle."""

    name: str
    ranks: list[int]
    rank: int  # index of this process inside `ranks`
    pg: Any = None  # torch ProcessGroup, or None when size == 1 or before `Mesh.build`

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Mesh:
    """This rank's place in the 5-D mesh and its named groups. Built once, passed explicitly."""

    degrees: dict[str, int]
    rank: int
    groups: dict[str, Group] = field(default_factory=dict)
    ep: int = 1  # expert parallelism: the "ep" and "ep_data" groups (`expert_groups`)

    @property
    def world(self) -> int:
        return prod(self.degrees.values())

    @property
    def coord(self) -> dict[str, int]:
        return coords(self.rank, self.degrees)

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]

    @property
    def place(self) -> dict[str, int]:
        """`coord` and this rank's index in the expert groups ("ep", "ep_data"): where a
        parameter's replicas are counted once (the norm) and written once (checkpoints)."""
        return {**self.coord, "ep": self["ep"].rank, "ep_data": self["ep_data"].rank}

    @classmethod
    def plan(cls, degrees: dict[str, int], rank: int, ep: int = 1) -> Mesh:
        """The mesh with every group's membership but no process groups (pure)."""
        mesh = cls(dict(degrees), rank, ep=ep)
        ends = next((g for g in pp_end_groups(degrees) if rank in g), [rank])  # [rank]: none
        for name, ranks in named_groups(degrees, ep) + [("pp_ends", ends)]:
            if rank in ranks:
                mesh.groups[name] = Group(name, ranks, ranks.index(rank))
        return mesh

    @classmethod
    def build(cls, layout: MeshShape, rank: int, timeout: Any = None) -> Mesh:
        """Create the process groups of `layout`'s degrees (and its expert groups). Every
        rank must call this with the same layout. `timeout` (a timedelta): every group's,
        as the world's (torch gives a new group its own default otherwise, not the
        world's); None: torch's default."""
        import torch.distributed as dist

        mesh = cls.plan(layout.degrees, rank, layout.ep)
        # groups of equal members share one handle (every rank's in ascending order): the
        # whole world's is the default group's
        made: dict[tuple[int, ...], Any] = {tuple(range(mesh.world)): dist.group.WORLD}
        for name, ranks in named_groups(mesh.degrees, mesh.ep):
            # new_group is collective over the world: every rank creates every group,
            # in the same order, so the reuse below happens alike on every rank.
            if len(ranks) == 1:
                continue
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks, timeout)
            if rank in ranks:
                mesh.groups[name].pg = made[tuple(ranks)]
        for ranks in pp_end_groups(mesh.degrees):
            pg = dist.new_group(ranks, timeout)
            if rank in ranks:
                mesh.groups["pp_ends"].pg = pg
        return mesh


def named_groups(degrees: dict[str, int], ep: int) -> list[tuple[str, list[int]]]:
    """(name, ranks) of every group but "pp_ends", in the order `Mesh.build` makes them:
    each of `GROUP_AXES`, then the expert groups (mostly groups made before)."""
    named = [(n, g) for n in GROUP_AXES for g in axis_groups(degrees, n)]
    ep_groups, edp_groups = expert_groups(degrees, ep)
    return named + [("ep", g) for g in ep_groups] + [("ep_data", g) for g in edp_groups]
