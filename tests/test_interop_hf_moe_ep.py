"""A Hugging Face Mixtral or Qwen3-MoE checkpoint imported under expert parallelism: at
dp 2 × ep 2 each rank loads only its experts, and the model gives transformers' logits
and trains as the single process does (losses, gradient norms, final weights, 20 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import Jobs, assert_close_run, tiny_config
from test_interop_hf_moe import ARCH, LOGIT_ATOL, TOKENS, hf_logits, save_hf_moe

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

EP = {"dp": 2, "ep": 2}


def _config(path: Path, parallel: dict):
    from tetrad.interop import hf

    cfg = tiny_config(parallel=parallel)
    cfg.model = hf.model_config(path)  # its shape, and init_from_hf: its weights
    return cfg


def _import_and_train(rank: int, world: int, path: str, arch: str, parallel: dict) -> dict:
    """Rank 0 writes the random HF checkpoint; every rank imports it at `parallel`, takes
    the logits of TOKENS (a collective under ep), then trains."""
    import torch.distributed as dist

    from harness import trainer_for

    if rank == 0:
        save_hf_moe(path, arch)
    if world > 1:
        dist.barrier()
    trainer = trainer_for(_config(Path(path), parallel), rank)
    held = {n: tuple(p.shape) for n, p in trainer.engine.model.named_parameters()}
    model = trainer.engine.model
    with torch.no_grad():  # the chunked loss ends the model at the final norm: project here
        out = model(TOKENS)
        logits = out if model.logits else torch.nn.functional.linear(out, model.head_weight())
    rows = trainer.fit()
    state = trainer.engine.full_state_dict()  # a collective
    return {
        "held": held,
        "logits": logits,
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "state": state if rank == 0 else None,
    }


def declare_jobs(jobs: Jobs) -> None:
    for arch in ARCH:
        jobs.add(arch, 2, _import_and_train, str(jobs.tmp(arch)), arch, EP)


@pytest.mark.parametrize("arch", list(ARCH))
def test_hf_moe_at_ep2_gives_hf_logits_and_trains_as_one_process(jobs, tmp_path, arch):
    ranks = jobs[arch]
    path = jobs.tmp(arch)  # the checkpoint rank 0 wrote
    single = _import_and_train(0, 1, str(tmp_path), arch, {})  # the same seeded checkpoint
    theirs = hf_logits(path, arch, TOKENS)
    assert theirs.abs().max() > 1
    experts = [n for n in single["held"] if ".experts." in n]
    assert experts
    for rank, out in enumerate(ranks):
        for name in experts:  # each rank holds half of every expert weight
            full = single["held"][name]
            assert out["held"][name] == (full[0] // 2, *full[1:]), (rank, name)
        # imported into fp64 (the test model's dtype), against transformers' fp32
        torch.testing.assert_close(out["logits"].float(), theirs, rtol=0, atol=LOGIT_ATOL)
        torch.testing.assert_close(out["logits"], single["logits"], rtol=0, atol=LOGIT_ATOL)
    assert_close_run(ranks[0], single)
