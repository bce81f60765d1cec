"""Expert-parallel checkpoints: expert weights saved as full logical [experts, ...]
tensors in dim-0 boxes, each written once; saved at ep 2 and resumed at ep 4 and on one
process, both reproduce the single process's last 10 steps."""

from __future__ import annotations

import json

import pytest

from harness import Jobs, assert_close_run, tiny_config, train_resumed

pytestmark = pytest.mark.distributed

MOE = {"family": "moe", "experts": 4, "top_k": 2, "moe_ffn_dim": 32, "shared_experts": 1}
MOE |= {"router": "sigmoid", "balance": "bias", "bias_rate": 0.01}  # the bias resumes too
EXPERT = "layers.1.feed_forward.experts.w1"


def _cfg(out, parallel: dict, every: int = 0, resume: bool = False) -> dict:
    ck = {"every": every, "resume": resume, "keep": 2}
    return tiny_config(model=MOE, train={"out": str(out)}, parallel=parallel, checkpoint=ck)


def declare_jobs(jobs: Jobs) -> None:
    out = jobs.tmp("ep")
    runs = [(_cfg(out, {"dp": 4, "ep": 2}, every=10).to_dict(), 10)]
    runs += [(_cfg(out, {"dp": 4, "ep": 4}, resume=True).to_dict(), None)]
    jobs.add("ep", 4, train_resumed, runs)


def test_saved_at_ep2_resumes_at_ep4_and_on_one_process(jobs):
    saved, resumed = jobs["ep"][0]
    out = jobs.tmp("ep")
    (single,) = train_resumed(0, 1, [(_cfg(out, {}, resume=True).to_dict(), None)])
    (ref,) = train_resumed(0, 1, [(_cfg(out / "reference", {}).to_dict(), None)])
    tail = {**ref, "losses": ref["losses"][10:], "grad_norms": ref["grad_norms"][10:]}
    assert saved["losses"] == pytest.approx(ref["losses"][:10], rel=1e-5)
    for got in (resumed, single):
        assert got["start"] == 10
        assert_close_run(got, tail)
    manifest = json.loads((out / "checkpoints/step_00000010/manifest.json").read_text())
    entry = manifest["tensors"][EXPERT]
    assert entry["shape"] == [4, 32, 32]  # the logical tensor, all experts
    # two boxes of two experts each (dim 0), written once though 2 ranks hold each
    boxes = sorted(tuple(map(tuple, s["box"])) for s in entry["slices"])
    assert [b[0] for b in boxes] == [(0, 2), (2, 4)]
    assert manifest["placement"]["saved_from"]["ep"] == 2
