"""Zero-bubble schedules composed with ZeRO, HSDP, TP (+SP) and tied embeddings reproduce
the single process; their W actions do the weight-gradient work for every layer type;
and each stage's reductions start before the schedule ends."""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, assert_close_run, tiny_config, trainer_for

pytestmark = pytest.mark.distributed

MODEL = {"layers": 4}
TIED = {**MODEL, "tie_embeddings": True}
KV1 = {**MODEL, "kv_heads": 1}  # kv_heads < tp: the gathered kv projection
# 8 steps: a schedule that moves, sums or applies a gradient wrongly is off from the first
# step on, and 8 AdamW steps carry the optimizer state through its warm-up and after
TRAIN = {"global_batch": 24, "steps": 8}


def _cfg(schedule: str, model=MODEL, **par):
    v = 2 if schedule == "zb-v" else 1
    base = {"pp": 2, "pp_schedule": schedule, "microbatches": 4, "virtual_stages": v}
    return tiny_config(model=model, train=TRAIN, parallel={**base, **par})


# Each case once: zb-h1 with ZeRO-3, tp 2 and sp (kv_heads 2) is test_fsdp's 16-rank run
# (dp × fsdp × tp × pp), and the tied embedding under 1F1B test_pp's.
ZERO = [  # (model, layout): fsdp 2 x pp 2
    (MODEL, {"schedule": "zb-v", "fsdp": 2, "zero_stage": 3}),
    (MODEL, {"schedule": "zb-h1", "fsdp": 2, "zero_stage": 1}),
    (MODEL, {"schedule": "zb-v", "fsdp": 2, "zero_stage": 2}),
    (TIED, {"schedule": "zb-h1", "fsdp": 2, "zero_stage": 3}),
    (TIED, {"schedule": "zb-v", "fsdp": 2, "zero_stage": 3}),
]
TP = [  # tp 2 x pp 2
    (MODEL, {"schedule": "zb-v", "tp": 2}),
    (KV1, {"schedule": "zb-h1", "tp": 2, "sp": True}),
]
HSDP = [  # 8 ranks
    (MODEL, {"schedule": "zb-v", "fsdp": 2, "tp": 2, "zero_stage": 3}),
    # 4 data ranks: 3 microbatches of 2 sequences each
    (MODEL, {"schedule": "zb-v", "dp": 2, "fsdp": 2, "zero_stage": 3, "microbatches": 3}),
    (TIED, {"schedule": "zb-h1", "dp": 2, "fsdp": 2, "zero_stage": 1, "microbatches": 3}),
]


def _w_configs():
    cfgs = [_cfg("zb-h1", model=KV1, tp=2, sp=True), _cfg("zb-h1", model=MODEL, dp=2)]
    for c in cfgs:
        c.train.loss_chunk = 0
    return cfgs


def declare_jobs(jobs: Jobs) -> None:
    """The equivalence runs (4 and 8 ranks), and the W and launch probes (4)."""
    for name, cases in (("zero", ZERO), ("tp", TP), ("hsdp", HSDP)):
        jobs.add_training(name, [_cfg(model=model, **par) for model, par in cases])
    jobs.add("w-work", 4, _w_work, [c.to_dict() for c in _w_configs()])
    launches = [_cfg("zb-v", fsdp=2, zero_stage=3), _cfg("1f1b", dp=2)]
    jobs.add("launches", 4, _launches, [c.to_dict() for c in launches])


def _check_all(reference, cases: list[tuple[dict, dict]], runs: list[dict]) -> None:
    """Each of the (model, parallel) cases' runs equals the single process of its model
    accumulating the same 4 microbatches (so that the round-off compared is what the
    layout adds, not a different accumulation: with the tied embedding, 20 steps of one
    whole-batch single process leave an attention weight 1.2e-5 away, norm-wise, from
    every pipelined layout, fsdp 1 or 2, while against the 4-microbatch one the pipeline
    alone is 2e-7 and fsdp 2 x pp 2 4e-6)."""
    for (model, par), got in zip(cases, runs, strict=True):
        try:
            ref = reference(model=model, train=TRAIN, parallel={"microbatches": 4})
            assert_close_run(got, ref)
        except AssertionError as e:
            raise AssertionError(f"model {model}, layout {par}: {e}") from None


def test_zero_with_zero_bubble_and_tied_embeddings(reference, jobs):
    """fsdp 2 × pp 2: ZeRO-1/2/3 under zb-h1 and zb-v, the embedding tied across the
    pipeline's ends (summed before the scatter) and on one rank (zb-v's V)."""
    _check_all(reference, ZERO, jobs["zero"][0])


def test_tp_with_zero_bubble(reference, jobs):
    """tp 2 × pp 2: column, row, head and the gathered kv projection split into B and W."""
    _check_all(reference, TP, jobs["tp"][0])


def test_hsdp_fsdp_tp_with_zero_bubble(reference, jobs):
    """8 ranks: fsdp × tp × pp under zb-v, and HSDP (dp × fsdp) × pp, ZeRO-3 and ZeRO-1."""
    _check_all(reference, HSDP, jobs["hsdp"][0])


# --- what W does ---------------------------------------------------------------------------


def _w_work(rank: int, world: int, raws: list[dict]) -> list[dict]:
    """Per config: which deferred weights' gradients changed during B and during W of
    one step (by layer type), and the FLOPs W counted."""
    from tetrad.config import from_dict
    from tetrad.parallel.pipeline.weightgrad import Deferrable, DeferredLinear

    out = []
    for raw in raws:
        trainer = trainer_for(from_dict(raw), rank)
        runtime = trainer.engine.runner
        kinds = (DeferredLinear, Deferrable)
        layers = {n: m for n, m in trainer.engine.model.named_modules() if isinstance(m, kinds)}
        changed: dict[str, set[str]] = {"B": set(), "W": set()}
        compute = runtime._compute

        def timed(st, a, compute=compute, layers=layers, changed=changed):
            before = {n: _grad(m) for n, m in layers.items()}
            compute(st, a)
            for n, m in layers.items():
                if a.kind in changed and not torch.equal(before[n], _grad(m)):
                    changed[a.kind].add(type(m).__name__)

        runtime._compute = timed
        trainer.train_step()
        out.append({k: sorted(v) for k, v in changed.items()} | {"flops": runtime.store.flops})
    return out


def _grad(module) -> torch.Tensor:
    g = module.weight.grad
    return torch.zeros_like(module.weight) if g is None else g.detach().clone()


def test_w_actions_do_the_weight_work_of_every_layer_type(jobs):
    """zb-h1 at pp 2: with tp 2 (+SP, kv_heads < tp) the column, row, vocabulary head and
    gathered kv layers, and with dp 2 the plain linears, get their weight gradients in W
    and never in B. (Full logits: the fused chunked loss makes the head's weight gradient
    in B, from its per-chunk recomputation.)"""
    runs = jobs["w-work"]
    expected = [
        {"ColumnParallelLinear", "RowParallelLinear", "ReplicatedKVLinear", "VocabParallelHead"},
        {"DeferredLinear"},
    ]
    for i, want in enumerate(expected):
        ranks = [runs[r][i] for r in range(4)]
        assert set().union(*(r["W"] for r in ranks)) == want, ranks
        assert all(not r["B"] for r in ranks), ranks  # B leaves every weight gradient to W
        assert all(r["flops"] > 0 for r in ranks), ranks


# --- reductions inside the pipeline ---------------------------------------------------------


def _launches(rank: int, world: int, raws: list[dict]) -> list[dict]:
    """Per config, one step: the compute events and the async collectives on this rank."""
    from tetrad.config import from_dict

    out = []
    for raw in raws:
        trainer = trainer_for(from_dict(raw), rank)
        trainer.train_step()
        run = trainer.engine.last_run
        comp = [(e.kind, e.start, e.end) for e in run.events]
        flights = [(f.op, f.group, f.start, f.end) for f in run.flights]
        out.append({"compute": comp, "flights": flights})
    return out


def test_reductions_launch_inside_the_schedule(jobs):
    """A stage's reductions are in flight before its rank's schedule is over: zb-v's
    later chunk reduce-scatters (ZeRO) before the rank's last action starts; 1F1B's dp
    buckets all-reduce during the rank's last backward (launched by autograd's hooks)."""
    for rank, (zbv, onef) in enumerate(jobs["launches"]):
        last_start = zbv["compute"][-1][1]
        scatters = [f for f in zbv["flights"] if f[0] == "reduce_scatter" and f[1] == "fsdp"]
        assert scatters and min(f[2] for f in scatters) < last_start, (rank, zbv)
        assert all(f[3] is not None for f in zbv["flights"]), "every flight completes"
        last_end = onef["compute"][-1][2]
        reduces = [f for f in onef["flights"] if f[0] == "all_reduce" and f[1] == "data"]
        assert reduces and min(f[2] for f in reduces) < last_end, (rank, onef)
