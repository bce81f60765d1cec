"""The planner prices FP8 linears and compressed gradient reductions (docs/low_precision.md):
the linears' time at the device's FP8 peak, the reduction's bytes at 1 + 4/256 a value."""

from __future__ import annotations

import argparse

import pytest

from tetrad.plan.cli import add_plan_args, run

BASE = ["--model", "llama3-8b", "--gpus", "64", "--gpu", "h100", "--global-batch", "1024"]
BASE += ["--seq-len", "8192"]


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    return parser.parse_args([*BASE, *flags])


def _predict(*flags: str) -> dict:
    return run(_args(*flags))["predictions"][0]


def test_fp8_linears_run_at_twice_the_rate():
    """Only the linears move to the FP8 peak (twice bf16's): compute time falls, but by
    less than half, since attention, the head and elementwise work stay in bf16."""
    bf16, fp8 = _predict(), _predict("--fp8", "rowwise")
    assert fp8["layout"]["fp8"] == "rowwise"
    ratio = fp8["breakdown"]["compute"] / bf16["breakdown"]["compute"]
    assert 0.5 < ratio < 0.8, ratio
    with pytest.raises(ValueError, match="a100 has no fp8 peak"):
        _predict("--fp8", "rowwise", "--gpu", "a100")


def test_compressed_reductions_move_a_quarter_of_the_bytes():
    """A reduction's time is mostly bytes over bandwidth: int8 blocks carry 1 + 4/256 bytes
    a value against fp32's 4, so data parallelism's all-reduce takes about a quarter of
    the time (latency aside); under ZeRO only the reduce-scatter shrinks, not the bf16
    weight gathers beside it."""
    dp = [_predict("--tp", "8", *f)["breakdown"]["dp"] for f in ([], ["--reduce-dtype", "int8"])]
    assert 0.2 < dp[1] / dp[0] < 0.3, dp
    zero = [_predict("--fsdp", "64", *f) for f in ([], ["--reduce-dtype", "fp8"])]
    assert zero[1]["layout"]["reduce_dtype"] == "fp8"
    assert 0.5 < zero[1]["breakdown"]["fsdp"] / zero[0]["breakdown"]["fsdp"] < 0.95


def test_the_residuals_are_in_the_planned_memory():
    """Error feedback keeps fp32 residuals: under dp 64 the sender's over every gradient
    value and the summing rank's piece, 4·Ψ·(1 + 1/64) bytes (to padding); none without
    feedback."""
    from tetrad.config import model_preset
    from tetrad.models.flops import param_count

    psi = param_count(model_preset("llama3-8b"))
    int8 = ("--reduce-dtype", "int8")
    flags = ((), int8, (*int8, "--no-error-feedback"))
    fp32, fed, plain = (_predict(*f)["memory"]["model_state"] for f in flags)
    assert fed - fp32 == pytest.approx(4 * psi * (1 + 1 / 64), rel=1e-3)
    assert plain == fp32


def _gather_facts(cfg):
    from plan_helpers import planned
    from tetrad.plan.cost import Planner
    from tetrad.plan.hardware import cluster_preset

    lay, m = planned(cfg)
    return Planner(cluster_preset("h100")).rank_facts(lay, m, 0)


def test_fp8_gather_bytes_are_what_the_runtime_counts():
    """A block's FP8 gather priced at n·w bytes, w = max_r(f_r + e·o_r) rounded up to e:
    on test_fp8_all_gather's model and unit layout, the bytes its runtime test counts
    (`_unit_bytes`, which the counted all-gathers equal); Llama-3-8B at fsdp 8 at
    docs/low_precision.md's 218,177,536 against bf16's 436,224,000; the scales one
    all-reduce of 4 bytes per FP8 weight (7 a Llama block)."""
    from plan_helpers import layout_config
    from test_fp8_all_gather import GATHER, _cfg, _unit_bytes
    from tetrad.config import model_preset

    cfg = _cfg(GATHER, fp8="tensorwise", dtype="bf16")
    units, weights = _unit_bytes(cfg, 2)
    fa = _gather_facts(cfg)
    assert [(2 * fa.block, fa.fp8_block_bytes)] * len(units) == units
    assert fa.fp8_weights == weights == 7 * cfg.model.layers
    big = layout_config(model_preset("llama3-8b"), 64, 4096, "bf16", "tensorwise", fsdp=8,
                        zero_stage=3, fp8_all_gather=True)  # fmt: skip
    fa = _gather_facts(big)
    assert (2 * fa.block, fa.fp8_block_bytes, fa.fp8_weights) == (436_224_000, 218_177_536, 224)


def test_fp8_gathers_shorten_exposed_gathers():
    """ZeRO-3 over 64 ranks with --fp8 tensorwise, its gathers exposed (DeepSpeed's
    engine): with the FP8 all-gather they take less time, and the step as much less; the
    search carries the flag to its ZeRO-3 candidates (without tp) and refuses it without
    tensorwise FP8."""
    flags = ("--fsdp", "64", "--zero-stage", "3", "--fp8", "tensorwise", "--engine", "deepspeed")
    plain, gathered = _predict(*flags), _predict(*flags, "--fp8-all-gather")
    assert gathered["layout"]["fp8_all_gather"] and not plain["layout"]["fp8_all_gather"]
    saved = plain["breakdown"]["fsdp"] - gathered["breakdown"]["fsdp"]
    assert saved > 0.1 * plain["breakdown"]["fsdp"]  # beside the gradients' reduce-scatters
    assert plain["step_time_s"] - gathered["step_time_s"] == pytest.approx(saved)
    search = ("--search", "--seq-len", "2048", "--tp", "1", "--pp", "1", "--cp", "1", "--top", "3")
    found = run(_args("--fp8", "tensorwise", "--fp8-all-gather", *search))["predictions"]
    assert found and all(
        p["layout"]["fp8_all_gather"] == (p["layout"]["zero_stage"] == 3) for p in found
    )
    with pytest.raises(ValueError, match="--fp8-all-gather with --fp8 'rowwise'"):
        run(_args("--fp8", "rowwise", "--fp8-all-gather", "--search"))
