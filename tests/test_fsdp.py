"""ZeRO-1/2/3 and HSDP reproduce the single process, hold the predicted bytes to the byte,
and move exactly the theoretical volume.

Spawning is the slow part on 2 cores, so the layouts of one world size run in one set of
processes, one after the other (conftest's `jobs`), and each test checks its own.
"""

from __future__ import annotations

import math

import pytest

from harness import Jobs, assert_close_run, tiny_config, trainer_for
from memory_helpers import check_bf16
from tetrad.layout import Layout

pytestmark = pytest.mark.distributed


def _run(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """Train each config in turn; per run: losses, norms, one step's comm, memory, weights."""
    from tetrad.config import from_dict
    from tetrad.layout import Layout
    from tetrad.parallel.model_state import measure_at_each_step, model_state_bytes

    out = []
    for raw in runs:
        cfg = from_dict(raw)
        trainer = trainer_for(cfg, rank)
        at_step = measure_at_each_step(trainer.engine, trainer.optimizer)
        losses, norms, comm = [], [], None
        for step in range(cfg.train.steps):
            trainer.comm.reset()
            result = trainer.train_step()
            losses.append(result.loss)
            norms.append(result.grad_norm)
            if step == 1:
                comm = trainer.comm.summary()
        measured, predicted = at_step[-1], model_state_bytes(Layout.build(cfg), cfg.model, rank)
        state = trainer.engine.full_state_dict()
        out.append(
            {
                "losses": losses,
                "grad_norms": norms,
                "comm": comm,
                "memory": (measured, predicted),
                "state": state if rank == 0 else None,
            }
        )
    return out


def _layouts(cfg) -> list:
    """The unit layouts of rank 0 (the same sizes on every rank of one tp/pp coordinate)."""
    from tetrad.layout import Layout
    from tetrad.models.families import spec_for
    from tetrad.parallel.model_state import local_parameters
    from tetrad.parallel.zero import plan_units

    named, replicated = local_parameters(Layout.build(cfg), cfg.model, 0)
    return plan_units(named, replicated, cfg.parallel.fsdp, spec_for(cfg.model))


def _check_comm(cfg, comm: dict) -> None:
    """fsdp traffic of one step, exactly: Ψ_pad elements reduce-scattered, and gathered
    once (stages 1-2: after the step), or twice less the root (stage 3, which keeps the
    root from forward to backward), per microbatch for the blocks when resharding."""
    p = cfg.parallel
    units = _layouts(cfg)
    padded = sum(u.padded for u in units)
    root = sum(u.padded for u in units if u.name == "root")
    if p.zero_stage < 3 or not p.reshard_after_forward:
        gathered = padded
    else:
        gathered = root + 2 * p.microbatches * (padded - root)
    n, elt = p.fsdp, Layout.build(cfg).reduce_dtype.itemsize
    rs, ag = comm["fsdp/reduce_scatter"], comm["fsdp/all_gather"]
    assert rs["bytes"] == elt * padded
    assert ag["bytes"] == elt * gathered
    assert rs["bus_bytes"] == pytest.approx((n - 1) / n * elt * padded, rel=1e-12)
    assert ag["bus_bytes"] == pytest.approx((n - 1) / n * elt * gathered, rel=1e-12)
    if p.dp > 1:  # HSDP: each reduced shard all-reduced across the replicas
        assert comm["replica/all_reduce"]["bytes"] == elt * padded // n
    assert padded - sum(u.numel for u in units) < len(units) * n  # padding < n per unit


def _check(cfg, results: list[dict], ref: dict) -> None:
    """Equivalence with the single process (fp64: to round-off) or close to it (bf16
    compute), memory measured == predicted on every rank, and the comm volume."""
    if cfg.train.dtype == "fp64":
        assert_close_run(results[0], ref)
        _check_comm(cfg, results[0]["comm"])
    else:
        losses = results[0]["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        assert max(abs(a - b) / b for a, b in zip(losses, ref["losses"])) < 0.05
    for rank, r in enumerate(results):
        measured, predicted = r["memory"]
        assert measured == predicted, f"rank {rank}: measured {measured} != {predicted}"


def _check_layouts(reference, layouts: list[dict], per_layout: list[list[dict]]) -> None:
    """Check each layout's run (per rank) against the single-process run of the same
    model, microbatch count and step count."""
    for over, ranks in zip(layouts, per_layout, strict=True):
        cfg = _config(over)
        ref_over = {"parallel": {"microbatches": cfg.parallel.microbatches}, "train": STEPS}
        ref_over.update({k: v for k, v in over.items() if k == "model"})
        ref = reference(**ref_over)
        try:
            _check(cfg, ranks, ref)
        except AssertionError as e:
            raise AssertionError(f"layout {over}: {e}") from e


# 8 steps: a wrong shard, gather or reduction is off from the first step on, and 8
# AdamW steps carry the optimizer state through its warm-up and after
STEPS = {"steps": 8}
BF16 = {"dtype": "bf16", **STEPS}
# dim 18 (3 heads of 6): every unit's size is 2 mod 4, so fsdp=4 pads every shard
PADDED = {"dim": 18, "heads": 3, "kv_heads": 1}

LAYOUTS = {  # test name -> layouts (tiny_config overrides) of one world size
    "fsdp2": [
        {"parallel": {"fsdp": 2, "zero_stage": 1}},
        {"parallel": {"fsdp": 2, "zero_stage": 2}},
        {"parallel": {"fsdp": 2, "zero_stage": 3}},
        {"parallel": {"fsdp": 2, "zero_stage": 3, "microbatches": 2}},
        {"parallel": {"fsdp": 2, "zero_stage": 2, "microbatches": 2}},
        {"parallel": {"fsdp": 2, "zero_stage": 3, "microbatches": 2,
                      "reshard_after_forward": False}},
        {"parallel": {"fsdp": 2, "zero_stage": 1, "reduce_dtype": "bf16"}, "train": BF16},
        {"parallel": {"fsdp": 2, "zero_stage": 3}, "train": BF16},
    ],
    "fsdp4": [
        {"parallel": {"fsdp": 4, "zero_stage": 1}},
        {"parallel": {"fsdp": 4, "zero_stage": 2}},
        {"parallel": {"fsdp": 4, "zero_stage": 3}},
        {"parallel": {"fsdp": 4, "zero_stage": 1}, "model": PADDED},
        {"parallel": {"fsdp": 4, "zero_stage": 3}, "model": PADDED},
    ],
    "hsdp": [
        {"parallel": {"dp": 2, "fsdp": 2, "zero_stage": 3}},
        {"parallel": {"dp": 2, "fsdp": 2, "zero_stage": 3, "microbatches": 2}},
        {"parallel": {"dp": 2, "fsdp": 2, "zero_stage": 1}},
        {"parallel": {"fsdp": 2, "tp": 2, "zero_stage": 3}},
        {"parallel": {"fsdp": 2, "pp": 2, "zero_stage": 3, "microbatches": 2}},
    ],
}  # fmt: skip

# dp × fsdp × tp × pp = 2×2×2×2 on 16 ranks: ZeRO-3 under zb-h1 with SP, the split
# backward through every layer type (1F1B meets four axes in test_cp's 16-rank run)
PAR_4D = {"dp": 2, "fsdp": 2, "tp": 2, "pp": 2, "zero_stage": 3, "microbatches": 2}
ZB_4D = {**PAR_4D, "pp_schedule": "zb-h1", "sp": True}
# bf16 through fsdp × tp × pp (ZeRO-3, 1F1B) on 8 ranks
BF16_3D = {"fsdp": 2, "tp": 2, "pp": 2, "zero_stage": 3, "microbatches": 2}


def _config(over: dict):
    """tiny_config of a layout's overrides, at the module's step count."""
    return tiny_config(**{**over, "train": STEPS | over.get("train", {})})


def declare_jobs(jobs: Jobs) -> None:
    """Every layout of this module (2, 4 and 16 ranks), each trained by `_run`."""
    for name, layouts in LAYOUTS.items():
        cfgs = [_config(over) for over in layouts]
        world = cfgs[0].parallel.world
        jobs.add(name, world, _run, [c.to_dict() for c in cfgs])
    jobs.add("4d", 16, _run, [tiny_config(parallel=ZB_4D, train=STEPS).to_dict()])
    jobs.add("3d-bf16", 8, _run, [tiny_config(parallel=BF16_3D, train={"dtype": "bf16"}).to_dict()])


def _per_layout(per_rank: list[list[dict]]) -> list[list[dict]]:
    return [list(ranks) for ranks in zip(*per_rank)]


def test_zero_fsdp2_every_stage(reference, jobs):
    _check_layouts(reference, LAYOUTS["fsdp2"], _per_layout(jobs["fsdp2"]))


def test_zero_fsdp4_every_stage_and_padding(reference, jobs):
    _check_layouts(reference, LAYOUTS["fsdp4"], _per_layout(jobs["fsdp4"]))


def test_hsdp_and_fsdp_with_tp_and_pp(reference, jobs):
    _check_layouts(reference, LAYOUTS["hsdp"], _per_layout(jobs["hsdp"]))


def test_4d_dp_fsdp_tp_pp(reference, jobs):
    """dp × fsdp × tp × pp = 2×2×2×2 on 16 ranks, ZeRO-3 under zb-h1 with SP: equal to the
    single process."""
    (run,) = _per_layout(jobs["4d"])
    cfg = tiny_config(parallel=ZB_4D, train=STEPS)
    _check(cfg, run, reference(parallel={"microbatches": 2}, train=STEPS))


def test_bf16_through_fsdp_tp_pp(reference, jobs):
    """fsdp × tp × pp = 2×2×2 on 8 ranks in bf16, ZeRO-3 under 1F1B: within the stated
    tolerance of the bf16 single process (memory_helpers.py)."""
    (run,) = _per_layout(jobs["3d-bf16"])
    check_bf16(BF16_3D, run, reference(train={"dtype": "bf16"}), reference())
