"""FP8 matmuls (models/fp8.py): each matmul's error within its formats', gradients that
follow the high-precision ones, and the layouts that keep a microbatch and a weight whole
(dp, ZeRO-3, pp) against the FP8 single process fed the same microbatches."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, tiny_config
from tetrad.models.fp8 import E4M3, E5M2, RECIPES, Float8Linear, scaled, use_fp8

STEPS = 8


def _runs(fp8: str) -> dict[str, dict]:
    train = {"dtype": "fp32", "fp8": fp8, "steps": STEPS}
    return {
        # every layout runs 2 microbatches of 4 sequences: the single process's
        "dp2": tiny_config(parallel={"dp": 2}, train=train),
        "zero3": tiny_config(parallel={"fsdp": 2, "zero_stage": 3}, train=train),
        "pp2": tiny_config(parallel={"pp": 2, "microbatches": 2}, train=train),
    }


def declare_jobs(jobs: Jobs) -> None:
    for fp8 in ("", *RECIPES):
        jobs.add_training(f"fp8-{fp8}", list(_runs(fp8).values()))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scaling_puts_the_largest_value_on_the_formats_top(dtype):
    x = torch.randn(8, 16) * torch.logspace(-2, 2, 8)[:, None]
    for dim in (None, 1):
        q, scale = scaled(x, dtype, dim)
        assert q.dtype == dtype
        top = q.float().abs().amax() if dim is None else q.float().abs().amax(1)
        assert torch.allclose(top, torch.tensor(torch.finfo(dtype).max))
        # half an ulp: 2^-4 relative (e4m3, 3 mantissa bits), 2^-3 (e5m2, 2 bits)
        rel = 2**-4 if dtype == E4M3 else 2**-3
        back = q.float() * scale
        assert ((back - x).abs() <= x.abs() * rel + scale * 2**-9).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_follows_the_high_precision_one(recipe):
    """Output and both gradients within a few FP8 steps of the fp32 linear's (3 matmuls,
    each operand rounded to 3 mantissa bits, gradients to 2 under tensorwise), and the
    same parameters, under the same names."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    fp8 = Float8Linear(linear, recipe)
    assert fp8.weight is linear.weight and fp8.bias is linear.bias
    x = torch.randn(2, 16, 64, requires_grad=True)
    g = torch.randn(2, 16, 48)
    want = torch.autograd.grad(linear(x), (x, linear.weight, linear.bias), g)
    got = torch.autograd.grad(fp8(x), (x, fp8.weight, fp8.bias), g)
    for a, b in zip(got[:2], want[:2]):
        assert 0 < (a - b).norm() <= 0.15 * b.norm()  # it did round, by FP8 steps
    torch.testing.assert_close(got[2], want[2])  # the bias is not in FP8


def test_only_the_blocks_linears_become_fp8():
    from tetrad.config import model_preset
    from tetrad.models.llama import Llama

    model = Llama(model_preset("tiny"))
    swapped = use_fp8(model, "layers", "rowwise")
    assert len(swapped) == 7 * len(model.layers)
    assert type(model.output) is torch.nn.Linear  # the head stays
    with pytest.raises(ValueError, match="'blockwise'"):
        use_fp8(model, "layers", "blockwise")


def _distance(a: dict, b: dict) -> float:
    """The worst relative difference of losses, then of final weights (norm-wise)."""
    losses = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
    weights = max((a["state"][n] - w).norm() / w.norm() for n, w in b["state"].items())
    return max(losses, float(weights))


@pytest.mark.rounding
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_layouts_match_the_fp8_single_process(reference, jobs, recipe):
    """A layout that gives each rank whole microbatches and whole weights computes the
    very FP8 matmuls of the single process: same operands, same scales, same roundings.
    In fp32 (the verification dtype FP8 allows) what differs is the order gradients are
    summed in, which the same layouts without FP8 show: their distance from the fp32
    single process, times 30 (FP8 re-rounds each step's weights, so a last-bit change can
    move a value by an FP8 step), plus 1e-6, bounds the FP8 layouts' distance from the
    FP8 single process. Measured here: 0 (two ranks sum the same two terms as two
    microbatches), against the 6e-2 FP8 itself moves the run, which a scale over the
    wrong values or a linear left out would show."""
    single = reference(train={"dtype": "fp32", "fp8": recipe, "steps": STEPS},
                       parallel={"microbatches": 2})  # fmt: skip
    plain = reference(train={"dtype": "fp32", "steps": STEPS}, parallel={"microbatches": 2})
    for name, got, base in zip(_runs(recipe), jobs[f"fp8-{recipe}"][0], jobs["fp8-"][0]):
        bound = 1e-6 + 30 * _distance(base, plain)
        assert bound < 1e-2, (name, bound)  # well under what FP8 changes
        assert _distance(got, single) <= bound, (name, _distance(got, single), bound)
        assert _distance(got, plain) > 1e-2, name  # FP8 did change the run


@pytest.mark.parametrize(
    "parallel,named",
    [({"tp": 4}, "parallel.tp=4 > model.kv_heads=2"),
     ({"tp": 2, "fsdp": 2, "zero_stage": 3, "fp8_all_gather": True}, "parallel.tp=2: a tp shard"),
     ({"pp": 2, "pp_schedule": "zb-h1", "microbatches": 2}, "pp_schedule='zb-h1'")],
)  # fmt: skip
def test_layouts_fp8_cannot_follow_are_refused_by_name(parallel, named):
    """A kv head shared by tp ranks, an FP8 gather of tp shards, zero-bubble's deferred W
    (tp, sp and cp run: test_fp8_tp.py)."""
    from tetrad.layout import Layout

    cfg = tiny_config(parallel=parallel, train={"dtype": "bf16", "fp8": "tensorwise"})
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        Layout.build(cfg, cfg.parallel.world)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_redoes_the_same_fp8_matmuls(reference, recompute):
    """Recomputing a block in backward redoes its FP8 matmuls with the same scales (each
    taken from the values it scales, which the rerun reproduces): the run is the one
    without recomputation, bit for bit."""
    train = {"dtype": "fp32", "fp8": "tensorwise", "steps": 4}
    base, got = reference(train=train), reference(train={**train, "recompute": recompute})
    assert got["losses"] == base["losses"] and _distance(got, base) == 0
