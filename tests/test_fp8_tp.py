"""FP8 under tensor parallelism (with and without SP) and context parallelism: each scale
taken as the max over the ranks splitting its operand (models/fp8.py `split_over`, wired
into the tp linears and `parallelize`), so a layout quantizes what the FP8 single process
quantizes, with its scales (docs/low_precision.md)."""

from __future__ import annotations

import pytest

from harness import Jobs, tiny_config
from test_fp8 import _distance
from tetrad.config import MODEL_PRESETS
from tetrad.models.fp8 import RECIPES

STEPS = 3
MLA = {**MODEL_PRESETS["deepseek-tiny"], "vocab": 64, "layers": 2}  # a dense block, an MoE one
RUNS = {  # name: (model, parallel); two microbatches everywhere, as the single process
    "tp2": ({}, {"tp": 2}),
    "tp2-sp": ({}, {"tp": 2, "sp": True}),
    "cp2": ({}, {"cp": 2}),
    # the down projections on each rank's s/2 (SequenceParallelLinear: tokens split over
    # tp), the latents' column linears, the shared expert's region of its own
    "mla-tp2-sp": (MLA, {"tp": 2, "sp": True}),
}
K = 0.05  # of FP8's own distance from fp32: see the test


def _train(fp8: str) -> dict:
    return {"dtype": "fp32", "steps": STEPS, **({"fp8": fp8} if fp8 else {})}


def declare_jobs(jobs: Jobs) -> None:
    cfgs = [
        tiny_config(model=model, parallel={**parallel, "microbatches": 2}, train=_train(fp8))
        for fp8 in RECIPES
        for model, parallel in RUNS.values()
    ]
    jobs.add_training("fp8-tp", cfgs)


@pytest.mark.rounding
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_tp_sp_cp_match_the_fp8_single_process(reference, jobs, recipe):
    """Same scales, same FP8 operands, up to fp32 rounding: tp sums partial products and cp
    attends in blocks, in another order than the single process, and a value that lands
    within that rounding of an FP8 rounding boundary rounds the other way (one FP8 step,
    2^-4 to 2^-3 of it, which the next steps carry on). So the bound is a fraction K of
    what FP8 itself moves the run (the FP8 single process's distance from the fp32 one,
    7e-2 to 8e-2 here), over 3 steps, before such flips compound: measured here at most
    0.004 of it (2.7e-4, tensorwise tp 2) against K = 0.05. A scale over one rank's part
    (any one of the M, N, K reductions dropped, checked one at a time) re-rounds every
    operand it covers: 0.29 to 0.9 of it (2.2e-2 to 8.7e-2)."""
    runs = jobs["fp8-tp"][0][RECIPES.index(recipe) * len(RUNS) :]
    for (name, (model, _)), got in zip(RUNS.items(), runs):
        single, plain = (
            reference(model=model, train=_train(fp8), parallel={"microbatches": 2})
            for fp8 in (recipe, "")
        )
        moved = _distance(single, plain)
        assert moved > 1e-2, name  # FP8 changes the run
        assert _distance(got, single) <= K * moved, (name, _distance(got, single), moved)
