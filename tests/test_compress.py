"""Compressed gradient reduction (parallel/compress.py): the block formats' error, error
feedback keeping what quantization drops, and data parallelism's buckets reducing through
it on two ranks: their sums, and the bytes counted against the formula."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, tiny_config, trainer_for
from tetrad.parallel.compress import (
    BLOCK,
    FORMATS,
    Residual,
    dequantize,
    piece_sizes,
    quantize,
    wire_bytes,
)

STEPS = 40
SMALL = 1e-3  # below half an int8 step of a block whose largest value is 1 (1/254)
# the widest gap between a format's values near its top, over that top: int8's 1/127,
# e4m3's 32 at 448 (3 mantissa bits)
SPACING = {"int8": 1 / 127, "fp8": 32 / 448}


def _gradient(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s fixed gradient: one large value per block, the rest small (SMALL)."""
    g = torch.full((numel,), SMALL * (rank + 1))
    g[::BLOCK] = 1.0
    return g


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_block_is_quantized_within_its_format_step(fmt):
    torch.manual_seed(0)
    x = torch.randn(4 * BLOCK) * torch.logspace(-3, 2, 4).repeat_interleave(BLOCK)
    wire = quantize(x, fmt)
    assert wire.dtype == torch.uint8 and wire.numel() == wire_bytes(x.numel())
    err = (dequantize(wire, fmt) - x).view(4, BLOCK).abs()
    top = x.view(4, BLOCK).abs().amax(1, keepdim=True)
    # int8: half a step of amax/127; e4m3 (3 mantissa bits): half an ulp, 2^-4 relative
    bound = top / 127 / 2 if fmt == "int8" else x.view(4, BLOCK).abs() * 2**-4 + top * 2**-10
    assert (err <= bound * (1 + 1e-6)).all()
    assert (quantize(torch.zeros(BLOCK), fmt)[:, BLOCK:].view(torch.float32) == 1).all()


def test_error_feedback_sends_what_a_block_step_would_drop():
    """A component under half a step is never sent without feedback; with it, the sum of
    what was sent follows the sum of the inputs within one step, at every step."""
    g = _gradient(0, BLOCK)
    fed, plain = Residual("int8", True), Residual("int8", False)
    sent_fed, sent_plain = torch.zeros(BLOCK), torch.zeros(BLOCK)
    for step in range(1, STEPS + 1):
        sent_fed += dequantize(fed.send(g), "int8")
        sent_plain += dequantize(plain.send(g), "int8")
        assert (sent_fed - step * g).abs().max() <= 1 / 127 / 2 * (1 + 1e-6)
    assert (sent_plain[1:] == 0).all()  # every small value rounded away, every step
    assert (sent_fed[1:] - STEPS * SMALL).abs().max() < 1 / 127


def _buckets_worker(rank: int, world: int, fmt: str, feedback: bool) -> dict:
    from tetrad.comm import Comm
    from tetrad.config import ParallelConfig
    from tetrad.mesh import Mesh
    from tetrad.parallel.data import GradBuckets

    mesh = Mesh.build(ParallelConfig(dp=world), rank)
    comm = Comm("cpu")
    params = [torch.nn.Parameter(torch.zeros(3 * BLOCK + 5)), torch.nn.Parameter(torch.zeros(7))]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    sync = GradBuckets(named, mesh["dp"], comm, 1 << 30, compress=fmt, feedback=feedback)
    total = [torch.zeros_like(p) for p in params]
    for _ in range(STEPS):
        offset = 0
        for p in params:
            p.grad.copy_(_gradient(rank, 3 * BLOCK + 12)[offset : offset + p.numel()])
            offset += p.numel()
        sync.finish()
        for t, p in zip(total, params):
            t += p.grad
        sync.zero_grad()
    held = sync.held().grads
    return {
        "total": total,
        "stats": comm.summary(),
        "held": sum(t.numel() for t in held if t is not None),
    }


# training through each path: dp's buckets, ZeRO-1's and ZeRO-3's reduce-scatter (fp32)
TRAINED = {
    "dp-int8": {"dp": 2, "reduce_dtype": "int8"},
    "dp-fp8": {"dp": 2, "reduce_dtype": "fp8"},
    "zero1-fp8": {"fsdp": 2, "zero_stage": 1, "reduce_dtype": "fp8"},
    "zero3-int8": {"fsdp": 2, "zero_stage": 3, "reduce_dtype": "int8"},
}
FP32 = {"dtype": "fp32", "lr": 1e-3}


def _state_worker(rank: int, world: int, cfg_dicts: list[dict]) -> list[tuple[int, int]]:
    """(measured, predicted) model-state bytes after two steps, per config: the residuals
    are in both."""
    from tetrad.config import from_dict
    from tetrad.parallel.model_state import model_state_bytes

    out = []
    for raw in cfg_dicts:
        trainer = trainer_for(from_dict(raw), rank)
        trainer.fit(stop=2)
        predicted = model_state_bytes(trainer.layout, trainer.cfg.model, rank)
        out.append((trainer.measured_state[-1].grads, predicted.grads))
    return out


def declare_jobs(jobs: Jobs) -> None:
    for fmt in sorted(FORMATS):
        jobs.add(fmt, 2, _buckets_worker, fmt, True)
    jobs.add("int8-plain", 2, _buckets_worker, "int8", False)
    cfgs = [tiny_config(parallel=par, train=FP32) for par in TRAINED.values()]
    jobs.add_training("trained", cfgs)
    small = {"bucket_mb": 0.005}  # several buckets, each padded apart
    states = [{**par, **small} for par in TRAINED.values()] + [{"dp": 2, **small}]
    jobs.add(
        "states", 2, _state_worker, [tiny_config(parallel=p, train=FP32).to_dict() for p in states]
    )


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_buckets_sum_through_the_compressed_reduction(jobs, fmt):
    ranks = jobs[fmt]
    want = torch.cat([_gradient(0, 3 * BLOCK + 12) + _gradient(1, 3 * BLOCK + 12)]) * STEPS
    for r in ranks:  # every rank lands the same sum
        got = torch.cat(r["total"])
        assert torch.equal(got, torch.cat(ranks[0]["total"]))
        # feedback at both hops: the running sum is off by at most what each hop holds
        # back, half a gap at each block's top: two senders' (top 1) and the sum's (top 2)
        assert (got - want).abs().max() <= 2 * SPACING[fmt] * (1 + 1e-6)
    # bytes: one bucket of 3·256+12 values, each rank's half padded to whole blocks; each
    # step an all-to-all that sends the other rank its half, and an all-gather of halves
    wire = 2 * wire_bytes(piece_sizes(3 * BLOCK + 12, 2)[1])
    stats = ranks[0]["stats"]
    assert stats["dp/quantized_reduce_scatter"]["bus_bytes"] == STEPS * wire / 2
    assert stats["dp/all_gather"]["bus_bytes"] == STEPS * wire / 2
    assert "dp/all_reduce" not in stats
    # the residuals are held state: the sender's whole buffer and the summing rank's piece
    assert ranks[0]["held"] == 3 * BLOCK + 12 + 3 * piece_sizes(3 * BLOCK + 12, 2)[1]


def test_without_feedback_the_small_values_never_arrive(jobs):
    got = torch.cat(jobs["int8-plain"][0]["total"])
    large = torch.zeros_like(got, dtype=torch.bool)
    large[::BLOCK] = True
    assert (got[~large] == 0).all() and (got[large] == 2 * STEPS).all()


@pytest.mark.rounding
def test_training_through_compressed_reductions_follows_the_single_process(reference, jobs):
    """Each layout's losses stay within a bound of the fp32 single process's, and not
    equal to them (the gradients did go through the block formats). The bound: every
    gradient value is off by at most 2 gaps of its block's top per step (see above), so
    AdamW's update of a value moves by at most about lr per step either way, and the
    loss with it: over 20 steps at lr 1e-3 it moved by at most 5.4e-5 relative (int8
    and fp8, dp and ZeRO, measured here); 2e-3 leaves a wide margin for other CPUs'
    rounding, while a lost scale or a misplaced piece moves it by more than 1e-1."""
    single = reference(train=FP32)["losses"]
    for name, got in zip(TRAINED, jobs["trained"][0]):
        diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], single))
        assert 0 < diff < 2e-3, (name, diff)
        axis = "data" if name.startswith("dp") else "fsdp"
        assert got["comm"][f"{axis}/quantized_reduce_scatter"]["calls"] > 0, name


def test_flags_reach_the_layout_and_fp64_refuses_compression():
    from tetrad.cli import build_config, parser
    from tetrad.layout import Layout

    args = parser().parse_args(
        ["train", "--dp", "2", "--reduce-dtype", "fp8", "--no-error-feedback"]
    )
    layout = Layout.build(build_config(args), 2)
    assert layout.compression == ("fp8", False) and layout.reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="reduce_dtype='int8'"):
        Layout.build(tiny_config(parallel={"dp": 2, "reduce_dtype": "int8"}), 2)


def test_the_residuals_are_predicted_to_the_byte(jobs):
    """Measured gradient-state bytes (the residuals among them) equal the prediction, for
    each compressed layout on both ranks, and exceed the uncompressed run's."""
    for rank in jobs["states"]:
        *compressed, plain = rank
        for measured, predicted in rank:
            assert measured == predicted
        assert all(m > plain[0] for m, _ in compressed)
