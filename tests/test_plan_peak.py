"""The planner's peak memory against the allocator's, measured on CPU runs of tetrad, and
against torchtitan's published peaks.

How the CPU peak is measured. `peak_mem_bytes` in metrics.jsonl is, on CPU, the process's
peak resident set (ru_maxrss): the interpreter and torch's libraries (hundreds of MiB),
never reset, and monotone over every job a process runs, so no tensor count can predict
it. The CPU counterpart of CUDA's `max_memory_allocated` is read instead from the
profiler's allocator events (every allocation and free of c10's CPU allocator, with its
address): bytes allocated since the trainer was built and still alive, at their highest.
Frees the profiler does not see (a tensor released on a gloo thread) are settled when the
address is handed out again. Repeated runs agree to ~12 KB of 13 MB (0.1%).
"""

from __future__ import annotations

import pytest
import torch

from harness import Jobs, tiny_config
from plan_published import TORCHTITAN_ROWS, torchtitan_case
from tetrad.config import from_dict
from tetrad.mesh import Mesh
from tetrad.plan.cost import Planner
from tetrad.plan.engines import TETRAD
from tetrad.plan.hardware import GiB, cluster_preset

# big enough that the loss chunk, a block's backward and ZeRO's buffers are 5-20% of the
# peak (the test model's are a few KB); 3 steps: the optimizer state exists from step 1
MODEL = {"layers": 2, "dim": 128, "heads": 4, "kv_heads": 2, "vocab": 512}
TRAIN = {"steps": 3, "seq_len": 64, "global_batch": 8}
LAYOUTS = [  # (parallel, train) on 2 ranks
    ({"dp": 2}, {}),
    ({"dp": 2}, {"recompute": "full"}),
    ({"fsdp": 2, "zero_stage": 1}, {}),
    ({"fsdp": 2, "zero_stage": 2}, {}),
    ({"fsdp": 2, "zero_stage": 3}, {}),
    ({"fsdp": 2, "zero_stage": 3, "microbatches": 2}, {}),  # gradients accumulated whole
    ({"tp": 2}, {}),
    ({"tp": 2}, {"dtype": "bf16"}),  # fp32 gradients exist only from the reduction on
    ({"tp": 2, "sp": True}, {}),
    ({"pp": 2, "microbatches": 2, "pp_schedule": "1f1b"}, {}),
    ({"cp": 2}, {}),
]
CFGS = [tiny_config(model=MODEL, train=TRAIN | t, parallel=p) for p, t in LAYOUTS]
PEAK_BOUND = 0.05


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
        mesh = Mesh.build(cfg.parallel.degrees, rank, ep=cfg.parallel.ep)
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
    """dp (and full recompute), ZeRO-1/2/3 (ZeRO-3 with two microbatches too), tp (with
    sp, and in bf16), pp and cp on 2 ranks: the planner's
    allocated peak of the fullest rank (model state + activations + the transients of its
    peak moment) is the measured peak (max over ranks) within 5%, where the steady
    figures alone miss it by more in most layouts (the transients are not noise)."""
    per_rank = jobs["peaks"]
    missed = 0
    for i, (layout, cfg) in enumerate(zip(LAYOUTS, CFGS)):
        measured = max(r[i]["peak"] for r in per_rank)
        steady = max(r[i]["steady"] for r in per_rank)
        mem = Planner(cluster_preset("cpu"), TETRAD, cfg.train.recompute).memory(cfg)
        err = mem.allocated / measured - 1
        assert abs(err) <= PEAK_BOUND, (layout, mem.peak, mem.allocated, measured, f"{err:+.3f}")
        missed += abs(steady / measured - 1) > PEAK_BOUND
    assert missed >= len(LAYOUTS) // 2, "the transients are too small to test"


# torchtitan's published peaks (max over GPUs, reserved): the bound per row, and what the
# model misses where the row is outside 10%
PUBLISHED = {
    "Table1 FSDP": (0.12, "eager: 5.4 GiB more than the compiled run of the same tensors "
                          "(the caching allocator's fragmentation of eager kernels' many "
                          "small temporaries); one stated allocator share for both"),
    "Table1 FSDP+compile": (0.10, ""),
    "Table3 FSDP": (0.10, ""),
    "Table3 FSDP+compile": (0.10, ""),
}  # fmt: skip


def test_peak_against_torchtitan():
    """Peak memory of torchtitan's llama3-8b FSDP runs (8 and 128 H100s, local batch 2,
    seq 8192, unchunked loss, per-op SAC): the planner's peak (at the loss backward:
    log-softmax's gradients, the gathered root and the blocks prefetched, plus workspace
    and allocator share) within 10%, or the row's stated bound and reason."""
    for label, (bound, _why) in PUBLISHED.items():
        r = next(r for r in TORCHTITAN_ROWS if r[0] == label)
        planner, cfg, _ = torchtitan_case(r)
        mem = planner.memory(cfg)
        assert mem.peak.moment == "loss backward", (label, mem.peak)
        got = mem.total / GiB
        assert abs(got / r[-1] - 1) <= bound, (label, got, r[-1])
