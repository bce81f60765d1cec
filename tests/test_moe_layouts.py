"""The MoE family in data-parallel layouts (experts replicated over the data ranks): dp 2
and ZeRO-3 over fsdp 2 reproduce the single process's losses, gradient norms, weights,
auxiliary losses and loss-free biases, each balance mode and both routers covered."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from harness import EXACT, Jobs, assert_close_run, tiny_config, trainer_for
from tetrad.config import MODEL_PRESETS, from_dict
from tetrad.models.moe import moe_layers

pytestmark = pytest.mark.distributed

# moe-tiny with the test vocabulary; a large auxiliary coefficient and bias rate, so that
# a wrongly scaled loss or a bias step from one rank's counts shows in the 1e-5 bar
MOE = {**MODEL_PRESETS["moe-tiny"], "vocab": 64, "aux_loss_coef": 0.1, "bias_rate": 0.01}
CASES = {  # name -> (parallel, model, train overrides)
    "dp2-aux-mb2": ({"dp": 2, "microbatches": 2}, {}, {}),
    "dp2-bias-sigmoid": ({"dp": 2}, {"balance": "bias", "router": "sigmoid"}, {}),
    "fsdp2-aux-selective": ({"fsdp": 2, "zero_stage": 3}, {}, {"recompute": "selective"}),
    "fsdp2-bias-mb2": (
        {"fsdp": 2, "zero_stage": 3, "microbatches": 2},
        {"balance": "bias", "router": "sigmoid", "dense_layers": 1},
        {},
    ),
    "fsdp2-none": ({"fsdp": 2, "zero_stage": 3}, {"balance": "none"}, {}),
}


def _config(parallel: dict, model: dict, train: dict, single: bool = False):
    if single:  # the reference: one process, the same microbatches
        parallel = {"microbatches": parallel.get("microbatches", 1)}
    return tiny_config(parallel=parallel, model={**MOE, **model}, train=train)


def _moe_run(rank: int, world: int, cfg_dict: dict) -> dict:
    """Train; return losses, norms, full weights (rank 0), aux losses and biases."""
    trainer = trainer_for(from_dict(cfg_dict), rank)
    rows = trainer.fit()
    state = trainer.engine.full_state_dict()  # a collective
    biases = {i: f.router.expert_bias.clone() for i, f in moe_layers(trainer.engine.model).items()}
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "aux": [r["moe_aux_loss"] for r in rows],
        "load_max": [[v["load_max"] for v in r["moe_layers"].values()] for r in rows],
        "state": state if rank == 0 else None,
        "biases": biases,
    }


SAVED = "fsdp2-bias-mb2"  # also checkpoints at step 10, with its biases


def declare_jobs(jobs: Jobs) -> None:
    for name, (par, model, train) in CASES.items():
        cfg = _config(par, model, train)
        if name == SAVED:
            cfg.train.out, cfg.checkpoint.every = str(jobs.tmp(name)), 10
        jobs.add(name, cfg.parallel.world, _moe_run, cfg.to_dict())


@pytest.fixture(scope="module")
def single():
    cache = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = _moe_run(0, 1, _config(*CASES[name], single=True).to_dict())
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_single_process(jobs, single, name):
    ref = single(name)
    for rank, got in enumerate(jobs[name]):
        torch.testing.assert_close(
            torch.tensor(got["aux"], dtype=torch.float64),
            torch.tensor(ref["aux"], dtype=torch.float64),
            rtol=EXACT, atol=0,
        )  # fmt: skip
        assert got["load_max"] == ref["load_max"]  # the same routing, token for token
        assert got["biases"].keys() == ref["biases"].keys()
        for i, bias in ref["biases"].items():  # every data rank, the same bias
            torch.testing.assert_close(got["biases"][i], bias, rtol=EXACT, atol=EXACT * 1e-2)
        if rank == 0:
            assert_close_run(got, ref)
    if CASES[name][1].get("balance") == "bias":
        assert all(b.abs().sum() > 0 for b in ref["biases"].values())


def test_biases_resume_from_a_checkpoint_in_another_layout(jobs, single, tmp_path):
    """Saved at step 10 under ZeRO-3 on 2 ranks, resumed on one process: the remaining
    steps and the final biases are the uninterrupted run's (the bias is checkpointed)."""
    jobs[SAVED]  # the run that saved (at steps 10 and 20): resume from the first
    step = Path("checkpoints") / "step_00000010"
    shutil.copytree(jobs.tmp(SAVED) / step, tmp_path / step)
    cfg = _config(*CASES[SAVED], single=True)
    cfg.train.out, cfg.checkpoint.resume = str(tmp_path), True
    trainer = trainer_for(cfg, 0)
    assert trainer.resume() == 10
    rows = trainer.fit()
    ref = single(SAVED)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in rows], dtype=torch.float64),
        torch.tensor(ref["losses"][10:], dtype=torch.float64),
        rtol=EXACT, atol=0,
    )  # fmt: skip
    for i, ffn in moe_layers(trainer.engine.model).items():
        torch.testing.assert_close(
            ffn.router.expert_bias, ref["biases"][i], rtol=EXACT, atol=EXACT * 1e-2
        )
