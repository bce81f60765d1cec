"""What users run, held to the rounding of their own dtype on any CPU: float32 layouts of
every axis (dense and mixture of experts) and expert parallelism in bf16, each against
its single process in the same dtype and in fp64 (harness.check_rounded states the bound
and its reason). The fp64 grids of the other modules prove each layout computes what one
device would; these prove the dtypes users train in stay within their own round-off.

Marked `rounding`: scripts/test.sh runs them a second time on SSE4.2 kernels, so a bound
that rests on one CPU's rounding fails wherever the suite runs."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, check_rounded, tiny_config, train_many
from memory_helpers import check_bf16, train_and_measure

pytestmark = [pytest.mark.distributed, pytest.mark.rounding]

FP32 = {"dtype": "fp32"}
MOE = {"family": "moe", "experts": 4, "top_k": 2, "moe_ffn_dim": 32, "shared_experts": 1}
AUX = {**MOE, "balance": "aux", "aux_loss_coef": 0.01}
BIAS = {**MOE, "balance": "bias", "router": "sigmoid", "bias_rate": 0.01}

# name -> (model overrides, parallel degrees): every axis on 2 ranks, one spawn
LAYOUTS = {
    "dp2": ({}, {"dp": 2}),
    "fsdp2-zero3": ({}, {"fsdp": 2, "zero_stage": 3, "microbatches": 2}),
    "tp2-sp": ({}, {"tp": 2, "sp": True}),
    "pp2-1f1b": ({}, {"pp": 2, "microbatches": 2, "pp_schedule": "1f1b"}),
    "cp2-ring": ({}, {"cp": 2, "cp_attention": "ring"}),
    "moe-ep2": (AUX, {"dp": 2, "ep": 2}),
    "moe-tp2": (AUX, {"tp": 2}),  # the token split over tp (shared expert's partial sums)
    "moe-ep2-bias": (BIAS, {"fsdp": 2, "ep": 2, "zero_stage": 3}),
}
BF16_EP = (AUX, {"dp": 2, "ep": 2})


def declare_jobs(jobs: Jobs) -> None:
    cfgs = [tiny_config(model=m, parallel=p, train=FP32) for m, p in LAYOUTS.values()]
    jobs.add("fp32", 2, train_many, [c.to_dict() for c in cfgs])
    bf16 = tiny_config(model=BF16_EP[0], parallel=BF16_EP[1], train={"dtype": "bf16"})
    jobs.add("bf16-ep", 2, train_and_measure, [bf16.to_dict()])


def _singles(reference, model: dict, microbatches: int, dtype: str) -> tuple[dict, dict]:
    """The single process in `dtype` and in fp64, of the same model and microbatches."""
    par = {"microbatches": microbatches}
    return reference(model=model, parallel=par, train={"dtype": dtype}), reference(
        model=model, parallel=par
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp32_layout_within_its_own_rounding(reference, jobs, name):
    model, par = LAYOUTS[name]
    got = jobs["fp32"][0][list(LAYOUTS).index(name)]
    single, high = _singles(reference, model, par.get("microbatches", 1), "fp32")
    assert all(t.dtype == torch.float32 for t in got["state"].values())  # what users run
    check_rounded(got, single, high)


def test_ep_in_bf16_within_its_own_rounding(reference, jobs):
    """ep 2 in bf16 (fp32 masters, routing in fp32): within the bf16 single process's own
    distance from fp64 (check_bf16), bf16 visibly on, the measured model state the
    predicted on each rank; tokens crossed ranks."""
    ranks = [r[0] for r in jobs["bf16-ep"]]
    bf16, fp64 = _singles(reference, BF16_EP[0], 1, "bf16")
    check_bf16(BF16_EP[1], ranks, bf16, fp64)
