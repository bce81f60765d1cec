"""Pipeline parallelism reproduces the single process, for every schedule and composition."""

from __future__ import annotations

import pytest

from harness import assert_close_run, run_layouts, tiny_config

pytestmark = pytest.mark.distributed

MODEL = {"layers": 4}
TRAIN = {"global_batch": 24}


def _cases(pp: int) -> list[tuple[str, int, int]]:
    """(schedule, microbatches, virtual stages): m in {pp, 2pp, odd} where valid."""
    cases = []
    for m in (pp, 2 * pp, 3):
        cases += [("gpipe", m, 1), ("1f1b", m, 1), ("zb-h1", m, 1), ("zb-v", m, 2)]
        if m % pp == 0 and 2 * pp <= MODEL["layers"]:
            cases.append(("interleaved-1f1b", m, 2))
    return cases


def _config(pp: int, schedule: str, m: int, v: int, **parallel):
    par = {"pp": pp, "pp_schedule": schedule, "microbatches": m, "virtual_stages": v}
    return tiny_config(model=MODEL, train=TRAIN, parallel={**par, **parallel})


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_single_process(reference, pp):
    cases = [c for c in _cases(pp) if c[0] != "zb-v" or 2 * pp <= MODEL["layers"]]
    results = run_layouts([_config(pp, *c) for c in cases])
    ref = reference(model=MODEL, train=TRAIN)
    for case, got in zip(cases, results):
        try:
            assert_close_run(got, ref)
        except AssertionError as e:
            raise AssertionError(f"pp={pp} schedule/m/v={case}: {e}") from None


def test_tied_embeddings_across_first_and_last_stage(reference):
    model = {**MODEL, "tie_embeddings": True}
    cases = [("1f1b", 4, 1, 4), ("zb-h1", 4, 1, 2), ("zb-v", 4, 2, 2)]
    for schedule, m, v, pp in cases:
        par = {"pp": pp, "pp_schedule": schedule, "microbatches": m, "virtual_stages": v}
        cfg = tiny_config(model=model, train=TRAIN, parallel=par)
        (got,) = run_layouts([cfg])
        assert_close_run(got, reference(model=model, train=TRAIN))


def test_pp_composes_with_dp(reference):
    cfgs = [_config(2, "1f1b", 4, 1, dp=2), _config(2, "zb-h1", 2, 1, dp=2)]
    for got in run_layouts(cfgs):
        assert_close_run(got, reference(model=MODEL, train=TRAIN))


def test_one_microbatch_on_two_stages_runs_correctly(reference):
    (got,) = run_layouts([_config(2, "1f1b", 1, 1)])
    assert_close_run(got, reference(model=MODEL, train=TRAIN))
