"""Which transformer layers each pipeline stage holds.

A split is a list of layer counts, one per stage, summing to the model's layer count. The
embedding always sits on the first stage and the head (with the loss) on the last, so a
first or last stage may hold no layer at all; a middle stage holds at least one.

`balance` finds the split that minimises the slowest stage, given a cost per item
(embedding, each layer, head+loss), exactly; `even_split` and a user's split (checked by
`layout.parse_split`) are the cost-blind alternatives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from tetrad.layout import check_split


def even_split(n_layers: int, stages: int) -> list[int]:
    """Layers as even as possible; the first stages take the remainder, since the last
    stage also carries the head."""
    if stages < 1 or n_layers < stages:
        raise ValueError(f"cannot split n_layers={n_layers} into stages={stages}")
    base, extra = divmod(n_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def balance(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage minimising the costliest stage, exactly.

    costs: one per item, [embedding, layer_0, ..., layer_{L-1}, head+loss]; stages are
    contiguous, so the embedding lands on the first stage and the head on the last.
    Among the splits with the least maximum, the one with the least sum of squared stage
    costs is returned, so stages below the bottleneck are balanced too.
    """
    n = len(costs)
    if n < 2 or stages < 1 or stages > n:
        raise ValueError(f"cannot balance {n} items (embedding, layers, head) into {stages}")
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be non-negative, got {list(costs)}")
    prefix = list(accumulate(costs, initial=0.0))
    limit, _ = _least(prefix, stages, max, float("inf"))
    _, layers = _least(prefix, stages, lambda total, c: total + c * c, limit)
    layers[0] -= 1  # the embedding
    layers[-1] -= 1  # head + loss
    return layers


def stage_costs(costs: Sequence[float], split: Sequence[int]) -> list[float]:
    """Per-stage sum of item costs for a layers-per-stage split (embedding to the first
    stage, head to the last), e.g. to feed the simulator."""
    check_split(split, len(costs) - 2, None)
    items = list(split)
    items[0] += 1  # the embedding
    items[-1] += 1  # head + loss
    bounds = list(accumulate(items, initial=0))
    return [sum(costs[i:j]) for i, j in zip(bounds, bounds[1:])]


# --- exact search -------------------------------------------------------------------


def _least(
    prefix: list[float], stages: int, join: Callable[[float, float], float], limit: float
) -> tuple[float, list[int]]:
    """DP over (stages used, items covered): the least `join` of the stages' costs, folded
    from 0 (`max`: the bottleneck; or the sum of squares), every stage under `limit`;
    returns it and the items per stage. A stage's cost is a difference of the `prefix`
    sums, so round-off cannot split ties; among equal totals the earliest cut wins. A
    stage only grows costlier as it reaches back, so the search back stops at the first
    over the limit, or alone over the best found."""
    n, inf = len(prefix) - 1, float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(j - 1 if k > 1 else 0, k - 2, -1):  # the first stage starts at 0
                c = prefix[j] - prefix[i]
                if c > limit or join(0.0, c) > best[k][j]:
                    break
                if (total := join(best[k - 1][i], c)) <= best[k][j]:
                    best[k][j], cut[k][j] = total, i
    counts, j = [], n
    for k in range(stages, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return best[stages][n], counts[::-1]
