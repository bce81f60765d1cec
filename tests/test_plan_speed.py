"""What keeps a planner search fast without changing its answer: the caches answer as the
uncached functions do, and building the meta model imports no compiler. (The answer
itself: `test_plan_search.py::test_pruned_search_gives_the_unpruned_answer`.)"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from tetrad.config import model_preset
from tetrad.layout import Layout
from tetrad.parallel.pipeline.schedules import rank_stages
from tetrad.plan.candidates import candidate, held_stages, layout_config, layout_for


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
