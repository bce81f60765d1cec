"""The planner on mixtures of experts: FLOPs of the active parameters, expert memory under
ep (against `model_state_bytes` and against tetrad's own runs), the all-to-all's bytes
and the links it is priced on, and the search choosing ep when the experts do not fit."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from harness import Jobs, tiny_config, trainer_for
from plan_helpers import layout_config, planned
from tetrad.config import DTYPE_BYTES, MODEL_PRESETS, model_preset
from tetrad.layout import Layout
from tetrad.mesh import rank_of
from tetrad.models.flops import flops_per_token
from tetrad.models.moe import meta_moe
from tetrad.parallel.model_state import model_state_bytes
from tetrad.plan.candidates import ep_bytes_per_layer
from tetrad.plan.compute import ROUTING_IMBALANCE
from tetrad.plan.cost import Planner
from tetrad.plan.engines import ENGINES
from tetrad.plan.hardware import Link, cluster_preset
from tetrad.plan.search import Space, search

# published (active, total) parameters: Mistral's Mixtral 8x7B announcement (12.9B of
# 46.7B), Qwen3's model cards (3.3B of 30.5B; 22B of 235B)
PUBLISHED = {
    "mixtral-8x7b": (12.9e9, 46.7e9),
    "qwen3-30b-a3b": (3.3e9, 30.5e9),
    "qwen3-235b-a22b": (22e9, 235e9),
}


def _total_parameters(m) -> int:
    """Parameters of the whole meta model, from one of one block of each kind (the last
    block of this one is an MoE block; building 32 to 94 of them takes seconds)."""
    one = meta_moe(dataclasses.replace(m, layers=m.dense_layers + 1))
    blocks = [sum(p.numel() for p in block.parameters()) for block in one.layers.children()]
    root = sum(p.numel() for p in one.parameters()) - sum(blocks)
    return root + sum(blocks[:-1]) + (m.layers - m.dense_layers) * blocks[-1]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_flops_count_the_published_active_parameters(name):
    """6·active + attention = FLOPs per token: the active parameters it implies (plus the
    embedding, which a lookup does not multiply) are the published count, and the meta
    model holds the published total."""
    m = model_preset(name)
    attention = 12.0 * m.layers * m.heads * m.head_dim  # per token of sequence length 1
    active = (flops_per_token(m, 1) - attention) / 6 + m.vocab * m.dim
    total = _total_parameters(m)
    want_active, want_total = PUBLISHED[name]
    assert active == pytest.approx(want_active, rel=0.02)
    assert total == pytest.approx(want_total, rel=0.01)


# (model, dp, fsdp, tp, pp, ep, zero stage, dtype): ep over dp, over fsdp (ZeRO beside
# the experts), spanning tp, with pp (moe-small's first block is dense: stage 0 differs)
STATE_LAYOUTS = [
    ("moe-tiny", 2, 1, 1, 1, 2, 3, "fp32"),
    ("moe-tiny", 1, 2, 1, 1, 2, 3, "bf16"),
    ("moe-small", 2, 1, 1, 1, 1, 3, "fp32"),
    ("moe-small", 2, 1, 1, 1, 2, 3, "fp32"),
    ("moe-small", 1, 4, 1, 1, 2, 2, "bf16"),
    ("moe-small", 2, 1, 2, 1, 4, 3, "fp32"),
    ("moe-small", 2, 1, 2, 1, 2, 3, "bf16"),
    ("moe-small", 1, 2, 2, 2, 2, 3, "bf16"),
]


@pytest.mark.parametrize("layout", STATE_LAYOUTS)
def test_model_state_under_ep_is_model_state_bytes(layout):
    """The planner's model state of every pp rank is the runtime's memory model's, to the
    byte (which `test_moe_ep_equivalence` checks against the measured tensors)."""
    name, dp, fsdp, tp, pp, ep, zero, dtype = layout
    cfg = layout_config(model_preset(name), 8, 16, dtype, dp=dp, fsdp=fsdp, tp=tp, pp=pp,
                        ep=ep, zero_stage=zero, microbatches=pp)  # fmt: skip
    lay, planner = Layout.build(cfg), Planner(cluster_preset("h100"))
    for r in range(pp):
        rank = rank_of({**{a: 0 for a in lay.degrees}, "pp": r}, lay.degrees)
        assert planner.rank_facts(*planned(cfg), r).state == model_state_bytes(lay, cfg.model, rank)


def test_ep_divides_the_expert_weights_only():
    """At ep 2 a rank holds half of every MoE layer's experts; the dense part (attention,
    the dense first block, router, shared expert, embedding, head) is unchanged."""
    m = model_preset("moe-small")
    planner = Planner(cluster_preset("h100"))
    whole = planner.rank_facts(*planned(layout_config(m, 8, 16, "fp32", dp=2)), 0)
    half = planner.rank_facts(*planned(layout_config(m, 8, 16, "fp32", dp=2, ep=2)), 0)
    experts = (m.layers - m.dense_layers) * m.experts * 3 * m.dim * m.expert_dim
    assert half.psi_experts == experts // 2
    assert whole.psi - half.psi == experts // 2
    assert half.psi_dense == whole.psi - experts
    assert half.state.total < whole.state.total


# --- measured: tetrad's own runs -------------------------------------------------------

MEASURED = {  # name -> (model preset, parallel degrees): 2 ranks, 2 steps
    "tiny-ep1": ("moe-tiny", {"dp": 2}),
    "tiny-ep2": ("moe-tiny", {"dp": 2, "ep": 2}),
    "small-ep2": ("moe-small", {"dp": 2, "ep": 2}),
    "small-fsdp2-ep2": ("moe-small", {"fsdp": 2, "ep": 2, "zero_stage": 3}),
}


def _measured_config(preset: str, parallel: dict):
    return tiny_config(
        model=dict(MODEL_PRESETS[preset]), parallel=parallel, train={"steps": 2, "dtype": "fp32"}
    )


def _state_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> list[int]:
    """Train two steps; the measured model-state bytes after the last."""
    from tetrad.config import from_dict

    rows = trainer_for(from_dict(cfg_dict), rank).fit()
    return rows[-1]["model_state_bytes"]


def declare_jobs(jobs: Jobs) -> None:
    for name, (preset, parallel) in MEASURED.items():
        cfg = _measured_config(preset, parallel)
        jobs.add("plan-moe-" + name, cfg.parallel.world, _state_worker, cfg.to_dict())


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MEASURED))
def test_predicted_model_state_is_the_measured(jobs, name):
    """moe-tiny and moe-small trained at ep 1 and 2 (and ep over ZeRO-3's ranks): the
    bytes the planner predicts are the bytes the ranks held (under ZeRO, to a few step
    counters: see below)."""
    preset, parallel = MEASURED[name]
    cfg = _measured_config(preset, parallel)
    plan = layout_config(cfg.model, cfg.train.global_batch, cfg.train.seq_len, "fp32", **{
        k: getattr(cfg.parallel, k) for k in ("dp", "fsdp", "tp", "pp", "cp", "ep", "zero_stage")
    })  # fmt: skip
    predicted = Planner(cluster_preset("cpu")).rank_facts(*planned(plan), 0).state.total
    measured = jobs["plan-moe-" + name]
    if cfg.parallel.fsdp == 1:
        assert measured == [predicted] * 2
    else:  # ZeRO: rank 0 also keeps AdamW step counters (4 B) of tensors whose shard lies
        # on rank 1 (`model_state_bytes` counts them on rank 1 only): 5 of them here
        assert all(0 <= got - predicted <= 5 * 4 for got in measured)
        assert predicted > 0.99 * max(measured)


@pytest.mark.distributed
def test_ep_halves_the_measured_expert_state(jobs):
    """Measured, not only predicted: ep 2 holds less than ep 1 by half the experts, at
    fp32 AdamW's 16 bytes an element (4 weight, 4 gradient, 8 moments)."""
    one, two = jobs["plan-moe-tiny-ep1"][0], jobs["plan-moe-tiny-ep2"][0]
    m = model_preset("moe-tiny")
    experts = (m.layers - m.dense_layers) * m.experts * 3 * m.dim * m.expert_dim
    assert one - two == 16 * experts // 2


# --- the all-to-all ------------------------------------------------------------------------

FREE = Link("test", alpha_s=0.0, bw_Bps=100e9)  # no latency: times are bytes / bandwidth


def _bandwidth_cluster(gpus_per_node: int):
    """h100 with latency-free links of 100 GB/s in a node and 10 GB/s across, and no
    overlap: the ep seconds are the bytes over the link."""
    base = cluster_preset("h100")
    inter = dataclasses.replace(FREE, bw_Bps=10e9)
    return dataclasses.replace(base, gpus_per_node=gpus_per_node, intra=FREE, inter=inter,
                               overlap=False)  # fmt: skip


def test_all_to_all_bytes_are_the_formula():
    """4·T·k·dim·c·(ep - 1)/ep per rank per MoE layer per microbatch, T the rank's
    tokens (1/tp of its microbatch's under tp)."""
    m = model_preset("moe-small")
    cfg = layout_config(m, 8, 128, "bf16", dp=4, ep=4)
    tokens = 2 * 128  # 8 sequences over 4 data ranks
    assert ep_bytes_per_layer(*planned(cfg)) == 4 * tokens * 2 * 128 * 2 * 3 / 4
    tp = layout_config(m, 8, 128, "bf16", dp=2, tp=2, ep=2)
    assert ep_bytes_per_layer(*planned(tp)) == 4 * (4 * 128 / 2) * 2 * 128 * 2 * 1 / 2
    assert ep_bytes_per_layer(*planned(layout_config(m, 8, 128, "bf16", dp=4))) == 0


def _ep_seconds(cluster, **parallel) -> float:
    cfg = layout_config(model_preset("mixtral-8x7b"), 64, 1024, "bf16", **parallel)
    return Planner(cluster).predict(*planned(cfg)).breakdown["ep"], cfg


def test_all_to_all_priced_on_the_links_the_group_spans():
    """Inside a node: every MoE layer's four all-to-alls (and the counts) at NVLink's rate,
    the most loaded rank receiving ROUTING_IMBALANCE times the mean. An ep group of fsdp
    ranks tp apart that crosses a node: the half that leaves the node goes over one NIC,
    and that is the time."""
    m, c, f = model_preset("mixtral-8x7b"), DTYPE_BYTES["bf16"], ROUTING_IMBALANCE
    seconds, cfg = _ep_seconds(_bandwidth_cluster(8), fsdp=8, ep=8)
    counts = 8 * m.experts * 7 / 8
    per_layer = f * ep_bytes_per_layer(*planned(cfg)) + counts
    assert seconds == pytest.approx(m.layers * per_layer / 100e9, rel=1e-9)
    # tp 2 x fsdp 4 on nodes of 4: the ep group (fsdp ranks 0, 2, 4, 6) spans two nodes
    seconds, cfg = _ep_seconds(_bandwidth_cluster(4), fsdp=4, tp=2, ep=4)
    buffer = (64 // 4) * 1024 / 2 * m.top_k * m.dim * c  # tokens/tp, k copies each
    outside = buffer * 2 / 4 / 10e9  # 2 of the 4 members on the other node, one NIC
    counts = 8 * m.experts * 2 / 4 / 10e9
    assert seconds == pytest.approx(m.layers * (4 * f * outside + counts), rel=1e-9)
    assert _ep_seconds(_bandwidth_cluster(8), fsdp=4, tp=2, ep=1)[0] == 0.0


def test_shared_experts_hide_the_dispatch():
    """With overlap, the forward dispatch shows only beyond the shared experts' compute:
    a model with shared experts has less exposed all-to-all time than without."""
    m = dataclasses.replace(model_preset("qwen3-30b-a3b"), shared_experts=1)
    cluster = cluster_preset("h100")

    def ep_time(model) -> float:
        cfg = layout_config(model, 64, 2048, "bf16", fsdp=8, ep=8)
        return Planner(cluster).predict(*planned(cfg)).breakdown["ep"]

    assert ep_time(m) < ep_time(dataclasses.replace(m, shared_experts=0))


# --- search --------------------------------------------------------------------------------


def test_search_proposes_ep_when_the_experts_do_not_fit_replicated():
    """Plain data parallelism on 8 GPUs: 16 layers of 64 experts (8.9B expert weights,
    ~180 GB of model state replicated) fit only split; the search finds an ep that fits,
    and ep 1 is predicted not to."""
    m = dataclasses.replace(
        model_preset("qwen3-30b-a3b"), name="moe-wide", layers=16, experts=64, top_k=4,
        moe_ffn_dim=1408, vocab=32000, qk_norm=False,
    )  # fmt: skip
    planner = Planner(cluster_preset("h100"))
    base = layout_config(m, 16, 2048, "bf16")
    space = Space(fsdp=1, tp=1, pp=1, cp=1)
    found = search(planner, *planned(base), 8, space, top=3)
    assert found and all(p.layout["ep"] > 1 for p in found)
    assert all(p.memory.fits for p in found)
    alone = planner.predict(*planned(layout_config(m, 16, 2048, "bf16", dp=8, microbatches=2)))
    assert not alone.memory.fits


def test_cli_predicts_an_ep_layout(capsys):
    """`tetrad plan --ep` with the MoE flags: the layout carries ep, tp runs with SP (as
    tetrad's MoE and Megatron's run it), the model override reaches the model, and the
    all-to-all shows in the breakdown."""
    from tetrad.cli import main

    argv = ["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--gpu", "h100",
            "--global-batch", "32", "--seq-len", "2048", "--fsdp", "8", "--tp", "2",
            "--ep", "8", "--top-k", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    pred = out["predictions"][0]
    assert pred["layout"]["ep"] == 8 and pred["layout"]["sp"] is True
    assert out["model"]["top_k"] == 1
    assert pred["breakdown"]["ep"] > 0


def test_cli_gives_a_fixed_layout_the_microbatches_that_fit(capsys):
    """Qwen3-30B-A3B as Megatron-LM ran it (32 GPUs, ep 8, batch 256) without
    --microbatches: not one microbatch of 8 sequences (it does not fit), but the fewest
    microbatches that fit, said in a note; none fitting is said too."""
    from tetrad.cli import main

    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "32", "--global-batch", "256",
            "--seq-len", "4096", "--fsdp", "32", "--zero-stage", "1", "--ep", "8",
            "--engine", "megatron", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    pred = out["predictions"][0]
    n = pred["layout"]["microbatches"]
    assert pred["memory"]["fits"] and 1 < n <= 8 and f"--microbatches {n}" in out["note"]
    planner = Planner(cluster_preset("h100"), ENGINES["megatron"])
    fewer = layout_config(model_preset("qwen3-30b-a3b"), 256, 4096, fsdp=32, zero_stage=1,
                          ep=8, microbatches=n // 2)  # fmt: skip
    assert not planner.memory(*planned(fewer)).fits
    assert main([*argv[:-1], "--seq-len", "65536", "--json"]) == 0
    assert "no microbatch count" in json.loads(capsys.readouterr().out)["note"]


def test_zero_buffers_leave_the_ep_experts_out():
    """ZeRO-3 with microbatches gathers a block (tetrad's at the peak) and the root and
    accumulates unsharded gradients of its units only: the experts under ep are whole
    parameters with their own gradients (in the model state), so neither buffer counts
    them."""
    m = model_preset("moe-small")
    planner = Planner(cluster_preset("h100"))
    cfg = layout_config(m, 8, 16, "bf16", fsdp=2, ep=2, zero_stage=3, microbatches=2)
    fa = planner.rank_facts(*planned(cfg), 0)
    c = DTYPE_BYTES["bf16"]
    assert 0 < fa.psi_dense < fa.psi
    # tetrad's ZeRO-3 also holds a unit's incoming microbatch gradient before the sum
    want = (c * (fa.block + fa.psi_root), c * (fa.psi_dense + fa.block + fa.psi_root))
    assert planner.footprint._zero_buffers(*planned(cfg), fa) == pytest.approx(want)
    assert fa.block * fa.layer_units + fa.psi_root == fa.psi_dense
