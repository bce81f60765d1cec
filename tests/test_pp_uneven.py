"""A pipeline with more stages than layers allow evenly: the first stage may hold the
embedding alone and the last the final norm and head alone (Megatron's account for the
embedding and the loss in the split), in every schedule, exact against the single process."""

from __future__ import annotations

import pytest

from harness import Jobs, assert_close_run, tiny_config
from tetrad.layout import Layout
from tetrad.parallel.pipeline.stage import layer_split

pytestmark = pytest.mark.distributed

MODEL = {"layers": 2}
TIED = {**MODEL, "tie_embeddings": True}
TRAIN = {"global_batch": 8, "steps": 6}
# (pp, schedule, microbatches, virtual stages, model): 4 chunks for 2 layers, [0, 1, 1, 0]
CASES = {
    "gpipe": (4, "gpipe", 4, 1, MODEL),
    "1f1b": (4, "1f1b", 4, 1, MODEL),
    "zb-h1": (4, "zb-h1", 4, 1, MODEL),
    "1f1b-tied": (4, "1f1b", 4, 1, TIED),
    "interleaved": (2, "interleaved-1f1b", 2, 2, MODEL),
    "zb-v": (2, "zb-v", 2, 2, MODEL),
}


def _config(pp: int, schedule: str, m: int, v: int, model: dict):
    par = {"pp": pp, "pp_schedule": schedule, "microbatches": m, "virtual_stages": v}
    return tiny_config(model=model, train=TRAIN, parallel=par)


def declare_jobs(jobs: Jobs) -> None:
    for world in (2, 4):
        cfgs = [_config(*c) for c in CASES.values() if c[0] == world]
        jobs.add_training(f"uneven-{world}", cfgs)


def test_the_ends_may_hold_no_layer():
    for case in CASES.values():
        cfg = _config(*case)
        assert layer_split(Layout.build(cfg, case[0]), cfg.model) == [0, 1, 1, 0]
    with pytest.raises(ValueError, match=r"model.layers=2 < pp\*virtual_stages-2=5\*1-2 = 3"):
        Layout.build(_config(5, "1f1b", 4, 1, MODEL), 5)


def test_every_schedule_with_layerless_ends_matches_the_single_process(reference, jobs):
    runs = {world: iter(jobs[f"uneven-{world}"][0]) for world in (2, 4)}
    for case in CASES.values():
        got = next(runs[case[0]])
        assert_close_run(got, reference(model=case[4], train=TRAIN))
