"""Stage partitioning: explicit, even and cost-balanced splits."""

from __future__ import annotations

import itertools
import random

import pytest

from tetrad.layout import parse_split
from tetrad.models.flops import llama_layer_costs
from tetrad.parallel.pipeline.partition import (
    balance,
    even_split,
    stage_costs,
)
from tetrad.parallel.pipeline.simulate import Costs, simulate_schedule


def test_even_split():
    assert even_split(14, 4) == [4, 4, 3, 3]
    assert even_split(8, 1) == [8]
    with pytest.raises(ValueError, match="n_layers=3"):
        even_split(3, 4)


def test_parse_split():
    assert parse_split("4,4,3,3", n_layers=14, stages=4) == [4, 4, 3, 3]
    assert parse_split(" 0, 5 ,3") == [0, 5, 3]  # first/last stage may hold no layer
    for text, kw, match in [
        ("4,x", {}, "integers"),
        ("4,-1,3", {}, "non-negative"),
        ("4,0,3", {}, "middle stage"),
        ("4,4", {"n_layers": 9}, "sums to 8, not 9"),
        ("4,4", {"stages": 3}, "2 stages, not 3"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_split(text, **kw)


def _brute_force(costs, stages):
    """Least maximum stage cost over every contiguous split into non-empty stages."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[i:j]) for i, j in zip(bounds, bounds[1:])))
    return best


def test_balance_is_exact():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 9)
        costs = [rng.choice([0.5, 1, 2, 3, 7]) for _ in range(n)]
        stages = rng.randint(1, n)
        split = balance(costs, stages)
        assert len(split) == stages and sum(split) == n - 2
        assert max(stage_costs(costs, split)) == _brute_force(costs, stages)


def test_balance_uniform_and_tie_break():
    # ten equal items (embedding, 8 layers, head) in 4 stages: max 3, squares 3,3,2,2
    assert max(stage_costs([1] * 10, balance([1] * 10, 4))) == 3
    assert sorted(stage_costs([1] * 10, balance([1] * 10, 4))) == [2, 2, 3, 3]
    # a heavy head gets a stage of its own
    assert balance([0, 1, 1, 1, 1, 1, 1, 10], 3) == [3, 3, 0]


def test_balance_rejects_bad_input():
    with pytest.raises(ValueError, match="into 5"):
        balance([1, 1, 1], 5)
    with pytest.raises(ValueError, match="non-negative"):
        balance([1, -1, 1], 2)


def test_llama_layer_costs():
    costs = llama_layer_costs(2, dim=8, ffn_dim=16, n_heads=2, n_kv_heads=1, vocab=100, seq_len=4)
    s, h, kv = 4, 8, 4
    layer = 3 * (2 * s * h * (2 * h + 2 * kv) + 4 * s * s * h + 6 * s * h * 16)
    assert costs == [3 * s * h, layer, layer, 3 * 2 * s * h * 100]
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        llama_layer_costs(2, 8, 16, 2, 3, 100, 4)


def _step_time(costs, split, name="1f1b", m=8):
    per_stage = [c / 3 for c in stage_costs(costs, split)]  # fwd : B : W = 1 : 1 : 1
    t = simulate_schedule(name, len(split), m, Costs(per_stage, per_stage, per_stage))
    return t.makespan


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_balanced_beats_even_with_large_vocab(name):
    """8 layers, dim 64, vocab 32000: the head costs ~31 layers, so the even split's last
    stage is the bottleneck; the balanced split gives the head a stage of its own."""
    costs = llama_layer_costs(8, 64, 172, 4, 4, 32000, 128)
    even, bal = even_split(8, 4), balance(costs, 4)
    assert bal[-1] == 0
    assert max(stage_costs(costs, bal)) < max(stage_costs(costs, even))
    assert _step_time(costs, bal, name) < _step_time(costs, even, name)


def test_balanced_beats_even_with_moderate_vocab():
    """A vocabulary worth about three layers: balancing moves layers off the last stage
    and the step gets markedly faster."""
    costs = llama_layer_costs(16, 256, 688, 8, 8, 12000, 256)
    even, bal = even_split(16, 4), balance(costs, 4)
    assert bal[0] > bal[-1]
    assert _step_time(costs, bal) < 0.85 * _step_time(costs, even)
