"""The planner's peak memory against the allocator's, measured on CPU runs of tetrad, and
against torchtitan's published peaks.

How the CPU peak is measured. `peak_mem_bytes` in metrics.jsonl is, on CPU, the process's
peak resident set (ru_maxrss): the interpreter and torch's libraries (hundreds of MiB),
never reset, and monotone over every job a process runs, so no tensor count can predict
it. The CPU counterpart of CUDA's `max_memory_allocated` is read instead from the
profiler's allocator events (every allocation and free of c10's CPU allocator, with its
address): bytes allocated since the trainer was built and still alive, at their highest.
Frees the profiler does not see (a tensor released on a gloo thread) are settled when the
address is handed out again. Repeated runs agree to the byte in most layouts; under tp
and ep (gloo's all-to-alls) a rank's peak moves now and then by one or a few 256 KiB
buffers (2-8%: frees made on a gloo thread and missed until their addresses are
reused), so there the measured peak is held to 5% above the prediction and 10% below it.
"""

from __future__ import annotations

import csv
import statistics

import pytest
import torch

from harness import Jobs, reference_csv, tiny_config
from plan_helpers import layout_config, planned
from plan_published import MODELS
from tetrad.config import from_dict
from tetrad.mesh import Mesh
from tetrad.plan.cost import Planner
from tetrad.plan.engines import ENGINES, TETRAD
from tetrad.plan.hardware import GiB, cluster_preset
from tetrad.plan.search import Space, search

# big enough that the loss chunk, a block's backward and ZeRO's buffers are 5-20% of the
# peak (the test model's are a few KB); 2 steps: the second has the optimizer state
MODEL = {"layers": 2, "dim": 128, "heads": 4, "kv_heads": 2, "vocab": 512}
TRAIN = {"steps": 2, "seq_len": 64, "global_batch": 8, "dtype": "fp32"}  # what users run
MOE = {"family": "moe", "experts": 4, "top_k": 2, "moe_ffn_dim": 128, "shared_experts": 1}
# every token to both experts: under ep each rank receives exactly the even share the
# planner counts (a learned router's imbalance is the run's, not the planner's: docs/plan.md)
MOE_EVERY = MOE | {"experts": 2}
LAYOUTS = [  # (parallel, train and model overrides) on 2 ranks
    ({"dp": 2}, {}),
    ({"dp": 2}, {"recompute": "full"}),
    ({"fsdp": 2, "zero_stage": 1}, {}),
    ({"fsdp": 2, "zero_stage": 2}, {}),
    ({"fsdp": 2, "zero_stage": 2, "microbatches": 2}, {}),  # the gradients at the 2nd loss
    ({"fsdp": 2, "zero_stage": 3}, {}),
    ({"fsdp": 2, "zero_stage": 3, "microbatches": 2}, {}),  # gradients accumulated whole
    ({"tp": 2}, {}),
    ({"tp": 2}, {"dtype": "bf16"}),  # fp32 gradients exist only from the reduction on
    ({"tp": 2, "sp": True}, {}),
    ({"pp": 2, "microbatches": 2, "pp_schedule": "1f1b"}, {}),
    ({"cp": 2}, {}),
    ({"dp": 2}, {"model": MOE}),  # a mixture of experts
    ({"dp": 2, "ep": 2}, {"model": MOE_EVERY}),  # its experts over 2 ranks, all-to-all
]
CFGS = [
    tiny_config(model=MODEL | t.get("model", {}),
                train=TRAIN | {k: v for k, v in t.items() if k != "model"}, parallel=p)
    for p, t in LAYOUTS
]  # fmt: skip
PEAK_BOUND = 0.05
MISSED_FREES_BOUND = 0.10  # tp, ep, fsdp: see test_peak_within_5_percent_of_the_measured


def allocator_peak(events) -> int:
    """The most bytes alive at once among allocations in `events` (the profiler's
    allocation events in time order: (address, +bytes) or (address, -bytes))."""
    live: dict[int, int] = {}
    now = peak = 0
    for ptr, size in events:
        if size > 0:
            now += size - live.get(ptr, 0)  # a reused address: its free went unseen
            live[ptr] = size
            peak = max(peak, now)
        elif ptr in live:
            now -= live.pop(ptr)
    return peak


def _allocations(prof) -> list[tuple[int, int]]:
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            out.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return [(ptr, size) for _, ptr, size in sorted(out)]


def train_and_peak(rank: int, world: int, raws: list[dict]) -> list[dict]:
    """Each config trained from a fresh trainer under the profiler's allocator events:
    the measured peak, and the measured model state and saved activations."""
    from torch.profiler import ProfilerActivity, profile

    from tetrad.train.loop import Trainer

    out = []
    for raw in raws:
        cfg = from_dict(raw)
        mesh = Mesh.build(cfg.parallel, rank)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer = Trainer(cfg, mesh, torch.device("cpu"))
            trainer.fit()
        steady = trainer.measured_state[-1].total + trainer.engine.last_run.peak_activation_bytes
        out.append({"peak": allocator_peak(_allocations(prof)), "steady": steady})
    return out


def declare_jobs(jobs: Jobs) -> None:
    jobs.add("peaks", 2, train_and_peak, [c.to_dict() for c in CFGS])


def test_allocator_peak_counts_what_is_alive_at_once():
    """The meter: the highest sum of live allocations; a reused address settles the free
    the profiler missed."""
    assert allocator_peak([(1, 10), (2, 5), (1, -10), (3, 7), (2, -5)]) == 15
    assert allocator_peak([(1, 4), (1, 10), (2, 3)]) == 13  # not 17


@pytest.mark.distributed
def test_peak_within_5_percent_of_the_measured(jobs):
    """dp (and full recompute, and a mixture of experts, at ep 2 too), ZeRO-1/2/3 (ZeRO-2
    and 3 with two microbatches too), tp (with sp, and in bf16), pp and cp on 2 ranks: the planner's
    allocated peak of the fullest rank (model state + activations + the transients of its
    peak moment) is the measured peak (max over ranks) within 5%, where the steady
    figures alone miss it by more in most layouts (the transients are not noise)."""
    per_rank = jobs["peaks"]
    missed = 0
    for i, (layout, cfg) in enumerate(zip(LAYOUTS, CFGS)):
        measured = max(r[i]["peak"] for r in per_rank)
        steady = max(r[i]["steady"] for r in per_rank)
        mem = Planner(cluster_preset("cpu"), TETRAD, cfg.train.recompute).memory(*planned(cfg))
        err = mem.allocated / measured - 1
        # where a collective allocates its output (tp, ep's all-to-alls, ZeRO's gathers and
        # reduce-scatters) the last reference to it can drop on a gloo thread, a free the
        # profiler does not see until the address is reused, so the measured peak can only
        # be too high (by ~1 MiB seen once under tp; ep's rows by one or two 256 KiB
        # buffers; ZeRO-1 by 0.7 MiB once, on a loaded machine): the prediction is held to
        # 5% above it, and below it to MISSED_FREES_BOUND
        gloo_frees = cfg.parallel.tp > 1 or cfg.parallel.ep > 1 or cfg.parallel.fsdp > 1
        low = MISSED_FREES_BOUND if gloo_frees else PEAK_BOUND
        assert -low <= err <= PEAK_BOUND, (layout, mem.peak, mem.allocated, measured, f"{err:+.3f}")
        missed += abs(steady / measured - 1) > PEAK_BOUND
    assert missed >= len(LAYOUTS) // 2, "the transients are too small to test"


# torchtitan's published peaks (tests/data/torchtitan_bench.csv, max over GPUs): the CSV
# row (table, layout, techniques) and the case (model, fsdp, cp, tp, seq, local batch,
# recompute, engine); every row within MEMORY_BOUND
MIB_ROWS = [
    (("Table1", "FSDP 8", "FSDP"), ("llama3-8b", 8, 1, 1, 8192, 2, "op", "torchtitan")),
    (("Table1", "FSDP 8", "FSDP + torch.compile"),
     ("llama3-8b", 8, 1, 1, 8192, 2, "op", "torchtitan-compile")),
    (("Table3", "FSDP 128", "FSDP"), ("llama3-8b", 128, 1, 1, 8192, 2, "op", "torchtitan")),
    (("Table3", "FSDP 128", "FSDP + torch.compile"),
     ("llama3-8b", 128, 1, 1, 8192, 2, "op", "torchtitan-compile")),
    (("Table2", "FSDP 8, CP 1", "FSDP+CP+compile+Float8"),
     ("llama3-8b", 8, 1, 1, 32768, 1, "full", "torchtitan-compile")),
    (("Table2", "FSDP 4, CP 2", "FSDP+CP+compile+Float8"),
     ("llama3-8b", 4, 2, 1, 65536, 1, "full", "torchtitan-compile")),
    (("Table2", "FSDP 2, CP 4", "FSDP+CP+compile+Float8"),
     ("llama3-8b", 2, 4, 1, 131072, 1, "full", "torchtitan-compile")),
    (("Table2", "FSDP 1, CP 8", "FSDP+CP+compile+Float8"),
     ("llama3-8b", 1, 8, 1, 262144, 1, "full", "torchtitan-compile")),
    (("Table4", "FSDP 32, TP 8", "2D + compile + Float8"),
     ("llama3-70b", 32, 1, 8, 8192, 16, "full", "torchtitan-compile")),
    (("Table4", "FSDP 32, TP 8", "2D + AsyncTP + compile + Float8"),
     ("llama3-70b", 32, 1, 8, 8192, 16, "full", "torchtitan-async-tp")),
]  # fmt: skip
MEMORY_BOUND = 0.10


def published_peak(table: str, layout: str, techniques: str) -> float:
    """peak_memory_GiB of the torchtitan_bench.csv row."""
    with open(reference_csv("torchtitan_bench.csv"), newline="") as f:
        for row in csv.DictReader(f):
            if (row["table"], row["layout"], row["techniques"]) == (table, layout, techniques):
                return float(row["peak_memory_GiB"])
    raise KeyError((table, layout, techniques))


def titan_memory(model, fsdp, cp, tp, seq, local, recompute, engine):
    cfg = layout_config(MODELS[model], local * fsdp, seq, fsdp=fsdp, cp=cp, tp=tp, sp=tp > 1)
    return Planner(cluster_preset("h100-hbm2e"), ENGINES[engine], recompute).memory(*planned(cfg))


def test_peak_against_torchtitan():
    """torchtitan's llama3-8b runs (FSDP on 8 and 128 H100s with per-op SAC, eager and
    compiled; FSDP x CP at 32K-256K with full recompute, fsdp 1 x cp 8 included) and its
    llama3-70b run at fsdp 32 x tp 8 (full recompute, with and without async TP): the
    planner's peak (at the loss backward: the eager loss's fp32 tensors, the freed bf16
    logits' space, the gathered root and the blocks prefetched, with workspace and
    allocator share) within 10% of each published peak."""
    for key, case in MIB_ROWS:
        mem = titan_memory(*case)
        assert mem.peak.moment == "loss backward", (key, mem.peak)
        got, published = mem.total / GiB, published_peak(*key)
        assert abs(got / published - 1) <= MEMORY_BOUND, (key, got, published)


def test_eager_loss_terms_are_what_closes_the_published_peaks():
    """The two eager-loss terms are what brings the rows in: without them (the engine's
    loss modelled as a fused one) the 8B FSDP eager row is 11% under its published peak
    and the 70B 2D row 22% under; under tp the loss_parallel backward holds three fp32
    N·V/t tensors beside the saved log-probabilities (12·N·V/t, the 8B rows' plain
    cross-entropy 8·N·V/t), and at every row the freed bf16 logits (2·N·V/t) stay
    reserved, not allocated."""
    import dataclasses

    from tetrad.plan.peak import eager_loss_backward, eager_loss_hole

    for key, case, miss in [(MIB_ROWS[0][0], MIB_ROWS[0][1], 0.10),
                            (MIB_ROWS[8][0], MIB_ROWS[8][1], 0.20)]:  # fmt: skip
        model, fsdp, cp, tp, seq, local, recompute, engine = case
        cfg = layout_config(MODELS[model], local * fsdp, seq, fsdp=fsdp, cp=cp, tp=tp, sp=tp > 1)
        plain = dataclasses.replace(ENGINES[engine], eager_loss=False)
        without = Planner(cluster_preset("h100-hbm2e"), plain, recompute).memory(*planned(cfg))
        with_ = titan_memory(*case)
        assert without.total / GiB < (1 - miss) * published_peak(*key), key
        n_v = local * seq // cp * MODELS[model].vocab / tp  # logits of the rank, elements
        assert eager_loss_backward(*planned(cfg)) == (12 if tp > 1 else 8) * n_v
        assert eager_loss_hole(*planned(cfg)) == 2 * n_v
        assert dict(with_.peak.reserved) == {"freed logits' space": 2 * n_v}
        assert with_.allocated - without.allocated == pytest.approx((4 if tp > 1 else 0) * n_v)


def test_eager_loss_terms_hold_on_the_rows_they_were_not_developed_on():
    """Out of sample: the eight published peaks other than the two the eager-loss terms
    were developed on (Table1 FSDP eager, Table4 2D) are within 10% with the terms, and
    their median |error| falls (from 9% without them to under 1%)."""
    import dataclasses

    held = [row for i, row in enumerate(MIB_ROWS) if i not in (0, 8)]
    errors = {True: [], False: []}
    for key, case in held:
        model, fsdp, cp, tp, seq, local, recompute, engine = case
        cfg = layout_config(MODELS[model], local * fsdp, seq, fsdp=fsdp, cp=cp, tp=tp, sp=tp > 1)
        for eager in (True, False):
            eng = dataclasses.replace(ENGINES[engine], eager_loss=eager)
            mem = Planner(cluster_preset("h100-hbm2e"), eng, recompute).memory(*planned(cfg))
            errors[eager].append(abs(mem.total / GiB / published_peak(*key) - 1))
    assert max(errors[True]) <= MEMORY_BOUND
    assert statistics.median(errors[True]) < 0.01 < 0.05 < statistics.median(errors[False])


# torchtitan's Llama 3.1 405B pipeline rows (Tables 5 and 6: tp 8, pp 8, full recompute,
# compile, Float8, async TP; torchtitan's default microbatches, one per stage): the CSV
# key and (seq, fsdp, cp, local batch, schedule, virtual stages, microbatches)
PIPELINE_ROWS = [
    (("Table5", "FSDP 8, TP 8, PP 8", "3D+compile+Float8+AsyncTP, 1F1B"),
     (8192, 8, 1, 32, "1f1b", 1, 8)),
    (("Table5", "FSDP 8, TP 8, PP 8", "3D+compile+Float8+AsyncTP, Interleaved 1F1B"),
     (8192, 8, 1, 32, "interleaved-1f1b", 2, 16)),
    (("Table6", "FSDP 8, CP 1, TP 8, PP 8", "4D+compile+Float8+AsyncTP+1F1B"),
     (32768, 8, 1, 8, "1f1b", 1, 8)),
    (("Table6", "FSDP 4, CP 2, TP 8, PP 8", "4D+compile+Float8+AsyncTP+1F1B"),
     (65536, 4, 2, 8, "1f1b", 1, 8)),
    (("Table6", "FSDP 2, CP 4, TP 8, PP 8", "4D+compile+Float8+AsyncTP+1F1B"),
     (131072, 2, 4, 8, "1f1b", 1, 8)),
    (("Table6", "FSDP 1, CP 8, TP 8, PP 8", "4D+compile+Float8+AsyncTP+1F1B"),
     (262144, 1, 8, 8, "1f1b", 1, 8)),
]  # fmt: skip
PIPELINE_BOUND = 0.20  # Float8's casts and fragmentation not modelled: all predicted under


def test_torchtitan_pipeline_rows_hold_fsdp_unsharded():
    """The 405B pipeline rows, which no term was fitted to: within 20% (all under) once
    FSDP2 under torch's pipelining keeps the stage's weights gathered and its gradients
    whole in fp32 to the last backward (`pp_no_sync`); priced as sharded FSDP they were
    52-62% under."""
    import dataclasses

    for key, (seq, fsdp, cp, local, schedule, v, m) in PIPELINE_ROWS:
        cfg = layout_config(MODELS["llama3-405b"], local * fsdp, seq, fsdp=fsdp, tp=8, pp=8, cp=cp,
                            sp=True, microbatches=m, pp_schedule=schedule,
                            virtual_stages=v)  # fmt: skip
        published = published_peak(*key)
        for no_sync in (True, False):
            eng = dataclasses.replace(ENGINES["torchtitan-async-tp"], pp_no_sync=no_sync)
            mem = Planner(cluster_preset("h100-hbm2e"), eng, "full").memory(*planned(cfg))
            error = mem.total / GiB / published - 1
            if no_sync:
                assert -PIPELINE_BOUND <= error < 0, (key, error)
            else:
                assert error < -0.5, (key, error)


def test_torchtitan_shards_the_state_over_cp_at_fsdp_1():
    """torchtitan's FSDP mesh is dp_shard x cp: at fsdp 1 x cp 8 the state is sharded 8
    ways, as at fsdp 8 (the same per-rank state, ZeRO-3's gathered blocks at the peak);
    tetrad's engine shards over fsdp alone, so the same layout holds the whole state."""
    cp8 = titan_memory("llama3-8b", 1, 8, 1, 262144, 1, "full", "torchtitan-compile")
    fsdp8 = titan_memory("llama3-8b", 8, 1, 1, 32768, 1, "full", "torchtitan-compile")
    assert cp8.model_state == fsdp8.model_state < 20 * GiB
    assert dict(cp8.peak.terms)["ZeRO-3 gathered parameters"] > 0
    cfg = layout_config(MODELS["llama3-8b"], 1, 262144, fsdp=1, cp=8)
    whole = Planner(cluster_preset("h100-hbm2e"), TETRAD, "full").memory(*planned(cfg))
    assert whole.model_state > 100 * GiB and "ZeRO-3 gathered parameters" not in dict(
        whole.peak.terms
    )


def _capped(cluster, capacity: float):
    """`cluster` with devices of `capacity` bytes."""
    import dataclasses

    return dataclasses.replace(
        cluster, device=dataclasses.replace(cluster.device, hbm_bytes=capacity)
    )


def test_search_refuses_a_layout_whose_peak_does_not_fit():
    """A layout that would fit without its peak's transients (state, activations,
    workspace and allocator share) but not with them is never proposed; with room for
    its peak it is."""
    from tetrad.plan.footprint import ALLOCATOR

    cfg = CFGS[0]  # dp 2: its peak is at the loss backward, 1.1 MiB of transients
    cpu = cluster_preset("cpu")
    mem = Planner(cpu, TETRAD).memory(*planned(cfg))
    steady = mem.model_state + mem.activations
    without = steady + cpu.device.workspace_bytes + ALLOCATOR * mem.activations
    assert mem.peak.transient > 1e6 and without < mem.total
    space = Space(dp=2, fsdp=1, tp=1, pp=1, cp=1, ep=1, microbatches=1)
    tight = Planner(_capped(cpu, (without + mem.total) / 2), TETRAD)
    assert search(tight, *planned(cfg), 2, space, top=3) == []
    roomy = Planner(_capped(cpu, mem.total * 1.001), TETRAD)
    found = search(roomy, *planned(cfg), 2, space, top=3)
    assert [p.memory.total for p in found] == [pytest.approx(mem.total)]
