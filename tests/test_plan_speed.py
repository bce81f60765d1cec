"""What keeps a planner search fast without changing its answer: the caches answer as the
uncached functions do, and building the meta model imports no compiler. (The answer
itself: `test_plan_search.py::test_pruned_search_gives_the_unpruned_answer`.)"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

from tetrad.config import model_preset
from tetrad.layout import Layout
from tetrad.parallel.pipeline.schedules import rank_stages
from tetrad.plan.layouts import held_stages, layout_config, layout_of


def test_layout_of_is_cached_by_value_and_follows_changes():
    """A config with the same values gets the cached layout; a changed config (even the
    same object, changed in place) gets its own, never a stale one."""
    cfg = layout_config(model_preset("llama3-8b"), 64, 4096, fsdp=8, tp=2, microbatches=4)
    lay = layout_of(cfg)
    assert lay == Layout.build(cfg)
    assert layout_of(copy.deepcopy(cfg)) is lay
    cfg.parallel = dataclasses.replace(cfg.parallel, fsdp=4, dp=2)
    assert layout_of(cfg).degrees["fsdp"] == 4 and layout_of(cfg) == Layout.build(cfg)
    cfg.train.global_batch = 128  # a nested field changed in place
    assert layout_of(cfg).microbatch_size == 128 // (8 * 4)


def test_held_stages_are_rank_stages():
    for pp, v, name in [(4, 1, "1f1b"), (4, 2, "interleaved-1f1b"), (4, 2, "zb-v")]:
        cfg = layout_config(model_preset("llama3-8b"), 64, 4096, pp=pp, fsdp=16 // pp,
                            pp_schedule=name, virtual_stages=v, microbatches=4)  # fmt: skip
        for r in range(pp):
            assert list(held_stages(cfg, r)) == rank_stages(r, pp, v, name)


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
