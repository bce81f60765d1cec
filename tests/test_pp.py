"""Pipeline parallelism reproduces the single process, for every schedule and composition."""

from __future__ import annotations

import pytest

from harness import Jobs, assert_close_run, tiny_config

pytestmark = pytest.mark.distributed

MODEL = {"layers": 4}
# 8 steps: a schedule that moves, sums or applies a gradient wrongly is off from the first
# step on, and 8 AdamW steps carry the optimizer state through its warm-up and after
TRAIN = {"global_batch": 24, "steps": 8}


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


TIED = {**MODEL, "tie_embeddings": True}
TIED_CASES = [("1f1b", 4, 1, 4), ("zb-h1", 4, 1, 2), ("zb-v", 4, 2, 2)]  # (schedule, m, v, pp)
WITH_DP = [(2, "1f1b", 4, 1), (2, "zb-h1", 2, 1)]  # (pp, schedule, m, v), dp 2


def _every(pp: int) -> list[tuple[str, int, int]]:
    """GPipe's m = 2pp at pp 4 is left out: its every forward, then every backward, is at
    m = pp and m = 3 the same pattern, shorter (pp 2 keeps its m = 2pp)."""
    cases = [c for c in _cases(pp) if c[0] != "zb-v" or 2 * pp <= MODEL["layers"]]
    return [c for c in cases if not (pp == 4 and c[0] == "gpipe" and c[1] == 2 * pp)]


def declare_jobs(jobs: Jobs) -> None:
    """Every layout of this module (2 and 4 ranks)."""
    for pp in (2, 4):
        jobs.add_training(f"every-pp{pp}", [_config(pp, *c) for c in _every(pp)])
    for schedule, m, v, pp in TIED_CASES:
        par = {"pp": pp, "pp_schedule": schedule, "microbatches": m, "virtual_stages": v}
        jobs.add_training(f"tied-{schedule}", [tiny_config(model=TIED, train=TRAIN, parallel=par)])
    jobs.add_training("with-dp", [_config(*c, dp=2) for c in WITH_DP])
    jobs.add_training("one-microbatch", [_config(2, "1f1b", 1, 1)])


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_single_process(reference, jobs, pp):
    ref = reference(model=MODEL, train=TRAIN)
    for case, got in zip(_every(pp), jobs[f"every-pp{pp}"][0], strict=True):
        try:
            assert_close_run(got, ref)
        except AssertionError as e:
            raise AssertionError(f"pp={pp} schedule/m/v={case}: {e}") from None


def test_tied_embeddings_across_first_and_last_stage(reference, jobs):
    for schedule, *_ in TIED_CASES:
        (got,) = jobs[f"tied-{schedule}"][0]
        assert_close_run(got, reference(model=TIED, train=TRAIN))


def test_pp_composes_with_dp(reference, jobs):
    for got in jobs["with-dp"][0]:
        assert_close_run(got, reference(model=MODEL, train=TRAIN))


def test_one_microbatch_on_two_stages_runs_correctly(reference, jobs):
    (got,) = jobs["one-microbatch"][0]
    assert_close_run(got, reference(model=MODEL, train=TRAIN))
