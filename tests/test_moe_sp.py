"""Mixture of experts under sequence parallelism reproduces the single process: losses,
gradient norms, auxiliary losses, final weights and the loss-free bias, fp64, 8 steps,
relative 1e-10 (harness.EXACT; docs/moe.md, "When ep does not span tp").

Under sp each tp rank holds its own s/tp of the tokens at the feed-forward and dispatches
them itself: nothing is split or joined over tp around the experts."""

from __future__ import annotations

import pytest

from harness import Jobs
from test_moe_ep_equivalence import AUX, BIAS, check_moe_run, config, moe_worker

pytestmark = pytest.mark.distributed

# name -> (model overrides, parallel degrees); each world size's runs share one spawn
LAYOUTS = {
    # ep 1: every expert on every rank, each tp rank computing its own tokens; selective
    # recomputation reruns the shared expert's region (its gather) inside backward
    "tp2-sp": (AUX, {"tp": 2, "sp": True, "microbatches": 2}, {"recompute": "selective"}),
    # ep over the data ranks, experts replicated over tp (each tp rank its own tokens)
    "ep2-tp2-sp": (AUX, {"dp": 2, "tp": 2, "sp": True, "ep": 2}),
    # ep borrowing the tp ranks: every rank one expert, every rank its own tokens
    "ep4-tp2-sp": (BIAS, {"dp": 2, "tp": 2, "sp": True, "ep": 4}),
}


def declare_jobs(jobs: Jobs) -> None:
    for name, (model, par, *train) in LAYOUTS.items():
        cfg = config(model, par, *train)
        jobs.add(name, cfg.parallel.world, moe_worker, cfg.to_dict())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_with_sp_matches_single_process(jobs, name):
    model, par, *_ = LAYOUTS[name]
    got = check_moe_run(jobs[name], model, par)
    # the sequence really is split over tp (sp's reduce-scatters ran)
    assert got["comm"]["tp/reduce_scatter"]["calls"] > 0
