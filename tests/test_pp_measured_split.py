"""`--pp-split measured`: costs timed in a warm-up, agreed by every rank, balanced."""

from __future__ import annotations

import pytest

from harness import Jobs, assert_close_run, tiny_config, train_worker
from tetrad.config import from_dict
from tetrad.layout import Layout

MODEL = {"layers": 4, "vocab": 512}  # a head worth a few layers
TRAIN = {"global_batch": 24}


def _measured(pp: int, dp: int = 1):
    par = {"pp": pp, "dp": dp, "microbatches": 4, "pp_split": "measured"}
    return tiny_config(model=MODEL, train=TRAIN, parallel=par)


def _worker(rank: int, world: int, raw: dict) -> dict:
    """Train with the measured split; then time again with a rank-dependent skew, to
    show the agreement (not luck) makes every rank's costs the same."""
    import torch

    from tetrad.comm import Comm
    from tetrad.mesh import Mesh
    from tetrad.parallel.pipeline import split_costs
    from tetrad.train.checkpoint import run_record
    from tetrad.train.loop import Trainer

    cfg = from_dict(raw)
    out = train_worker(rank, world, raw)
    mesh = Mesh.build(cfg.parallel, rank)
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    out["split"] = ",".join(map(str, trainer.layout.split))  # the layout holds it
    out["recorded"] = run_record(cfg, trainer.layout)["parallel"]["pp_split"]  # checkpoints'
    timed = split_costs._time_items
    split_costs._time_items = lambda *a: [c * (1 + rank) for c in timed(*a)]
    try:
        out["costs"] = split_costs.measure_item_costs(
            Layout.build(cfg), cfg.model, cfg.train, Comm("cpu"), mesh["world"], "cpu"
        )
    finally:  # the ranks go on to other modules' jobs
        split_costs._time_items = timed
    out["own"] = timed(Layout.build(cfg), cfg.model, cfg.train, "cpu", 1)
    return out


def declare_jobs(jobs: Jobs) -> None:
    """The measured split at pp 2 x dp 2."""
    jobs.add("pp2xdp2", 4, _worker, _measured(2, dp=2).to_dict())


@pytest.mark.distributed
def test_measured_split_is_agreed_and_matches_single_process(reference, jobs):
    ranks = jobs["pp2xdp2"]
    splits = {r["split"] for r in ranks}
    assert len(splits) == 1, f"ranks disagree on the split: {splits}"
    assert all(r["recorded"] == r["split"] for r in ranks)  # what config.json records
    split = [int(x) for x in splits.pop().split(",")]
    assert len(split) == 2 and sum(split) == MODEL["layers"], split
    costs = [r["costs"] for r in ranks]
    assert all(c == costs[0] for c in costs), costs  # the max over ranks, on every rank
    assert len(costs[0]) == MODEL["layers"] + 2 and min(costs[0]) > 0
    assert_close_run(ranks[0], reference(model=MODEL, train=TRAIN))


@pytest.mark.parametrize(
    "split, match",
    [
        ("measurd", r"pp_split='measurd'.*comma-separated integers"),
        ("3,x", r"pp_split='3,x'"),
        ("3,3", r"pp_split='3,3'.*sums to 6, not 4"),
        ("2,1,1", r"pp_split='2,1,1'.*has 3 stages, not 2"),
        ("-1,5", r"pp_split='-1,5'.*non-negative"),
    ],
)
def test_bad_split_is_refused(split, match):
    from tetrad.layout import Layout

    cfg = tiny_config(model=MODEL, train=TRAIN, parallel={"pp": 2, "pp_split": split})
    with pytest.raises(ValueError, match=match):
        Layout.build(cfg, 2)


def test_measured_and_explicit_splits_are_accepted():
    from tetrad.layout import Layout

    for split in ("", "measured", "3,1", "4,0"):
        Layout.build(
            tiny_config(model=MODEL, train=TRAIN, parallel={"pp": 2, "pp_split": split}), 2
        )
