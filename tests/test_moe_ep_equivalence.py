"""Expert parallelism reproduces the single process: losses, gradient norms, auxiliary
losses, final weights and the loss-free bias, fp64, 8 steps, relative 1e-10 (harness.EXACT;
ep in fp32 and bf16: test_rounding.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness import EXACT, Jobs, assert_close_run, tiny_config, trainer_for

pytestmark = pytest.mark.distributed

MOE = {"family": "moe", "experts": 4, "top_k": 2, "moe_ffn_dim": 32, "shared_experts": 1}
AUX = {**MOE, "balance": "aux", "aux_loss_coef": 0.01}
BIAS = {**MOE, "balance": "bias", "router": "sigmoid", "bias_rate": 0.01}

# name -> (model overrides, parallel degrees); each world size's runs share one spawn
LAYOUTS = {
    # accumulation over 2 microbatches; recomputation reruns the all-to-alls inside
    # backward, on every rank alike
    "ep2": (AUX, {"dp": 2, "ep": 2, "microbatches": 2}, {"recompute": "selective"}),
    "ep4": (BIAS, {"dp": 4, "ep": 4}),
    # ep inside the data ranks, experts replicated over tp (each tp rank half the tokens)
    "ep2-tp2": (AUX, {"dp": 2, "tp": 2, "ep": 2}),
    # ep borrowing the tp ranks: every rank holds one expert
    "ep4-tp2": (BIAS, {"dp": 2, "tp": 2, "ep": 4}),
    "tp2": (AUX, {"tp": 2}),  # no ep: still the tokens split over tp
    "ep2-pp2": (AUX, {"dp": 2, "pp": 2, "ep": 2, "pp_schedule": "zb-h1", "microbatches": 2}),
    "ep2-cp2": (AUX, {"dp": 2, "cp": 2, "ep": 2}),
    # ep over the sharded-data ranks: ZeRO-3 shards the rest, each rank its own experts
    "ep2-fsdp2": (BIAS, {"fsdp": 2, "ep": 2, "zero_stage": 3}),
    # each expert slice on 2 fsdp ranks: ZeRO-1 shards it over them (its ep_data group)
    "ep2-fsdp4": (AUX, {"fsdp": 4, "ep": 2, "zero_stage": 1, "microbatches": 2}),
    # the mix, in the suite's 8-rank world: pp x cp x tp, ep borrowing cp and tp
    "mix8": (BIAS, {"pp": 2, "cp": 2, "tp": 2, "ep": 4, "microbatches": 2}),
}

# The other schedules (1F1B: mix8; zb-v: test_moe_zb.py), interleaved at 2 stages a rank:
# held to the single process accumulating the same dp × m = 4 microbatches (2 leave one
# attention weight 1.1e-5 away, norm-wise, from the grouping of the sums alone)
SCHEDULES = {
    "ep2-pp2-gpipe": (BIAS, {"dp": 2, "pp": 2, "ep": 2, "pp_schedule": "gpipe", "microbatches": 2}),
    "ep2-pp2-interleaved": (
        {**AUX, "layers": 4},
        {"dp": 2, "pp": 2, "ep": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2,
         "microbatches": 2},
    ),
}  # fmt: skip


def config(model: dict, parallel: dict, train: dict | None = None):
    """8 steps unless `train` says: a wrong dispatch, sum or shard is off from the first
    step; 8 carry the optimizer state and the bias updates past the warm-up."""
    return tiny_config(model=model, parallel=parallel, train={"steps": 8, **(train or {})})


def moe_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Train; return what `assert_close_run` compares, plus the auxiliary losses and the
    routers' biases (buffers: not in the state dict)."""
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(cfg_dict), rank)
    rows = trainer.fit()
    state = trainer.engine.full_state_dict()
    bias = {n: b.clone() for n, b in trainer.engine.model.named_buffers() if "bias" in n}
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "aux": [r.get("moe_aux_loss") for r in rows],
        "model_state": [(r["model_state_bytes"], r["model_state_predicted_bytes"]) for r in rows],
        "bias": bias,
        "comm": trainer.comm.summary(),
        "lane": sorted({e.kind for e in trainer.engine.last_run.comm_events}),
        "state": state if rank == 0 else None,
    }


def declare_jobs(jobs: Jobs) -> None:
    for name, (model, par, *train) in (LAYOUTS | SCHEDULES).items():
        cfg = config(model, par, *train)
        jobs.add(name, cfg.parallel.world, moe_worker, cfg.to_dict())
    declare_overlap(jobs)


def reference(model: dict, microbatches: int = 1, train: dict | None = None) -> dict:
    """The single process (cached per model, microbatches and train overrides)."""
    key = (repr(sorted(model.items())), microbatches, repr(sorted((train or {}).items())))
    if key not in _REFERENCES:
        cfg = config(model, {"microbatches": microbatches}, train)
        _REFERENCES[key] = moe_worker(0, 1, cfg.to_dict())
    return _REFERENCES[key]


_REFERENCES: dict = {}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ep_matches_single_process(jobs, name):
    model, par, *_ = LAYOUTS[name]
    got = check_moe_run(jobs[name], model, par)
    if par.get("pp", 1) > 1:  # the dispatch shows in the pipeline's communication lane
        assert "A2A" in got["lane"]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_ep_under_every_schedule_matches_single_process(jobs, name):
    model, par = SCHEDULES[name]
    got = check_moe_run(jobs[name], model, par, ref_microbatches=par["dp"] * par["microbatches"])
    assert "A2A" in got["lane"]


def check_moe_run(
    per_rank: list[dict], model: dict, par: dict, ref_microbatches: int | None = None
) -> dict:
    """A MoE layout's run (its ranks' results, moe_worker's) equals the single process:
    losses, norms and weights, the auxiliary loss or the loss-free bias (moved, and alike
    on every rank that holds it), the measured model state is the predicted, and tokens
    crossed ranks where the experts are split. Returns rank 0's results."""
    ref = reference(model, ref_microbatches or par.get("microbatches", 1))
    got = per_rank[0]
    assert_close_run(got, ref)
    if model["balance"] == "aux":
        assert ref["aux"][0] > 0
        torch.testing.assert_close(
            torch.tensor(got["aux"]), torch.tensor(ref["aux"]), rtol=EXACT, atol=0
        )
    else:
        assert any(b.abs().sum() > 0 for b in ref["bias"].values())
        for rank in per_rank:
            for n, b in rank["bias"].items():
                torch.testing.assert_close(b, ref["bias"][n], rtol=EXACT, atol=EXACT * 1e-2)
        held = {n for rank in per_rank for n in rank["bias"]}
        assert held == set(ref["bias"]), "some layer's bias is held by no rank"
    measured, predicted = got["model_state"][-1]  # the memory model knows what ep holds
    assert measured == predicted
    if par.get("ep", 1) > 1:  # the experts really are split: tokens crossed ranks
        assert got["comm"]["ep/all_to_all"]["bus_bytes"] > 0
    return got


def _overlap_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One step with every MoE layer's dispatcher noting what runs when, and the comm
    layer tracing its async collectives."""
    from tetrad.config import from_dict
    from tetrad.parallel.expert import expert_layers

    trainer = trainer_for(from_dict(cfg_dict), rank)
    dispatchers = [layer.dispatch for _, layer in expert_layers(trainer.engine.model)]
    for d in dispatchers:
        d.events = []
    flights: list = []
    trainer.comm.trace_into(flights)
    trainer.train_step()
    trainer.comm.trace_into(None)
    return {
        "events": [d.events for d in dispatchers],
        "flights": [(f.op, f.group) for f in flights],
    }


OVERLAP = config(AUX, {"dp": 2, "ep": 2, "microbatches": 2})


def declare_overlap(jobs: Jobs) -> None:
    jobs.add("overlap", 2, _overlap_worker, OVERLAP.to_dict())


def test_shared_expert_runs_while_the_tokens_travel(jobs):
    """Each MoE layer, each microbatch: the dispatch all-to-all is launched (async, traced
    by Comm), the shared expert computes, and only then is the transfer waited for."""
    for got in jobs["overlap"]:
        layers = OVERLAP.model.layers - OVERLAP.model.dense_layers
        assert len(got["events"]) == layers
        for events in got["events"]:
            step = ["dispatch launched", "shared expert", "dispatch waited"]
            assert events == step * 2  # two microbatches
        traced = [f for f in got["flights"] if f == ("all_to_all", "ep")]
        assert len(traced) == layers * 2
