"""Parameter groups: which parameters are synced alike, over which ranks, sharded or not.

A rank's parameters form at most two groups. The dense ones: gradients summed over the
data ranks; ZeRO (fsdp > 1) shards them over fsdp, their replicas summed over dp. Under
expert parallelism, the expert weights: summed over their expert-data group alone (the
ranks holding the same experts); ZeRO shards them over it, or, with one rank there, they
stay whole. Gradient sync (`GroupedGrads`), the ZeRO state adapter and the model-state
accounting all walk the same list, dense first: every rank launches the same collectives
in the same order.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

from torch import nn

from tetrad.parallel.runner import GradSync, Held

if TYPE_CHECKING:
    from tetrad.parallel.compress import Residual

T = TypeVar("T")


@dataclass(frozen=True)
class ParamGroup:
    """One group of parameters: its logical names, the mesh group its gradients are summed
    over, and its ZeRO sharding (over `axis`, `shards` ranks; 1: held whole, stage 0)."""

    name: str  # "dense" or "expert"
    names: frozenset[str]
    data: str  # "data" or "ep_data"
    axis: str  # what ZeRO shards it over: "fsdp" (replicas over dp) or "ep_data"
    shards: int
    stage: int  # the ZeRO stage, 0 when held whole

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def of(self, named: Iterable[tuple[str, T]]) -> list[tuple[str, T]]:
        """The pairs of `named` (name, anything) that belong to this group, in order."""
        return [(n, x) for n, x in named if n in self.names]


def param_groups(
    names: Iterable[str], experts: Collection[str], stage: int, shards: int, expert_shards: int
) -> list[ParamGroup]:
    """The dense group, then (given expert weights among `names`) the expert group. ZeRO
    (`shards` > 1 ranks, `stage`) shards the dense group, and the experts over their
    `expert_shards` expert-data ranks when there are more than one (pure)."""
    names = list(names)
    zero = shards > 1
    dense = frozenset(n for n in names if n not in experts)
    groups = [ParamGroup("dense", dense, "data", "fsdp", shards, stage if zero else 0)]
    mine = frozenset(n for n in names if n in experts)
    if mine:
        spread = expert_shards if zero else 1
        groups.append(
            ParamGroup("expert", mine, "ep_data", "ep_data", spread, stage if spread > 1 else 0)
        )
    return groups


class GroupedGrads:
    """A `GradSync` of one sync per parameter group: each call goes to every part in the
    groups' order (dense first), the same on every rank."""

    def __init__(self, parts: list[GradSync]):
        self.parts = tuple(parts)

    def reduce_in_backward(self, on: bool) -> None:
        for part in self.parts:
            part.reduce_in_backward(on)

    def params(self) -> list[tuple[str, nn.Parameter]]:
        return [pair for part in self.parts for pair in part.params()]

    @contextmanager
    def final(self, names: Collection[str]) -> Iterator[None]:
        with ExitStack() as stack:  # entered in order, left in reverse: as nested `with`s
            for part in self.parts:
                stack.enter_context(part.final(names))
            yield

    def launch_rest(self) -> None:
        for part in self.parts:
            part.launch_rest()

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def after_step(self) -> None:
        for part in self.parts:
            part.after_step()

    def residuals(self) -> dict[str, Residual]:
        """Every part's, named "<part index>.<its name>"."""
        return {f"{i}.{k}": r for i, p in enumerate(self.parts) for k, r in p.residuals().items()}

    def held(self) -> Held:
        """Every part's tensors, category by category."""
        helds = [part.held() for part in self.parts]
        return Held(*([t for h in helds for t in getattr(h, f.name)] for f in fields(Held)))
