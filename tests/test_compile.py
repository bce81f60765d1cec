"""`--compile`: every layout with compiled blocks (inductor) computes what the eager single
process does, compiles once (no recompilation after the first step, across steps and
microbatches), and a restart loads the compiled blocks from the cache on disk.

Bound: fp64 runs at EXACT (1e-10). Inductor fuses and reorders a block's float64 sums,
which moves results by float64 round-off only, as a layout's regrouping does; the float32
rotary tables (float32 even in an fp64 model) would differ by float32 ulps through
inductor's own pow/cos/sin, so they are an opaque op computed by ATen's kernels
(`models/llama.rotary_at`). bf16 is held to its own rounding (`check_rounded`).

One world of 2 ranks runs every layout with inductor, all ranks sharing one inductor cache
directory, so a graph that two layouts (or two ranks) share compiles once: dp, ZeRO-3 and
pp 1F1B share one block graph, the layouts that run the chunked loss one head + loss
graph. Inductor's C++ compilation is most of this file's time (about 0.8 s of CPU a
kernel, a block's forward and backward 13 kernels; the layouts whose blocks break around
eager parts compile their pieces' kernels: docs/compile.md, "graph breaks"), so the ranks
take turns to compile (`_compiling_with`) and the other reads the cache. The runs whose
bounds rest on rounding (bf16, FP8) are test_compile_rounding.py's, so the pass on SSE4.2
kernels reruns them alone. The head with the chunked loss compiles whole, once, where tp
does not split the vocabulary (here in chunks of 8 tokens); dp, ZeRO-3 and 1F1B run full
logits."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch

from harness import Jobs, assert_close_run, tiny_config, trainer_for
from tetrad.config import from_dict
from tetrad.layout import Layout
from tetrad.train.metrics import CompileCost

pytestmark = pytest.mark.distributed

MOE = {"family": "moe", "experts": 4, "top_k": 2, "moe_ffn_dim": 32, "shared_experts": 1}
# graphs rank 0 compiles: a block's whole body is one graph, which every block shares (full
# recomputation: its forward without grad and its rerun with it); ZeRO-3's hooks stay
# outside it (one traced into the body gave each block a graph of its own, and past
# dynamo's recompile limit of 8 blocks, eager ones). Where a block breaks around eager
# parts (docs/compile.md, "graph breaks"), each piece between two breaks is a graph: tp +
# sp's collectives, zero-bubble's deferred matmuls, cp's attention, the MoE dispatch. The
# head with the chunked loss is one graph more on the rank that holds it (a pipeline's
# last: rank 1), unless tp splits the vocabulary (then eager)
GRAPHS = {
    "dp2": 1, "dp2-full": 3, "fsdp2-zero3": 1, "tp2-sp": 7, "pp2-1f1b": 1, "pp2-zb-h1": 6,
    "cp2-ring": 5, "moe-ep2": 6,
}  # fmt: skip
LOSS_RANK = {"pp2-1f1b": 1, "pp2-zb-h1": 1}
# name -> (model, parallel, train overrides). A graph that two layouts share is compiled
# once (inductor's cache, one for every rank and layout), so the shapes are shared where
# the layout lets them be: a block's input [2, 16, 32] (dp's, ZeRO-3's and pp's block
# graph is one); the chunked loss in chunks of 8 tokens (one head + loss graph) where a
# layout computes it, else full logits (`FULL`)
FULL, CHUNKED = {"loss_chunk": 0}, {"loss_chunk": 8}
LAYOUTS = {
    "dp2": ({}, {"dp": 2, "microbatches": 2}, FULL),
    "dp2-full": ({}, {"dp": 2, "microbatches": 2}, {"recompute": "full", **CHUNKED}),
    "fsdp2-zero3": ({}, {"fsdp": 2, "zero_stage": 3, "microbatches": 2}, FULL),
    "tp2-sp": ({}, {"tp": 2, "sp": True}, {}),
    "pp2-1f1b": ({}, {"pp": 2, "microbatches": 4, "pp_schedule": "1f1b"}, FULL),
    "pp2-zb-h1": ({}, {"pp": 2, "microbatches": 4, "pp_schedule": "zb-h1"}, CHUNKED),
    "cp2-ring": ({}, {"cp": 2, "cp_attention": "ring"}, CHUNKED),
    "moe-ep2": (MOE, {"dp": 2, "ep": 2, "microbatches": 2}, CHUNKED),
}


# 8 steps unless a layout says: past the first step, which compiles, 7 more (of 1 to 4
# microbatches each) with no recompilation
STEPS = 8


def _config(model: dict, par: dict, train: dict, compiled: bool = True):
    return tiny_config(
        model=model, parallel=par, train={"steps": STEPS, **train, "compile": compiled}
    )


def _train_compiled(
    rank: int, world: int, runs: list[tuple[dict, str]], out: str, restart: bool = True
) -> list[dict]:
    """Each (config, backend) trained with its blocks compiled, its metrics rows kept;
    then (`restart`) the first one again after dynamo forgets every compiled frame: a
    restart, reading the compiled graphs back from OUT/compile_cache (every config's `out`)."""
    with _vector_isa_assumed():
        return _train_each(rank, runs, out, restart)


def _train_each(rank: int, runs: list[tuple[dict, str]], out: str, restart: bool) -> list[dict]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from tetrad.models.loss import linear_cross_entropy

    results = []
    for raw, backend in runs:
        torch._dynamo.reset()  # each layout traces its own blocks (inductor's cache kept)
        counters.clear()
        t0 = time.perf_counter()
        cfg = from_dict(raw | {"train": {**raw["train"], "out": out}})
        with _compiling_with(backend, Path(out) / "compile.lock"):
            trainer = trainer_for(cfg, rank)  # its blocks compiled with `backend`
            rows = trainer.fit()
        results.append(
            {
                "losses": [r["loss"] for r in rows],
                "grad_norms": [r["grad_norm"] for r in rows],
                "recompiles": [r["recompiles"] for r in rows],
                "compile_s": [r["compile_s"] for r in rows],
                "graphs": counters["stats"]["unique_graphs"],
                # the chunked loss's compiled entries (0: eager; 1: compiled, once)
                "loss_compiled": len(_debug_get_cache_entry_list(linear_cross_entropy.__code__)),
                "state": trainer.engine.full_state_dict(),
                "seconds": time.perf_counter() - t0,
            }
        )
    if not restart:
        return results
    torch._dynamo.reset()
    counters.clear()
    raw = runs[0][0] | {"train": {**runs[0][0]["train"], "out": out, "steps": 1}}
    trainer_for(from_dict(raw), rank).fit()
    results.append(dict(counters["inductor"]))
    return results


def _vector_isa_assumed():
    """Inductor takes the CPU's vector instructions (its cpuinfo flags) as the compiler's,
    where it would first compile a probe for each (6 g++ calls, about 8 s of CPU, before
    the first kernel): the same kernels, for the test's time. A compiler without them
    fails the first kernel's compilation, loudly."""
    from torch._inductor import config as inductor_config

    return mock.patch.object(inductor_config.cpp, "vec_isa_ok", True)


@contextlib.contextmanager
def _compiling_with(backend: str, lock: Path):
    """`torch.compile` with `backend`; inductor's compilations one rank at a time (a file
    lock): a graph that another rank compiled is then read from the shared cache, where
    both ranks would lower it at once (their C++ kernels are compiled once either way,
    under inductor's own lock, but each rank lowers the graph itself: 1 to 2 s of CPU a
    graph). The backward is compiled with the forward, inside the lock."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx
    from torch.utils._filelock import FileLock

    def inductor(gm, inputs):
        with FileLock(str(lock)):
            return compile_fx(gm, inputs)

    compiler = inductor if backend == "inductor" else backend
    with (
        mock.patch.object(torch, "compile", partial(torch.compile, backend=compiler)),
        mock.patch.object(functorch_config, "force_non_lazy_backward_lowering", True),
    ):
        yield


def declare_jobs(jobs: Jobs) -> None:
    runs = [(_config(*c).to_dict(), "inductor") for c in LAYOUTS.values()]
    jobs.add("compiled", 2, _train_compiled, runs, str(jobs.tmp("run")))


def _got(jobs, index: int) -> dict:
    return jobs["compiled"][0][index]


def _single(reference, model: dict, par: dict, train: dict) -> dict:
    return reference(
        model=model,
        parallel={"microbatches": par.get("microbatches", 1)},
        train={"steps": STEPS, **train},
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_eager_single_process(reference, jobs, name):
    model, par, train = LAYOUTS[name]
    got = _got(jobs, list(LAYOUTS).index(name))
    assert_close_run(got, _single(reference, model, par, train))
    assert got["compile_s"][0] > 0  # compiled: the blocks' graphs were built in step 0
    assert got["recompiles"][1:] == [0] * (len(got["recompiles"]) - 1)
    assert got["graphs"] == GRAPHS[name]
    loss = jobs["compiled"][LOSS_RANK.get(name, 0)][list(LAYOUTS).index(name)]
    chunked = train.get("loss_chunk") != 0 and "tp" not in par  # else eager: tp's collectives
    assert loss["loss_compiled"] == chunked  # compiled, once: no recompilation


def test_restart_reads_compiled_blocks_from_the_cache(jobs):
    inductor = jobs["compiled"][0][-1]
    assert inductor.get("fxgraph_cache_hit", 0) > 0 and "fxgraph_cache_miss" not in inductor
    assert any((Path(jobs.tmp("run")) / "compile_cache").iterdir())


def test_recompiles_are_counted():
    """A guard on a value that changes from call to call (a Python int here, as a step
    number would be) is a recompilation each time, and CompileCost counts each."""
    cost = CompileCost()

    @torch.compile(backend="eager", dynamic=False)
    def scaled(x, k):
        return x * k

    for k in range(3):
        scaled(torch.ones(2), k)
    seconds, recompiles = cost.read()
    assert recompiles == 2 and seconds > 0
    scaled(torch.ones(2), 1)  # cached: no more
    assert cost.read()[1] == 0


def test_compiled_blocks_read_the_kept_rotary_tables():
    """A compiled block takes its layer's kept rotary tables as an input (made once, by the
    model's first forward), where it made them in its graph at every call: tables
    replaced after compiling change what every compiled block computes."""
    from tetrad.models.init import build_model
    from tetrad.models.llama import CausalCore

    cfg = _config({}, {}, {})
    model = build_model(cfg.model, 0)
    for block in model.layers.values():
        block.compile(backend="eager", dynamic=False)
    x = torch.randint(0, cfg.model.vocab, (1, cfg.train.seq_len))
    out = model(x)
    cores = [m for m in model.modules() if isinstance(m, CausalCore)]
    for core in cores:  # the same shape: read as an input, not recompiled
        core._tables = torch.zeros_like(core._tables)
    assert len(cores) == cfg.model.layers and not torch.equal(model(x), out)


def test_no_cxx_compiler_is_one_error_line(tmp_path):
    """On CPU without a C++ compiler, `tetrad train --compile` says so in one line, before
    anything starts."""
    env = {"PATH": "/usr/bin:/bin", "CXX": str(tmp_path / "no-such-c++")}
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--compile", "--device", "cpu"]
    cmd += ["--steps", "1", "--out", str(tmp_path / "run"), "--data", "synthetic"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0].startswith("tetrad: error:") and "C++ compiler" in lines[0]


def test_compile_refuses_selective_recompute():
    with pytest.raises(ValueError, match="selective"):
        Layout.build(_config({}, {}, {"recompute": "selective"}))
