"""The layout search and the `tetrad plan` command; no processes."""

from __future__ import annotations

import json

import pytest

from tetrad.config import model_preset
from tetrad.plan.cost import Planner
from tetrad.plan.engines import MEGATRON
from tetrad.plan.hardware import cluster_preset
from tetrad.plan.layouts import layout_config
from tetrad.plan.search import Space, search


@pytest.mark.parametrize(
    "model,gpus,batch,seq", [("llama3-8b", 16, 64, 4096), ("small", 4, 16, 128)]
)
def test_search_fits_and_beats_naive_layouts(model, gpus, batch, seq):
    cluster = cluster_preset("h100") if model != "small" else cluster_preset("cpu")
    planner = Planner(cluster)
    base = layout_config(model_preset(model), batch, seq)
    best = search(planner, base, gpus, top=3)
    assert best and all(p.memory.fits for p in best)
    assert [p.step_time_s for p in best] == sorted(p.step_time_s for p in best)
    naive = [dict(fsdp=gpus), dict(dp=gpus)]
    for layout in naive:
        per = batch // gpus
        for m in (d for d in (1, 2, 4, 8, 16) if per % d == 0):
            pred = planner.predict(layout_config(model_preset(model), batch, seq, **layout,
                                                 microbatches=m))  # fmt: skip
            if pred.memory.fits:
                assert best[0].step_time_s <= pred.step_time_s * (1 + 1e-9), layout


def test_search_honours_fixed_degrees():
    planner = Planner(cluster_preset("h100"))
    base = layout_config(model_preset("llama3-8b"), 64, 4096)
    found = search(planner, base, 16, Space(tp=2, pp=2), top=5)
    assert found and all(p.layout["tp"] == 2 and p.layout["pp"] == 2 for p in found)


def test_search_finds_cp_where_nothing_else_fits():
    """llama3-8b at 131,072 tokens a sequence on 16 H100s (Megatron's kernels, no
    recompute): no layout without cp fits; the search finds tp 8 x cp 2."""
    planner = Planner(cluster_preset("h100"), MEGATRON)
    base = layout_config(model_preset("llama3-8b"), 4, 131072)
    assert search(planner, base, 16, Space(cp=1)) == []
    best = search(planner, base, 16, top=3)
    assert best and all(p.layout["cp"] > 1 and p.memory.fits for p in best)
    assert all(131072 % (2 * p.layout["cp"]) == 0 for p in best)


def test_cli_json(capsys):
    from tetrad.cli import main

    argv = ["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100",
            "--global-batch", "64", "--seq-len", "4096", "--fsdp", "8", "--tp", "2",
            "--microbatches", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "predict" and out["cluster"]["device"]["name"] == "h100"
    pred = out["predictions"][0]
    assert pred["layout"]["dp"] == 1 and pred["layout"]["sp"] is True
    assert set(pred["memory"]) >= {"model_state", "activations", "overhead", "total", "fits"}
    assert pred["step_time_s"] > 0


def test_cli_search_json_and_table(capsys):
    from tetrad.cli import main

    base = ["plan", "--model", "small", "--gpus", "4", "--gpu", "cpu", "--global-batch", "16",
            "--seq-len", "128", "--dtype", "fp32"]  # fmt: skip
    assert main([*base, "--search", "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "search" and 1 <= len(out["predictions"]) <= 3
    assert main([*base, "--dp", "2", "--pp", "2"]) == 0
    assert "step time" in capsys.readouterr().out
    assert main([*base, "--fsdp", "3"]) == 2  # 4 GPUs are not divisible by 3
    assert "not divisible" in capsys.readouterr().err
    assert main([*base, "--dp", "2", "--tp", "1"]) == 2  # 2 ranks on 4 GPUs
    assert "!= --gpus 4" in capsys.readouterr().err
