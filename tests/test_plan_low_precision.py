"""The planner prices FP8 linears and compressed gradient reductions (docs/low_precision.md):
the linears' time at the device's FP8 peak, the reduction's bytes at 1 + 4/256 a value."""

from __future__ import annotations

import argparse

import pytest

from tetrad.plan.cli import add_plan_args, run

BASE = ["--model", "llama3-8b", "--gpus", "64", "--gpu", "h100", "--global-batch", "1024"]
BASE += ["--seq-len", "8192"]


def _predict(*flags: str) -> dict:
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    args = parser.parse_args([*BASE, *flags])
    return run(args)["predictions"][0]


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
