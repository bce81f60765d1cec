"""What keeps a planner search fast without changing its answer: the caches answer as the
uncached functions do, building the meta model imports no compiler, and an MoE search
takes the CPU time and the pricings it does. (The answer itself:
`test_plan_search.py::test_pruned_search_gives_the_unpruned_answer`.)"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import subprocess
import sys
import time

import pytest

from plan_helpers import layout_config
from tetrad.config import model_preset
from tetrad.layout import Layout, ep_fits
from tetrad.mesh import expert_groups
from tetrad.parallel.pipeline.schedules import rank_stages
from tetrad.plan.candidates import (
    candidate,
    first_ep_groups,
    held_stages,
    layout_for,
)
from tetrad.plan.cost import Planner
from tetrad.plan.hardware import cluster_preset
from tetrad.plan.search import search


def test_layout_is_hashable_and_equal_by_value():
    """The planner's caches are keyed by the Layout: two builds of the same values are
    equal and hash alike, its degrees cannot change in place, and it survives pickling."""
    m = model_preset("llama3-8b")
    cfg = layout_config(m, 64, 4096, fsdp=8, tp=2, microbatches=4)
    lay = Layout.build(cfg)
    again = layout_for(m, 64, 4096, fsdp=8, tp=2, microbatches=4)
    assert lay == again and hash(lay) == hash(again) and len({lay, again}) == 1
    assert lay.degrees == {"pp": 1, "dp": 1, "fsdp": 8, "cp": 1, "tp": 2}
    with pytest.raises(TypeError):
        lay.degrees["fsdp"] = 4
    assert pickle.loads(pickle.dumps(lay)) == lay
    assert (lay.global_batch, lay.dtype_name, lay.element_bytes) == (64, "bf16", 2)
    assert lay.kv_heads(m.kv_heads) == m.kv_heads // 2 and not lay.ep_spans_tp


def test_candidate_is_cached_and_follows_its_values():
    """A search's candidate with the same values is the cached Layout; other values (of the
    degrees, the base or the model) get their own, each `Layout.build`'s."""
    m = model_preset("llama3-8b")
    base = layout_for(m, 64, 4096)
    lay = candidate(base, m, fsdp=8, tp=2, microbatches=4)
    assert candidate(base, m, tp=2, fsdp=8, microbatches=4) is lay
    assert lay == layout_for(m, 64, 4096, world=16, fsdp=8, tp=2, microbatches=4)
    assert candidate(base, m, fsdp=4, dp=2, tp=2, microbatches=4).degrees["fsdp"] == 4
    bigger = candidate(layout_for(m, 128, 4096), m, fsdp=8, tp=2, microbatches=4)
    assert bigger.microbatch_size == 128 // (8 * 4)
    with pytest.raises(ValueError):
        candidate(base, m, tp=3)


def test_held_stages_are_rank_stages():
    for pp, v, name in [(4, 1, "1f1b"), (4, 2, "interleaved-1f1b"), (4, 2, "zb-v")]:
        lay = layout_for(model_preset("llama3-8b"), 64, 4096, pp=pp, fsdp=16 // pp,
                         pp_schedule=name, virtual_stages=v, microbatches=4)  # fmt: skip
        for r in range(pp):
            assert list(held_stages(lay, r)) == rank_stages(r, pp, v, name)


def test_meta_model_imports_no_compiler():
    """Building the meta model (every plan does, once) must not import torch._dynamo: it
    was 1.6 s of the 64-GPU search's CPU (nn.Embedding's default init on meta)."""
    code = (
        "import sys\n"
        "from tetrad.config import model_preset\n"
        "from tetrad.models.llama import meta_llama\n"
        "meta_llama(model_preset('small'))\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_first_ep_groups_are_the_mesh_groups():
    """`first_ep_groups` finds by arithmetic the first ep group and the first expert-data
    group that `mesh.expert_groups` lists (within a node's tp, and spanning tp groups)."""
    m, checked = model_preset("qwen3-30b-a3b"), 0
    for dp, fsdp, cp, tp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2), (1, 2, 4)):
        data = dp * fsdp * cp
        for ep in (e for e in (2, 4, 8, 16, 32) if ep_fits(e, data, tp)):
            deg = {"pp": 2, "dp": dp, "fsdp": fsdp, "cp": cp, "tp": tp}
            lay = dataclasses.replace(layout_for(m, 8 * data, 4096), degrees=deg, ep=ep)
            groups, data_groups = expert_groups(deg, ep)
            assert first_ep_groups(lay) == (groups[0], data_groups[0]), (deg, ep)
            checked += lay.ep_spans_tp
    assert checked > 5  # the groups that take whole tp groups among them


def test_moe_search_is_fast():
    """Mixtral 8x7B on 64 H100s (global batch 256 x 4096): about 1.5 s of CPU here after
    the planner's caches and the warm-up floor; the bound leaves room for a loaded
    2-core CI machine. CPU time of this process (`time.process_time`), not wall time,
    so other jobs' load does not count, and a deterministic count besides: the layouts
    fully priced (`Planner.predict`), 46 now, 93 without the warm-up floor, 1,772
    unpruned."""
    planner, priced = Planner(cluster_preset("h100")), [0]
    predict = planner.predict

    def counted(*args, **kwargs):
        priced[0] += 1
        return predict(*args, **kwargs)

    planner.predict = counted  # type: ignore[method-assign]
    lay, m = layout_for(model_preset("mixtral-8x7b"), 256, 4096), model_preset("mixtral-8x7b")
    start = time.process_time()
    best = search(planner, lay, m, 64, top=6)
    seconds = time.process_time() - start
    assert best and best[0].layout["ep"] > 1
    assert priced[0] <= 6 + 60, priced[0]  # the walk's, and the answer's again
    assert seconds < 15, seconds


def test_a_family_counts_are_its_candidates():
    """The walk prices a count's memory on the family's first valid layout with the
    count's microbatches (`search._counts`), validating only counts that could fit: that
    layout is the one `candidate` builds wherever the count is valid (dense and MoE,
    every schedule, counts some of which a schedule refuses); its model facts are the first
    count's, which the walk passes on (`Planner.memory_total`)."""
    from tetrad.plan.search import Space, _counts, families, valid

    checked, planner = 0, Planner(cluster_preset("h100"))
    for name, gpus in (("llama3-8b", 16), ("mixtral-8x7b", 16)):
        m = model_preset(name)
        base = layout_for(m, 64, 4096)
        for family in itertools.islice(families(base, m, gpus, 8, Space()), 0, None, 15):
            built = dict(valid(base, m, family))
            if not built:
                continue
            first = next(iter(built.values()))
            derived = dict(_counts(family, first))
            assert all(derived[k] == lay for k, lay in built.items()), family[0]
            facts = planner.facts(first, m)
            assert all(planner.facts(lay, m) == facts for lay in built.values()), family[0]
            checked += len(built)
    assert checked > 100


def test_memory_shortcuts_answer_as_the_peaks_do():
    """`Footprint.memory` picks the fullest rank from each rank's overhead read off its
    busiest moment's sums (`_RankPeaks.overhead`), building the Peak for that rank
    alone: every rank's overhead is `_overhead` of its Peak, to the byte, and the memory
    is the rank whose total is largest (the first of equals), with its Peak; the
    search's `memory_total` is that total."""
    from tetrad.plan.footprint import _RankPeaks

    m = model_preset("mixtral-8x7b")
    planner = Planner(cluster_preset("h100"))  # one planner: its moments kept across layouts
    for (schedule, v), zero, n in itertools.product(
        [("1f1b", 1), ("zb-v", 2), ("interleaved-1f1b", 2)], (2, 3), (4, 8)
    ):
        lay = layout_for(m, 64, 4096, pp=4, fsdp=4, ep=2, zero_stage=zero, microbatches=n,
                         pp_schedule=schedule, virtual_stages=v)  # fmt: skip
        facts, fp = planner.facts(lay, m), planner.footprint
        peaks, split = _RankPeaks(fp, lay, m), planner.split(lay, m)
        totals = []
        for r in range(lay.pp):
            acts = fp.rank_activations(lay, m, split, planner.order(lay), r)
            for a in (acts, 0.0, 1e12):  # the optimizer step's moment wins at 1e12
                peak = fp.peak(lay, m, r, facts[r], a)  # built afresh
                assert peaks.of(r, facts[r], a) == peak, (schedule, r, a)
                assert peaks.overhead(r, facts[r], a) == fp._overhead(peak, a)
            totals.append(float(facts[r].state.total) + acts + peaks.overhead(r, facts[r], acts))
        memory, fullest = planner.memory(lay, m), totals.index(max(totals))
        assert memory.total == max(totals) == planner.memory_total(lay, m)
        assert memory.peak == peaks.of(fullest, facts[fullest], memory.activations)
