"""Data parallelism reproduces the single process, and moves exactly the theoretical bytes."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, assert_close_run, check_rounded, tiny_config, trainer_for
from tetrad.models.flops import param_count

pytestmark = pytest.mark.distributed

LAYOUTS = [(2, 1), (4, 1), (2, 2), (4, 2)]  # (dp, microbatches)
# a token stream (the stdlib corpus): no target is padding, so no count is all-reduced
COMM = tiny_config(
    model={"vocab": 256}, parallel={"dp": 4, "bucket_mb": 0.01},
    train={"steps": 2, "dtype": "fp32"},  # the bytes users move: fp32 gradients
    data={"source": "stdlib"},
)  # fmt: skip
NAN = tiny_config(parallel={"dp": 2}, train={"steps": 2})
# wide enough (about 1.6 MB of gradients) that a GPU's default buckets are two: the small
# first one (FIRST_BUCKET_BYTES) and the rest (bucket_mb 25); on CPU the default is one
WIDE = {"dim": 128}
OVERLAP = tiny_config(model=WIDE, parallel={"dp": 2, "first_bucket_mb": 1}, train={"dtype": "fp32"})


def declare_jobs(jobs: Jobs) -> None:
    """The layouts (each world size's), the comm-volume run (4 ranks) and the NaN run (2)."""
    for dp, m in LAYOUTS:
        par = {"dp": dp, "microbatches": m, "bucket_mb": 0.01}
        jobs.add_training(f"dp{dp}-mb{m}", [tiny_config(parallel=par)])
    jobs.add_training("comm", [COMM])
    jobs.add("nan", 2, _nan_worker, NAN.to_dict())
    jobs.add("overlap", 2, _overlap_worker, OVERLAP.to_dict())


@pytest.mark.parametrize("dp,microbatches", LAYOUTS, ids=lambda v: str(v))
def test_dp_matches_single_process(reference, jobs, dp, microbatches):
    (got,) = jobs[f"dp{dp}-mb{microbatches}"][0]
    ref = reference(parallel={"microbatches": microbatches})
    assert_close_run(got, ref)


def test_dp_comm_volume_is_theoretical(jobs):
    (got,) = jobs["comm"][0]
    psi = param_count(COMM.model)
    stats = got["comm"]["data/all_reduce"]
    # every gradient element all-reduced exactly once per step: buffer 4Ψ bytes per rank,
    # and nothing else (the token count of a stream without padding is its batch's size;
    # with padding, one float64 more: `test_first_bucket_is_reduced_during_backward`)
    assert stats["bytes"] == 4 * psi
    assert stats["bus_bytes"] == pytest.approx(2 * 3 / 4 * 4 * psi)
    assert stats["calls"] > 1  # bucketed, not one monolithic all-reduce


def _nan_worker(rank: int, world: int, cfg_dict: dict) -> list[bool]:
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(cfg_dict), rank)
    before = {n: p.detach().clone() for n, p in trainer.engine.named_parameters()}
    if rank == 1:  # poison one gradient on one rank during step 0 only
        p = trainer.engine.model.layers["0"].attention.wq.weight
        handle = p.register_hook(lambda g: g * float("nan"))
    first = trainer.train_step()
    if rank == 1:
        handle.remove()
    after = {n: p.detach().clone() for n, p in trainer.engine.named_parameters()}
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    state_empty = len(trainer.optimizer.state) == 0
    second = trainer.train_step()
    return [first.skipped, unchanged, state_empty, second.skipped]


def test_nan_on_one_rank_skips_on_every_rank(jobs):
    assert jobs["nan"] == [[True, True, True, False]] * 2


def _overlap_worker(rank: int, world: int, cfg_dict: dict) -> dict:
    """Train 20 steps; at each step, what the data group had launched (all-reduce calls and
    bytes) when backward reached the embedding's output: every block's backward done, the
    embedding's (the last gradient) still to come."""
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(cfg_dict), rank)
    seen = []

    def record(_):
        stats = trainer.comm.summary().get("data/all_reduce", {"calls": 0, "bytes": 0})
        seen.append((stats["calls"], stats["bytes"]))

    def watch(_module, _inputs, out) -> None:
        out.register_hook(record)

    def forward_done(_module, _inputs, _out) -> None:
        # the newest call on the data group: the step's token count (buckets come later)
        count = [c for c in trainer.comm.ledger.ring if c.group == "data"][-1]
        in_flight.append((count.bytes, count.done))

    trainer.engine.model.tok_embeddings.register_forward_hook(watch)
    trainer.engine.model.register_forward_hook(forward_done)
    steps, in_flight, scalars = [], [], []
    for _ in range(trainer.cfg.train.steps):
        trainer.comm.reset()
        result = trainer.train_step()
        steps.append((result.loss, result.grad_norm))
        scalars.append(trainer.comm.summary()["world/all_reduce"]["bytes"])
    buckets = [b.buffer.numel() * 4 for b in trainer.engine.grads.buckets]
    state = trainer.engine.full_state_dict()
    return {
        "losses": [loss for loss, _ in steps],
        "grad_norms": [norm for _, norm in steps],
        "state": state if rank == 0 else None,
        "seen_at_embedding_grad": seen,
        "count_at_forward_end": in_flight,
        "scalar_bytes": scalars,
        "bucket_bytes": buckets,
    }


def test_first_bucket_is_reduced_during_backward(jobs):
    """When backward reaches the embedding, the small first bucket's all-reduce is already
    launched, the other's not: with one bucket of the whole model, nothing would be."""
    from tetrad.parallel.data import FIRST_BUCKET_BYTES

    for got in jobs["overlap"]:
        # the first bucket closes at the parameter that takes it to FIRST_BUCKET_BYTES
        first, *rest = got["bucket_bytes"]
        assert len(rest) == 1 and FIRST_BUCKET_BYTES <= first < 1.1 * FIRST_BUCKET_BYTES
        # every step: the token count (8 bytes), then the first bucket, nothing else yet
        assert got["seen_at_embedding_grad"] == [(2, 8 + first)] * OVERLAP.train.steps


def test_first_bucket_by_device():
    """Small on a GPU, where it overlaps backward; on CPU one bucket like the others."""
    from tetrad.parallel.data import FIRST_BUCKET_BYTES, first_bucket_bytes

    assert first_bucket_bytes(torch.device("cuda"), 25 * 2**20) == FIRST_BUCKET_BYTES
    assert first_bucket_bytes(torch.device("cpu"), 25 * 2**20) == 25 * 2**20


def test_dp_step_blocks_on_nothing_before_backward(jobs):
    """The token count's all-reduce is still in flight when the forward ends (not waited
    for before it), and with data parallelism alone the step's scalars all-reduce the loss
    and two flags but no norm: each rank takes the norm of its whole reduced gradient."""
    for got in jobs["overlap"]:
        assert got["count_at_forward_end"] == [(8, False)] * OVERLAP.train.steps
        assert got["scalar_bytes"] == [3 * 8] * OVERLAP.train.steps


def test_dp_with_a_small_first_bucket_matches_single_process(reference, jobs):
    """The overlap run (fp32, its buckets sized as users' are): within fp32's rounding."""
    single = reference(model=WIDE, train={"dtype": "fp32"})
    check_rounded(jobs["overlap"][0], single, reference(model=WIDE))
