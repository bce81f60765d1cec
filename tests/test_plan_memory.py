"""The planner's memory per rank: model state byte for byte as parallel/memory.py, the ZeRO
formula, torchtitan's published peaks, and what fits at scale; no processes.
"""

from __future__ import annotations

import dataclasses

import pytest

from plan_helpers import layout_config, planned
from plan_published import LLAMA3_MARGIN_GIB, LLAMA31_405B
from tetrad.config import model_preset
from tetrad.layout import Layout
from tetrad.models.flops import param_count
from tetrad.parallel.model_state import model_state_bytes, zero_formula_bytes
from tetrad.plan.candidates import gpt_as_llama
from tetrad.plan.cost import Planner
from tetrad.plan.engines import ENGINES, LLAMA3, MEGATRON
from tetrad.plan.hardware import GiB, cluster_preset


@pytest.mark.parametrize("layout", [
    dict(fsdp=8), dict(fsdp=4, tp=2, pp=4, microbatches=4), dict(dp=2, tp=4, pp=4, microbatches=4),
    dict(fsdp=2, pp=4, pp_schedule="zb-v", virtual_stages=2, microbatches=8, zero_stage=2),
])  # fmt: skip
def test_model_state_is_memory_py_exactly(layout):
    """The planner assembles ranks from one block; the bytes are memory.py's, exactly."""
    from tetrad.mesh import rank_of

    cfg = layout_config(model_preset("llama3-8b"), 64, 8192, **layout)
    planner = Planner(cluster_preset("h100"))
    p = cfg.parallel
    deg = p.degrees
    for r in range(p.pp):
        rank = rank_of({**{a: 0 for a in deg}, "pp": r}, deg)
        predicted = model_state_bytes(Layout.build(cfg), cfg.model, rank)
        assert planner.rank_facts(*planned(cfg), r).state == predicted


def test_model_state_against_the_zero_formula():
    """fp32 ZeRO-1/2/3 model state of llama3-8b at fsdp 64 is the ZeRO paper's (4, 4, 8)
    formula on Ψ, up to padding and AdamW's step counters (REFERENCE's worked example
    shape: 16Ψ/N at ZeRO-3)."""
    psi = param_count(model_preset("llama3-8b"))
    planner = Planner(cluster_preset("h100"))
    for stage in (1, 2, 3):
        cfg = layout_config(model_preset("llama3-8b"), 64, 8192, "fp32", fsdp=64, zero_stage=stage)
        got = planner.rank_facts(*planned(cfg), 0).state.total
        want = zero_formula_bytes(psi, 64, stage, 4, 4, 8).total
        assert got == pytest.approx(want, rel=1e-4)


# torchtitan's published peaks: tests/test_plan_peak.py (the peak, moment by moment)


def test_llama3_405b_production_layout_fits():
    """Llama 3 405B as it trained (tp 8, pp 16, data-sharded over 64, seq 8192, no
    recompute, 80 GB H100s), described with Megatron's kernels and sharded state: fits;
    tetrad's own eager count of the same layout does not."""
    cfg = layout_config(LLAMA31_405B, 2048, 8192, fsdp=64, tp=8, pp=16, sp=True,
                        zero_stage=3, microbatches=32)  # fmt: skip
    mem = Planner(cluster_preset("h100"), MEGATRON).predict(*planned(cfg)).memory
    assert mem.fits, mem
    assert not Planner(cluster_preset("h100")).predict(*planned(cfg)).memory.fits


@pytest.mark.parametrize("seq,batch,fsdp,cp,microbatches", [
    (8192, 2048, 64, 1, 32),  # 8K: tp 8, pp 16, dp 64, 32 sequences a data rank
    (131072, 128, 8, 16, 16),  # 128K: tp 8, cp 16, pp 16, dp 8, 16 sequences a data rank
])  # fmt: skip
def test_llama3_405b_published_layouts_fit(seq, batch, fsdp, cp, microbatches):
    """Llama 3 405B's published layouts (Llama 3 Herd, Table 4: interleaved, one layer
    fewer on the first and last stages, no recompute, 80 GB H100s), described as its
    paper describes its stack (`llama3`: FSDP with sharded gradients, weights whole
    through the step, fewer interleaved warm-up microbatches), fit with the stated
    margin; described as Megatron runs them (2 warm-up forwards per downstream rank,
    gradients accumulated whole, state sharded over the data ranks alone) they do not
    (at 8K its activations alone are 90 GiB)."""
    cfg = layout_config(LLAMA31_405B, batch, seq, fsdp=fsdp, tp=8, pp=16, cp=cp, sp=True,
                        zero_stage=2, microbatches=microbatches,
                        pp_schedule="interleaved-1f1b", virtual_stages=2)  # fmt: skip
    planner = Planner(cluster_preset("h100"), LLAMA3)
    assert planner.split(*planned(cfg)) == [3] + [4] * 30 + [3]
    mem = planner.predict(*planned(cfg)).memory
    assert mem.total + LLAMA3_MARGIN_GIB * GiB <= mem.capacity, mem
    megatron = Planner(cluster_preset("h100"), MEGATRON).predict(*planned(cfg)).memory
    assert megatron.activations > mem.activations + 2 * GiB and not megatron.fits


def test_deepspeed_zero3_keeps_its_live_parameters():
    """DeepSpeed ZeRO-3 keeps at most `stage3_max_live_parameters` (1e9) gathered elements
    and two reduce buckets of gradients, not two whole blocks: GPT 530B over 560 A100s
    (4 sequences a GPU, full recompute) fits in 80 GB, where whole-block buffers (20 GB
    of gathered bf16 blocks alone) would not."""
    model = gpt_as_llama(105, 20480, 128, 51200, 2048)
    cfg = layout_config(model, 2240, 2048, fsdp=560, zero_stage=3)
    ds = Planner(cluster_preset("a100"), ENGINES["deepspeed"], "full").predict(*planned(cfg)).memory
    whole = dataclasses.replace(ENGINES["deepspeed"], max_live_params=0.0)
    wb = Planner(cluster_preset("a100"), whole, "full").predict(*planned(cfg)).memory
    assert ds.fits and not wb.fits
    block = 12 * 20480**2  # elements of a GPT block
    assert wb.overhead - ds.overhead > 2 * 2 * block  # at least two bf16 blocks fewer
