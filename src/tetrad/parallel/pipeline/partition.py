"""Which transformer layers each pipeline stage holds.

A split is a list of layer counts, one per stage, summing to the model's layer count. The
embedding always sits on the first stage and the head (with the loss) on the last, so a
first or last stage may hold no layer at all; a middle stage holds at least one.

`balance` finds the split that minimises the slowest stage, given a cost per item
(embedding, each layer, head+loss), exactly; `even_split` and a user's split (checked by
`layout.parse_split`) are the cost-blind alternatives.
"""

from __future__ import annotations

from bisect import bisect_left
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
    seg = _sums(costs)
    limit = _least_max(seg, n, stages)
    layers = _least_squares(seg, n, stages, limit)
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


def _sums(costs: Sequence[float]) -> Callable[[int, int], float]:
    prefix = list(accumulate(costs, initial=0.0))
    # every comparison uses this one function, so round-off cannot split ties
    return lambda i, j: prefix[j] - prefix[i]


def _least_max(seg: Callable, n: int, stages: int) -> float:
    """Binary search over every segment sum: the least feasible bottleneck (the largest,
    the whole model as one segment, always is)."""
    candidates = sorted({seg(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    # feasibility is False below the least bottleneck and True from it on
    i = bisect_left(candidates, True, key=lambda limit: _feasible(seg, n, stages, limit))
    return candidates[i]


def _feasible(seg: Callable, n: int, stages: int, limit: float) -> bool:
    """Greedy: fewest contiguous segments under `limit`. Needing at most `stages` is
    enough, since a segment can always be cut further (costs are non-negative)."""
    count, start = 0, 0
    while start < n:
        end = start
        while end < n and seg(start, end + 1) <= limit:
            end += 1
        if end == start:
            return False  # one item alone is over the limit
        count, start = count + 1, end
    return count <= stages


def _least_squares(seg: Callable, n: int, stages: int, limit: float) -> list[int]:
    """DP over (stages used, items covered): least sum of squares with every stage under
    `limit`; returns items per stage."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                c = seg(i, j)
                if c <= limit and best[k - 1][i] + c * c < best[k][j]:
                    best[k][j], cut[k][j] = best[k - 1][i] + c * c, i
    counts, j = [], n
    for k in range(stages, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return counts[::-1]
