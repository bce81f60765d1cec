"""Expert weights ZeRO-sharded over the ranks holding the same experts (ep_data): at fsdp 4
x ep 2 every expert slice lies on 2 ranks, which split its weights (stage 3), gradients
(stage >= 2) and AdamW state (stage >= 1); so do the dp replicas under HSDP (dp 2 x
fsdp 2 x ep 2), the rest replicated over them. Each reproduces the single process
(fp32, 20 steps, relative 1e-5); the expert state a rank holds is measured and is half
of what the same experts held whole take (fsdp 2 x ep 2: ep_data of 1), up to padding;
every rank's measured model state is predicted to the byte; a checkpoint saved with
sharded experts resumes at ep 4 without fsdp, on one process and under HSDP."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from harness import EXACT, Jobs, assert_close_run, tiny_config, train_resumed, trainer_for
from plan_helpers import layout_config, planned
from tetrad.plan.cost import Planner
from tetrad.plan.hardware import cluster_preset

pytestmark = pytest.mark.distributed

MOE = {"family": "moe", "experts": 4, "top_k": 2, "moe_ffn_dim": 32, "shared_experts": 1}
MOE |= {"balance": "aux", "aux_loss_coef": 0.01}
SHARDED = {f"z{z}": {"fsdp": 4, "ep": 2, "zero_stage": z} for z in (1, 2, 3)}
# HSDP: ep takes the 2 fsdp ranks, so the expert-data group is the dp replicas, which
# split the experts while the rest is replicated over them
SHARDED["hsdp-z2"] = {"dp": 2, "fsdp": 2, "ep": 2, "zero_stage": 2}
WHOLE = {"fsdp": 2, "ep": 2, "zero_stage": 1}  # the same 2 experts a rank, ep_data of 1
EXPERTS = [f"layers.1.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")]


def _cfg(parallel: dict, out=None, every: int = 0, resume: bool = False, steps: int = 20):
    train = {"steps": steps} | ({"out": str(out)} if out else {})
    ck = {"every": every, "resume": resume, "keep": 2}
    return tiny_config(model=MOE, parallel=parallel, train=train, checkpoint=ck)


def _expert_part(engine):
    """The expert weights' gradient sync (`GroupedGrads`'s second part: the expert group)."""
    return engine.grads.parts[1]


def _expert_bytes(engine, optimizer) -> dict[str, int]:
    """Bytes of the live storages behind the expert weights, their gradients and AdamW
    state on this rank (measured, views of one buffer counted once)."""
    part, seen = _expert_part(engine), set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            s = None if t is None else t.untyped_storage()
            if s is None or s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            total += s.nbytes()
        return total

    held = part.held()
    state = [t for _, p in part.params() for t in optimizer.state.get(p, {}).values()]
    adam = [t for t in state if t.dim() > 0]  # the moments (the step counters: scalars)
    return {
        "params": size(held.params),
        "grads": size(held.grads),
        "optimizer": size([*held.masters, *adam]),
    }


def _worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    from tetrad.config import from_dict
    from tetrad.parallel.zero import ZeroShards

    trainer = trainer_for(from_dict(cfg_dict), rank)
    engine = trainer.engine
    held: list[dict[str, int]] = [{}]  # just after each step, when all of it is alive
    split = hasattr(engine.grads, "parts")  # under ep (not the single process)
    if split:
        engine.on_step(lambda: held.append(_expert_bytes(engine, trainer.optimizer)))
    rows = trainer.fit()
    part = _expert_part(engine) if split else engine.grads
    state = engine.full_state_dict()  # a collective: every rank takes part
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "aux": [r.get("moe_aux_loss") for r in rows],
        "measured": trainer.measured_state[-1].total,  # this rank's, not the max over ranks
        "predicted": trainer.model_state,
        "sharded": isinstance(part, ZeroShards),
        "experts": held[-1],
        "units": len(getattr(part, "units", [])),
        "optimized": sum(p.numel() for _, p in part.params()),  # elements AdamW steps here
        "state": state if rank == 0 else None,
    }


def declare_jobs(jobs: Jobs) -> None:
    for name, par in SHARDED.items():
        jobs.add(name, 4, _worker, _cfg(par).to_dict())
    jobs.add("whole", 2, _worker, _cfg(WHOLE, steps=2).to_dict())  # a measurement only
    out = jobs.tmp("ck")
    runs = [(_cfg(SHARDED["z3"], out, every=10).to_dict(), 10)]
    runs += [(_cfg({"dp": 4, "ep": 4}, out, resume=True).to_dict(), None)]
    # and into experts sharded otherwise: over the dp replicas (HSDP)
    runs += [(_cfg(SHARDED["hsdp-z2"], out, resume=True).to_dict(), None)]
    jobs.add("ck", 4, train_resumed, runs)


_REFERENCE: dict = {}


def reference() -> dict:
    if not _REFERENCE:
        _REFERENCE.update(_worker(0, 1, _cfg({}).to_dict()))
    return _REFERENCE


@pytest.mark.parametrize("name", list(SHARDED))
def test_sharded_experts_match_single_process(jobs, name):
    ref, got = reference(), jobs[name][0]
    assert all(rank["sharded"] for rank in jobs[name])  # experts in ZeRO shards, not whole
    assert_close_run(got, ref)
    assert got["aux"] == pytest.approx(ref["aux"], rel=1e-5)


@pytest.mark.parametrize("name", list(SHARDED))
def test_expert_state_is_half_the_whole(jobs, name):
    """Measured: the expert state of each rank is the whole one's over |ep_data| = 2, up
    to each unit's padding (under 2 elements a unit); weights (stage 3) and gradients
    (stage >= 2) split as the stage says, AdamW moments always."""
    stage = SHARDED[name]["zero_stage"]
    whole = jobs["whole"][0]
    assert not whole["sharded"]
    numel = whole["optimized"]  # this rank's experts, whole
    w = 8  # fp64 (the test model's dtype): parameters, gradients, each AdamW moment
    assert whole["experts"] == {"params": w * numel, "grads": w * numel, "optimizer": 2 * w * numel}
    half = numel // 2
    for rank in jobs[name]:
        got, pad = rank["experts"], rank["units"]  # each unit padded to an even size
        assert rank["units"] >= 1 and half - pad <= rank["optimized"] <= half
        assert 2 * w * rank["optimized"] == got["optimizer"]  # AdamW's moments: half
        grads = half if stage >= 2 else numel  # ZeRO-1: the full gradient, scattered in place
        params = half if stage == 3 else numel
        assert w * grads <= got["grads"] <= w * (grads + pad)
        assert w * params <= got["params"] <= w * (params + pad)


@pytest.mark.parametrize("name", list(SHARDED))
def test_planner_predicts_the_measured_state(jobs, name):
    """Every rank's measured model state is the runtime memory model's prediction for that
    rank, to the byte; the planner's (shard rank 0) is rank 0's."""
    cfg = _cfg(SHARDED[name])
    plan = layout_config(cfg.model, cfg.train.global_batch, cfg.train.seq_len, cfg.train.dtype, **{
        k: getattr(cfg.parallel, k) for k in ("dp", "fsdp", "tp", "pp", "cp", "ep", "zero_stage")
    })  # fmt: skip
    predicted = Planner(cluster_preset("cpu")).rank_facts(*planned(plan), 0).state.total
    for rank in jobs[name]:
        assert rank["measured"] == rank["predicted"]
    assert jobs[name][0]["measured"] == predicted


def test_sharded_experts_resume_at_ep4_and_on_one_process(jobs):
    """Saved at fsdp 4 x ep 2 ZeRO-3 (experts split over ep_data), resumed at ep 4 without
    fsdp, on one process, and at dp 2 x fsdp 2 x ep 2 ZeRO-2 (the experts split over the
    dp replicas): each reproduces the single process's last 10 steps; the manifest holds
    the expert weights as full logical tensors, each rank's shard written by it."""
    saved, resumed, resharded = jobs["ck"][0]
    out = jobs.tmp("ck")
    (single,) = train_resumed(0, 1, [(_cfg({}, out, resume=True).to_dict(), None)])
    ref = reference()
    tail = {**ref, "losses": ref["losses"][10:], "grad_norms": ref["grad_norms"][10:]}
    assert saved["losses"] == pytest.approx(ref["losses"][:10], rel=EXACT)
    for got in (resumed, single, resharded):
        assert got["start"] == 10
        assert_close_run(got, tail)
    manifest = json.loads((out / "checkpoints/step_00000010/manifest.json").read_text())
    writers = set()
    for name in EXPERTS:
        entry = manifest["tensors"][name]
        assert entry["shape"][0] == 4  # the logical tensor, all experts
        # the ranks' boxes tile the whole tensor exactly once
        covered = sum(math.prod(b - a for a, b in s["box"]) for s in entry["slices"])
        assert covered == math.prod(entry["shape"])
        writers |= {s["file"] for s in entry["slices"]}
    # every rank wrote its own shard of its slice: 2 ep slices, each split over ep_data
    assert writers == {f"rank-{r:05d}.safetensors" for r in range(4)}
