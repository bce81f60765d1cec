"""ZeRO-3's FP8 all-gather (`--fp8-all-gather`, parallel/compress.py `Float8Gather`): the
gathered FP8 weights are the whole weights quantized with the single process's scales, so
training is the FP8 ZeRO-3 run value for value (and the FP8 single process's within the
FP8 tests' bound); each block's gather moves one byte a weight value plus its norms in
the compute dtype, and the scales one all-reduce a step."""

from __future__ import annotations

import math

import pytest
import torch

from harness import Jobs, one_step_comm, tiny_config
from test_fp8 import STEPS, _distance

pytestmark = pytest.mark.distributed

FSDP = {"fsdp": 2, "zero_stage": 3}
GATHER = {**FSDP, "fp8_all_gather": True}
FP32 = {"dtype": "fp32", "steps": STEPS}


def _cfg(parallel: dict, **train):
    return tiny_config(parallel=parallel, train={**FP32, **train})


def declare_jobs(jobs: Jobs) -> None:
    runs = [_cfg(GATHER, fp8="tensorwise"), _cfg(FSDP, fp8="tensorwise"), _cfg(FSDP)]
    jobs.add_training("fp8-gather", runs)
    bf16 = [_cfg(p, fp8="tensorwise", dtype="bf16").to_dict() for p in (GATHER, FSDP)]
    jobs.add("fp8-gather-bytes", 2, one_step_comm, bf16)


@pytest.mark.rounding
def test_fp8_gathered_training_is_the_fp8_zero3_run(reference, jobs):
    """The FP8 weights gathered equal the whole weights quantized: the run equals the FP8
    ZeRO-3 run whose ranks quantize the gathered high-precision weights, bit for bit, and
    so holds test_fp8's bound against the FP8 single process."""
    gathered, plain_fp8, plain = jobs["fp8-gather"][0]
    assert gathered["losses"] == plain_fp8["losses"]
    for n, w in plain_fp8["state"].items():
        assert torch.equal(gathered["state"][n], w), n
    single = reference(train={**FP32, "fp8": "tensorwise"}, parallel={"microbatches": 2})
    fp32 = reference(train=FP32, parallel={"microbatches": 2})
    bound = 1e-6 + 30 * _distance(plain, fp32)
    assert _distance(gathered, single) <= bound < 1e-2
    assert gathered["comm"]["fsdp/all_reduce"]["calls"] == 1  # the scales, in the last step


def _unit_bytes(cfg, n: int) -> tuple[list[tuple[int, int]], int]:
    """Per block unit: (its bf16 gather's bytes, its FP8 gather's bytes); and the number
    of FP8 weights. FP8: each rank sends one byte a value of its FP8 weights and two (bf16)
    of the rest, padded to the most a rank sends (even): a formula of the unit layout."""
    from tetrad.layout import Layout
    from tetrad.models.families import spec_for
    from tetrad.models.fp8 import use_fp8
    from tetrad.parallel.local import planned
    from tetrad.parallel.zero import ROOT, plan_units

    layout = Layout.build(cfg, n)
    local = planned(layout, cfg.model, 0)
    spec = spec_for(cfg.model)
    fp8 = {f"{p}.weight" for p in use_fp8(local.model, spec.blocks, "tensorwise")}
    shapes = [(k, tuple(p.shape)) for k, p in local.model.named_parameters()]
    out = []
    for u in plan_units(shapes, local.replicated, n, spec):
        if u.name == ROOT:
            continue
        sent = torch.zeros(u.padded, dtype=torch.long)  # bytes each value takes
        for name, off, shape in zip(u.names, u.offsets, u.shapes):
            sent[off : off + math.prod(shape)] = 1 if name in fp8 else 2
        width = int(sent.view(n, u.shard).sum(1).max())
        out.append((2 * u.padded, n * (width + width % 2)))
    return out, len(fp8)


def test_each_block_gathers_one_byte_a_weight_value(jobs):
    """Counted bytes: every block is gathered twice a step (forward, backward), each time
    at the FP8 formula instead of bf16's (about half: the norms stay bf16), and the
    scales add one all-reduce of an fp32 amax per FP8 weight."""
    gathered, plain = jobs["fp8-gather-bytes"][0]
    units, weights = _unit_bytes(_cfg(GATHER, fp8="tensorwise", dtype="bf16"), 2)
    saved = sum(bf16 - fp8 for bf16, fp8 in units)
    assert all(fp8 < 0.55 * bf16 for bf16, fp8 in units)
    got, want = gathered["fsdp/all_gather"], plain["fsdp/all_gather"]
    assert got["calls"] == want["calls"]
    assert got["bytes"] == want["bytes"] - 2 * saved
    reduce, base = gathered["fsdp/all_reduce"], plain.get("fsdp/all_reduce", {"bytes": 0})
    assert reduce["calls"] == 1 and reduce["bytes"] - base["bytes"] == 4 * weights


@pytest.mark.parametrize(
    "parallel,train,named",
    [({"fsdp": 2, "zero_stage": 2}, {"fp8": "tensorwise"}, "zero_stage=2"),
     ({"fsdp": 2}, {"fp8": "rowwise"}, "train.fp8='rowwise'"),
     ({"fsdp": 2}, {}, "train.fp8=''"),
     ({"dp": 2}, {"fp8": "tensorwise"}, "fsdp=1")],
)  # fmt: skip
def test_the_flag_needs_zero3_and_tensorwise_fp8(parallel, train, named):
    from tetrad.layout import Layout

    cfg = tiny_config(parallel={**parallel, "fp8_all_gather": True}, train={**FP32, **train})
    with pytest.raises(ValueError, match=named):
        Layout.build(cfg, 2)


def test_the_flag_reaches_the_layout():
    from tetrad.cli import build_config, parser
    from tetrad.layout import Layout

    argv = ["train", "--fsdp", "2", "--fp8", "tensorwise", "--fp8-all-gather"]
    assert Layout.build(build_config(parser().parse_args(argv)), 2).fp8_all_gather
