"""The planner's view of expert weights ZeRO-sharded over their expert-data group (no
processes): the model state of each layout is the runtime memory model's, whatever layout
the same planner was asked about before; the optimizer's seconds and ZeRO-3's gathered
parameters follow the experts' sharding. The measured side is in test_moe_expert_zero."""

from __future__ import annotations

import pytest

from plan_helpers import layout_config, planned
from tetrad.config import model_preset
from tetrad.layout import Layout
from tetrad.parallel.model_state import model_state_bytes
from tetrad.plan.cost import Planner
from tetrad.plan.hardware import cluster_preset

MODEL = model_preset("moe-small")  # 8 experts; 3 of its 4 blocks are MoE


def _cfg(dp: int, fsdp: int, ep: int, stage: int):
    return layout_config(MODEL, 8, 16, "fp32", dp=dp, fsdp=fsdp, ep=ep, zero_stage=stage)


def test_expert_state_follows_the_expert_data_group():
    """One planner asked in turn about expert-data groups of 1 (fsdp 2 x ep 2), 2 (fsdp 4)
    and 4 (dp 2 x fsdp 4: HSDP, the group spans the replicas): each answer is the runtime
    memory model's to the byte, so no answer is one cached for another group size."""
    planner = Planner(cluster_preset("h100"))
    for dp, fsdp in [(1, 2), (1, 4), (2, 4), (1, 2)]:
        cfg = _cfg(dp, fsdp, 2, 1)
        facts = planner.rank_facts(*planned(cfg), 0)
        assert facts.expert_shards == dp * fsdp // 2
        assert facts.state == model_state_bytes(Layout.build(cfg), cfg.model, 0)


def test_expert_adamw_state_and_step_split_over_the_group():
    """ZeRO-1: the expert AdamW state (8 bytes an element) is split over ep_data, and so is
    the optimizer's time; ep 2 over fsdp 2 holds the 4 experts a rank whole."""
    planner = Planner(cluster_preset("h100"))
    whole, split = (
        planner.rank_facts(*planned(_cfg(1, 2, 2, 1)), 0),
        planner.rank_facts(*planned(_cfg(1, 4, 2, 1)), 0),
    )
    assert whole.psi_experts == split.psi_experts == 3 * 4 * 3 * MODEL.dim * MODEL.expert_dim
    dense = (whole.psi_dense // 2, split.psi_dense // 4)  # ZeRO's other units: fsdp's share
    saved = whole.state.optimizer - split.state.optimizer
    # the dense AdamW share halves too (fsdp 2 -> 4); the experts' half goes; padding aside
    assert abs(saved - 8 * (dense[0] - dense[1]) - 8 * split.psi_experts // 2) <= 8 * 16
    seconds = [planner.predict(*planned(_cfg(1, f, 2, 1))).breakdown["optimizer"] for f in (2, 4)]
    shard = [whole.psi_dense / 2 + whole.psi_experts, split.psi_dense / 4 + split.psi_experts / 2]
    assert seconds[1] / seconds[0] == pytest.approx(shard[1] / shard[0])


def test_zero3_gathers_a_block_with_its_experts():
    """Under ZeRO-3 the gathered block at the peak includes its expert unit (fp32: 4 bytes
    an element of one MoE block's local experts) once the experts are sharded."""
    planner = Planner(cluster_preset("h100"))

    def gathered(fsdp: int) -> float:
        terms = dict(planner.predict(*planned(_cfg(1, fsdp, 2, 3))).memory.peak.terms)
        return terms["ZeRO-3 gathered parameters"]

    unit = 4 * 3 * MODEL.dim * MODEL.expert_dim  # 4 local experts, w1 w2 w3
    assert gathered(4) - gathered(2) == 4 * unit
