"""Zero-bubble schedules with mixture-of-experts layers: the router's and the routed
experts' weight gradients wait for W like the dense layers' (B computes only input
gradients), and the runs still reproduce the single process (fp64, 8 steps, relative
1e-5; docs/moe.md, "Exactness")."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness import Jobs, assert_close_run, tiny_config, trainer_for
from test_moe_ep_equivalence import AUX, config, reference

# name -> (model overrides, parallel degrees); 4 ranks each, one spawn with the suite's
LAYOUTS = {
    # zb-v's V: each rank two stages, experts over the 2 data ranks
    "ep2-pp2-zbv": (
        {**AUX, "layers": 4},
        {"dp": 2, "pp": 2, "ep": 2, "pp_schedule": "zb-v", "virtual_stages": 2, "microbatches": 2},
    ),
    # sp inside the stages, ep borrowing tp: the router's W sums its gradient over tp
    "ep2-tp2-sp-pp2-zbh1": (
        AUX,
        {"tp": 2, "sp": True, "pp": 2, "ep": 2, "pp_schedule": "zb-h1", "microbatches": 2},
    ),
}

ROUTED = ("router.weight", "experts.w1", "experts.w2", "experts.w3")


def _routed(name: str) -> bool:
    return name.endswith(ROUTED)


def _zb_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Train 8 steps, noting which routed weights' gradients each B and each W action
    changed; return what `assert_close_run` compares."""
    from tetrad.config import from_dict

    trainer = trainer_for(from_dict(cfg_dict), rank)
    runtime = trainer.engine.runner
    weights = {n: p for n, p in trainer.engine.model.named_parameters() if _routed(n)}
    changed: dict[str, set[str]] = {"B": set(), "W": set()}
    compute = runtime._compute

    def noted(st, a):
        before = {n: _grad(p) for n, p in weights.items()}
        compute(st, a)
        for n, p in weights.items():
            if a.kind in changed and not torch.equal(before[n], _grad(p)):
                changed[a.kind].add(n)

    runtime._compute = noted
    rows = trainer.fit()
    state = trainer.engine.full_state_dict()  # collective: every rank joins
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "aux": [r.get("moe_aux_loss") for r in rows],
        "state": state if rank == 0 else None,
        "routed": sorted(weights),
        "changed": {k: sorted(v) for k, v in changed.items()},
    }


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()


def declare_jobs(jobs: Jobs) -> None:
    for name, (model, par) in LAYOUTS.items():
        cfg = config(model, par)
        jobs.add(name, cfg.parallel.world, _zb_worker, cfg.to_dict())


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_zero_bubble_matches_single_process_and_defers_to_w(jobs, name):
    model, par = LAYOUTS[name]
    # the single process accumulating the same microbatches of sequences (dp × m of
    # them): against one of 2 microbatches zb-v's 4 layers drift to 1.1e-5 in a weight
    # from the different grouping of the sums alone; against this one, 5e-7
    ref = reference(model, par["microbatches"] * par.get("dp", 1))
    runs = jobs[name]
    assert_close_run(runs[0], ref)
    torch.testing.assert_close(
        torch.tensor(runs[0]["aux"]), torch.tensor(ref["aux"]), rtol=1e-5, atol=0
    )
    for got in runs:  # every rank: its router and experts get their gradients in W only
        assert got["routed"], got
        assert got["changed"]["B"] == [], got["changed"]
        assert got["changed"]["W"] == got["routed"]


# --- one MoE layer, one process ----------------------------------------------------------


def _layer(seed: int, ffn: int):
    from tetrad.models.moe import MoEFeedForward

    cfg = tiny_config(model={**AUX, "experts": 4, "moe_ffn_dim": ffn}).model
    layer = MoEFeedForward(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


# 32: the grouped matmul kernel, forward, B and W; 30 (rows of 120 bytes, which the CPU
# kernel refuses): the loop over groups that other devices take
@pytest.mark.parametrize("ffn", [32, 30])
def test_b_leaves_router_and_expert_weight_gradients_to_w(ffn):
    """Under a B action the MoE layer's backward files the router's logits matmul and each
    expert weight's grouped matmul with the store (no weight has a gradient yet, the
    input has its own); W then gives them the gradients a plain backward gives."""
    from tetrad.models.moe_spec import MOE
    from tetrad.parallel.pipeline.weightgrad import WeightGradStore, defer_weight_grads

    plain, split = _layer(0, ffn), _layer(0, ffn)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(xa).backward(g)

    store = WeightGradStore()
    names = defer_weight_grads(split, store, MOE)
    assert set(names) >= {"router.weight", "experts.w1", "experts.w2", "experts.w3"}
    with store.filing((0, 0)):
        split(xb).backward(g)
    assert all(p.grad is None for p in split.parameters())
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-6, atol=1e-7)
    grouped = [f for f in store.pending[(0, 0)] if f.counts is not None]
    assert len(grouped) == 3  # w1, w3 and w2's grouped matmuls
    copies = 2 * 8 * AUX["top_k"]
    dim = 32
    store.flush((0, 0))
    want = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in split.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)
    # W did the experts' matmuls too: 3 of 2·copies·dim·ffn, with the router's and the
    # shared expert's
    shared = 3 * 2 * 16 * dim * ffn * AUX["shared_experts"]
    router = 2 * 16 * dim * 4
    assert store.flops == 3 * 2 * copies * dim * ffn + shared + router
