"""The planner's activation counts (plan/activations.py) against Korthikanti et al.'s
formulas, a live count of what autograd saves, and the schedules' microbatches in flight;
no processes.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import random

import pytest
import torch

from harness import reference_csv
from plan_helpers import layout_config, planned
from tetrad.config import DTYPES, ModelConfig, model_preset
from tetrad.models.families import spec_for
from tetrad.models.llama_spec import LLAMA
from tetrad.parallel.pipeline.schedules import compute_orders, steady_count
from tetrad.parallel.pipeline.simulate import Costs, simulate_schedule
from tetrad.plan import activations as act
from tetrad.plan.cost import Planner, cool_downs
from tetrad.plan.engines import MEGATRON
from tetrad.plan.hardware import cluster_preset

KORTHIKANTI = {  # activation_memory_formulas.csv, bytes per layer
    ("none", 1, False): lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h),
    ("none", "t", False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    ("none", "t", True): lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h),
    ("selective", "t", False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
    ("selective", "t", True): lambda s, b, h, a, t: s * b * h * 34 / t,
    ("full", 1, False): lambda s, b, h, a, t: s * b * h * 2,
}


@pytest.mark.parametrize("key", list(KORTHIKANTI), ids=str)
@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (4096, 4, 4096, 32, 2)])
def test_gpt_layer_reproduces_korthikanti(key, s, b, h, a, t):
    recompute, tp, sp = key
    t = t if tp == "t" else 1
    got = act.total_bytes(act.gpt_layer(h, a, s, recompute), b, s, t, sp)
    assert got == pytest.approx(KORTHIKANTI[key](s, b, h, a, t), rel=1e-12)


def test_korthikanti_table_is_the_csv():
    with open(reference_csv("activation_memory_formulas.csv")) as fh:
        formulas = [r["bytes_per_transformer_layer"] for r in csv.DictReader(fh)]
    assert "s*b*h*(34 + 5*a*s/h)" in formulas and "s*b*h*2" in formulas
    assert "s*b*h*(10 + 24/t + 5*a*s/(h*t))" in formulas and "s*b*h*(10 + 24/t)" in formulas


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_llama_layer_is_what_autograd_saves(dtype):
    """The Llama composition against a live count of the tensors autograd saves (tp=1)."""
    from tetrad.models.llama import Llama, cross_entropy_sum
    from tetrad.parallel.activation_meter import ActivationMeter

    m = ModelConfig(layers=1, dim=64, heads=4, kv_heads=2, vocab=512, ffn_dim=96)
    b, s = 2, 32
    measured = []
    for layers in (1, 2):
        model = Llama(dataclasses.replace(m, layers=layers)).to(
            torch.float32 if dtype == "fp32" else torch.bfloat16
        )
        meter = ActivationMeter()
        meter.reset(model.parameters())
        ids, targets = torch.randint(0, 512, (b, s)), torch.randint(0, 512, (b, s))
        with meter.saving():
            loss = cross_entropy_sum(model(ids), targets)
        measured.append(meter.live)
        del loss
    family = LLAMA.activations
    layer = act.total_bytes(family.layer(m, 1, dtype), b, s)
    rest = act.total_bytes(family.head(m, 1, dtype) + family.embedding(1, dtype), b, s)
    assert measured[1] - measured[0] == layer
    assert measured[0] - layer == pytest.approx(rest, abs=8)  # the loss's scalar weight


@pytest.mark.parametrize("q_lora_rank", [16, 0], ids=["q-bottleneck", "plain-q"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepseek_layer_is_what_autograd_saves(dtype, q_lora_rank):
    """An MLA MoE block (deepseek-tiny's routing, latents of their own widths, values
    narrower than keys) against a live count of the tensors autograd saves (tp=1)."""
    from tetrad.models.mla import DeepSeekV3

    m = dataclasses.replace(model_preset("deepseek-tiny"), dim=64, q_lora_rank=q_lora_rank)
    # one dense layer, then MoE layers: the difference of 3 and 2 layers is an MoE one
    saved = _layer_saves(DeepSeekV3, m, dtype, 2, 32, layers=(2, 3))
    assert saved == act.total_bytes(spec_for(m).activations.layer(m, 1, dtype), 2, 32)


def _layer_saves(build, m: ModelConfig, dtype: str, b: int, s: int, layers=(1, 2)) -> int:
    """Bytes autograd keeps saved for one layer of `build(m)`: a model of `layers[1]`
    layers less one of `layers[0]`."""
    from tetrad.models.llama import cross_entropy_sum
    from tetrad.parallel.activation_meter import ActivationMeter

    measured = []
    for n in layers:
        torch.manual_seed(0)
        model = build(dataclasses.replace(m, layers=n)).to(DTYPES[dtype])
        meter = ActivationMeter()
        meter.reset(model.parameters())
        ids = torch.randint(0, m.vocab, (b, s))
        with meter.saving():
            loss = cross_entropy_sum(model(ids), ids)
        measured.append(meter.live)
        del loss
    return measured[1] - measured[0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_layer_is_what_autograd_saves(dtype):
    """An MoE block (moe-tiny's softmax router and shared expert) against a live count of
    the tensors autograd saves (tp=1); the auxiliary loss adds its per-sequence tensors,
    8·experts + 4 bytes a sequence, which the estimate leaves out (moe_spec.routing)."""
    from tetrad.models.moe import MoE

    m = dataclasses.replace(model_preset("moe-tiny"), dim=64, balance="none")
    assert (m.router, m.shared_experts, m.dense_layers) == ("softmax", 1, 0)
    b, s = 2, 32
    layer = act.total_bytes(spec_for(m).activations.layer(m, 1, dtype), b, s)
    assert _layer_saves(MoE, m, dtype, b, s) == layer
    aux = dataclasses.replace(m, balance="aux")
    assert _layer_saves(MoE, aux, dtype, b, s) == layer + b * (8 * m.experts + 4)


def test_microbatches_in_flight():
    """1F1B: rank r holds p - r microbatches; GPipe m; interleaved rank 0 holds
    L·(1 + (p-1)/(p·v)) layers (Korthikanti Sec. 4.2.3), with one unit per layer."""
    p, m, v = 4, 8, 2
    unit = Costs(1, 1, 1)
    one = simulate_schedule("1f1b", p, m, unit)
    assert [act.peak_in_flight(one, r, [1.0] * p) for r in range(p)] == [4, 3, 2, 1]
    gpipe = simulate_schedule("gpipe", p, m, unit)
    assert act.peak_in_flight(gpipe, 0, [1.0] * p) == m
    inter = simulate_schedule("interleaved-1f1b", p, m, unit, virtual_stages=v)
    layers_per_chunk = 3
    got = act.peak_in_flight(inter, 0, [layers_per_chunk] * (p * v))
    total_layers = layers_per_chunk * p * v
    assert got == pytest.approx(total_layers * (1 + (p - 1) / (p * v)))


def test_zero_bubble_keeps_weight_gradient_inputs():
    """ZB-H1 holds 1F1B's activations plus, on later ranks, deferred W inputs."""
    p, m = 4, 8
    t = simulate_schedule("zb-h1", p, m, Costs(1, 1, 1))
    plain = [act.peak_in_flight(t, r, [1.0] * p) for r in range(p)]
    with_w = [act.peak_in_flight(t, r, [1.0] * p, [0.5] * p) for r in range(p)]
    assert plain == [4, 3, 2, 1]
    assert all(w >= a for w, a in zip(with_w, plain)) and with_w[-1] > plain[-1]


def _walked_peak(computes, act_, pending_w, sent, shared) -> float:
    """What a rank holds, walked compute by compute (`activations.InFlight`'s meaning):
    F adds a microbatch's activations (less the shared part while one of the stage is in
    flight), B frees them and keeps its W inputs, W frees those, BW frees the
    activations; an F's output lives through it and the rank's next compute."""
    live = peak = sending = 0.0
    flying = [0] * len(act_)
    for e in computes:
        adds = act_[e.stage] - (shared[e.stage] if flying[e.stage] else 0.0)
        out = sent[e.stage] if e.kind == "F" else 0.0
        if e.kind == "F":
            live, flying[e.stage] = live + adds, flying[e.stage] + 1
        elif e.kind == "B":
            flying[e.stage] -= 1
            live += pending_w[e.stage] - (
                act_[e.stage] - (shared[e.stage] if flying[e.stage] else 0.0)
            )
        peak = max(peak, live + sending + out)
        if e.kind == "W":
            live -= pending_w[e.stage]
        elif e.kind == "BW":
            flying[e.stage] -= 1
            live -= act_[e.stage] - (shared[e.stage] if flying[e.stage] else 0.0)
        sending = out
    return peak


def test_in_flight_moments_price_as_the_walk():
    """`InFlight` keeps a rank's moments as counts and only those no other covers, so one
    order prices every layout: its peak is the walk's, for every schedule, rank and set
    of bytes (whole bytes: the sums are exact either way)."""
    rng, checked = random.Random(0), 0
    for name, p, m, v, lag in itertools.product(
        ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"), (1, 2, 3, 4), (1, 2, 4, 5, 8, 12),
        (1, 2, 3), (1, 2),
    ):  # fmt: skip
        try:
            orders = compute_orders(name, p, m, v, lag)
        except ValueError:
            continue
        for order in orders:
            flight = act.InFlight(order)
            for _ in range(2):
                a = [float(rng.randint(1, 999)) for _ in range(p * v)]
                pending, sent = ([float(rng.randint(0, 999)) for _ in a] for _ in range(2))
                held = (a, pending, sent, [float(rng.randint(0, int(x))) for x in a])
                assert flight.peak(*held) == _walked_peak(order, *held), (name, p, m, v)
                checked += 1
    assert checked > 1000


def test_a_steady_count_holds_and_ends_as_every_larger_count():
    """Memory and the floors' cool-down read a schedule's order at `steady_count`
    microbatches, not at the layout's count: past it, every rank's in-flight moments and
    the computes after its last backward are those of the steady count (it fails with a
    steady count one short of pp·v). GPipe's are not: it holds
    every microbatch."""
    checked = 0
    for name, p, v, lag in itertools.product(
        ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v"), (1, 2, 3, 4, 7, 12), (1, 2, 3), (1, 2)
    ):
        try:
            steady = steady_count(name, p, 10**6, v)
            held = compute_orders(name, p, steady, v, lag)
        except ValueError:
            continue
        moments = [sorted(act.InFlight(order).moments) for order in held]
        for n in range(steady + 1, steady + p * v + 1):
            try:
                orders = compute_orders(name, p, n, v, lag)
            except ValueError:
                continue
            assert [sorted(act.InFlight(o).moments) for o in orders] == moments, (name, p, v, n)
            assert cool_downs(orders) == cool_downs(held), (name, p, v, lag, n)
            checked += 1
    assert checked > 250
    assert steady_count("gpipe", 4, 64) == 64


def _cp_pair():
    """llama3-8b at one sequence a microbatch, seq 8192: fsdp 8, and fsdp 4 x cp 2."""
    m = model_preset("llama3-8b")
    return layout_config(m, 8, 8192, fsdp=8), layout_config(m, 4, 8192, fsdp=4, cp=2)


def test_cp_halves_activations_and_compute():
    """cp 2 holds half of every sequence: a ring core (Megatron, torchtitan) keeps half
    the activations of cp 1 and does half the compute (attention too: the chunks are
    load-balanced); tetrad's all-gather core also keeps the other shard's keys and values
    and the mask by global position, per layer."""
    one, two = _cp_pair()
    ring = Planner(cluster_preset("h100"), MEGATRON)
    assert ring.rank_activations(*planned(two), 0) == pytest.approx(
        ring.rank_activations(*planned(one), 0) / 2
    )
    tetrad = Planner(cluster_preset("h100"))
    m = one.model
    extra = act.total_bytes(LLAMA.activations.cp_gathered_kv(m, 1, "bf16", 2, 8192), 1, 4096)
    want = tetrad.rank_activations(*planned(one), 0) / 2 + m.layers * extra
    assert tetrad.rank_activations(*planned(two), 0) == pytest.approx(want)
    assert extra == 2 * 2 * 4096 * 4096 + 4096 * 8192  # repeated k, v of 4096 more tokens; mask
    c1, c2 = (tetrad.predict(*planned(c)).breakdown["compute"] for c in (one, two))
    assert c2 == pytest.approx(c1 / 2)


def test_interleaved_with_one_warm_up_per_rank_holds_1f1b_layers():
    """With one warm-up forward per downstream rank (`lag` 1) instead of Megatron's two,
    the interleaved schedule's rank 0 holds v·p chunks, L layers (1F1B's), and every
    rank fewer than at lag 2. The lists stay complete and deadlock-free with
    asynchronous sends (a transfer then stalls the next chunk round: slower, not stuck),
    not with blocking ones: Llama 3 ran asynchronous p2p."""
    from tetrad.parallel.pipeline.check import check_actions
    from tetrad.parallel.pipeline.schedules import build_schedule, placement
    from tetrad.parallel.pipeline.simulate import simulate

    p, m, v, per_chunk = 4, 8, 2, 3
    peaks = {}
    for lag in (1, 2):
        actions = build_schedule("interleaved-1f1b", p, m, v, lag)
        check_actions(actions, p, m, v, placement(p, v, "interleaved-1f1b"))
        timed = simulate(actions, Costs(1, 1, 1, comm=0.3))
        peaks[lag] = [act.peak_in_flight(timed, r, [per_chunk] * (p * v)) for r in range(p)]
    assert peaks[1][0] == per_chunk * p * v
    with pytest.raises(ValueError, match="deadlock with blocking sends"):  # async p2p only
        lag1 = build_schedule("interleaved-1f1b", p, m, v, 1)
        check_actions(lag1, p, m, v, placement(p, v, "interleaved-1f1b"), rendezvous=True)
    assert all(a < b for a, b in zip(peaks[1][:-1], peaks[2][:-1]))
    with pytest.raises(ValueError, match="lag"):
        build_schedule("interleaved-1f1b", p, m, v, 3)
