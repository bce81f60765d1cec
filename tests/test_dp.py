"""Data parallelism reproduces the single process, and moves exactly the theoretical bytes."""

from __future__ import annotations

import pytest
import torch

from harness import assert_close_run, run_layout, tiny_config, trainer_for
from tetrad.models.flops import param_count
from tetrad.testing import spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("dp,microbatches", [(2, 1), (4, 1), (2, 2), (4, 2)], ids=lambda v: str(v))
def test_dp_matches_single_process(reference, dp, microbatches):
    par = {"dp": dp, "microbatches": microbatches, "bucket_mb": 0.01}
    got = run_layout(tiny_config(parallel=par))
    ref = reference(parallel={"microbatches": microbatches})
    assert_close_run(got, ref)


def test_dp_comm_volume_is_theoretical():
    cfg = tiny_config(parallel={"dp": 4, "bucket_mb": 0.01}, train={"steps": 2})
    got = run_layout(cfg)
    psi = param_count(cfg.model)
    stats = got["comm"]["data/all_reduce"]
    # every gradient element all-reduced exactly once per step: buffer 4Ψ bytes per rank,
    # plus the one float64 that agrees on the global token count (the loss denominator)
    assert stats["bytes"] == 4 * psi + 8
    assert stats["bus_bytes"] == pytest.approx(2 * 3 / 4 * (4 * psi + 8))
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


def test_nan_on_one_rank_skips_on_every_rank():
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": 2})
    results = spawn(_nan_worker, 2, cfg.to_dict())
    assert results == [[True, True, True, False]] * 2
