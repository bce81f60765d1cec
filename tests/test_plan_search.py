"""The layout search and the `tetrad plan` command; no processes but a search's own
(`jobs`)."""

from __future__ import annotations

import json
import os

import pytest

from plan_helpers import layout_config, planned
from tetrad.config import model_preset
from tetrad.plan import search as search_module
from tetrad.plan.cost import Planner
from tetrad.plan.engines import MEGATRON
from tetrad.plan.hardware import cluster_preset
from tetrad.plan.search import Space, search


@pytest.mark.parametrize(
    "model,gpus,batch,seq", [("llama3-8b", 16, 64, 4096), ("small", 4, 16, 128)]
)
def test_search_fits_and_beats_naive_layouts(model, gpus, batch, seq):
    cluster = cluster_preset("h100") if model != "small" else cluster_preset("cpu")
    planner = Planner(cluster)
    base = layout_config(model_preset(model), batch, seq)
    best = search(planner, *planned(base), gpus, top=3)
    assert best and all(p.memory.fits for p in best)
    assert [p.step_time_s for p in best] == sorted(p.step_time_s for p in best)
    naive = [dict(fsdp=gpus), dict(dp=gpus)]
    for layout in naive:
        per = batch // gpus
        for m in (d for d in (1, 2, 4, 8, 16) if per % d == 0):
            pred = planner.predict(*planned(layout_config(model_preset(model), batch, seq, **layout,
                                                 microbatches=m)))  # fmt: skip
            if pred.memory.fits:
                assert best[0].step_time_s <= pred.step_time_s * (1 + 1e-9), layout


def test_search_honours_fixed_degrees():
    planner = Planner(cluster_preset("h100"))
    base = layout_config(model_preset("llama3-8b"), 64, 4096)
    found = search(planner, *planned(base), 16, Space(tp=2, pp=2), top=5)
    assert found and all(p.layout["tp"] == 2 and p.layout["pp"] == 2 for p in found)


def test_search_finds_cp_where_nothing_else_fits():
    """llama3-8b at 131,072 tokens a sequence on 16 H100s (Megatron's kernels, no
    recompute): no layout without cp fits; the search finds tp 8 x cp 2."""
    planner = Planner(cluster_preset("h100"), MEGATRON)
    base = layout_config(model_preset("llama3-8b"), 4, 131072)
    assert search(planner, *planned(base), 16, Space(cp=1)) == []
    best = search(planner, *planned(base), 16, top=3)
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
    assert main([*base, "--search", "--jobs", "0"]) == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


# --- pruning: the same answer, fewer simulations -------------------------------------------


def _answer(preds):
    return [(p.layout, p.step_time_s, p.memory.total) for p in preds]


@pytest.mark.parametrize(
    "model,gpus,batch,seq,gpu",
    [("llama3-8b", 16, 64, 4096, "h100"), ("small", 8, 32, 128, "cpu"),
     ("mixtral-8x7b", 16, 64, 4096, "h100")],  # an MoE: ep chosen, experts' ZeRO units
)  # fmt: skip
def test_pruned_search_gives_the_unpruned_answer(
    model, gpus, batch, seq, gpu, monkeypatch, tmp_path
):
    """The same answer from a planner of its own (no cache shared with the reference),
    having priced (`Planner.predict`) under half the layouts the unpruned walk prices,
    and from the walk split among processes (`jobs`)."""
    priced = _count_predictions(monkeypatch)
    base = layout_config(model_preset(model), batch, seq)
    full = search(Planner(cluster_preset(gpu)), *planned(base), gpus, top=6, prune=False)
    assert len(full) == 6
    unpruned, priced[0] = priced[0], 0
    planner = Planner(cluster_preset(gpu))
    assert _answer(search(planner, *planned(base), gpus, top=6)) == _answer(full)
    assert 2 * priced[0] < unpruned, (priced[0], unpruned)
    monkeypatch.setattr(search_module, "_walk_group", _recorded_walk)  # forks inherit it
    monkeypatch.setenv("WALKED_IN", str(tmp_path / "pids"))
    split = search(Planner(cluster_preset(gpu)), *planned(base), gpus, top=6, jobs=2)
    assert _answer(split) == _answer(full)  # walked in processes other than this one
    assert str(os.getpid()) not in (tmp_path / "pids").read_text().split()
    assert search(planner, *planned(base), gpus, top=0) == []


_WALK_GROUP = search_module._walk_group


def _recorded_walk(group):
    """`search._walk_group`, writing down the process it ran in (a module-level function:
    the pool sends it by name)."""
    with open(os.environ["WALKED_IN"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return _WALK_GROUP(group)


def _count_predictions(monkeypatch) -> list[int]:
    """A one-element list that counts `Planner.predict` calls from now on."""
    calls, predict = [0], Planner.predict

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return predict(self, *args, **kwargs)

    monkeypatch.setattr(Planner, "predict", counted)
    return calls


def test_step_floor_bounds_the_step_and_grows_with_the_count():
    """What pruning relies on: `step_floor` is at most the predicted step, and within a
    family (everything but the microbatch count fixed) it never falls as the count grows;
    the floor with the pipeline's warm-up (`step_floors`) lies between the two."""
    from tetrad.plan.search import families, valid

    planner = Planner(cluster_preset("h100"))
    base, m = planned(layout_config(model_preset("llama3-8b"), 64, 4096))
    checked = 0
    for family in families(base, m, 16, 8, Space()):
        floors = []
        for _, cand in valid(base, m, family):
            floor, started = planner.step_floors(cand, m)
            assert floor == planner.step_floor(cand, m) and floor <= started
            if checked % 7 == 0:  # a sample: predicting every layout is the slow path
                assert started <= planner.predict(cand, m, detail=False).step_time_s * (1 + 1e-9)
            floors.append(floor)
            checked += 1
        assert floors == sorted(floors), family[0]
    assert checked > 100


@pytest.mark.parametrize("engine", ["tetrad", "megatron"])
def test_step_floors_bound_every_schedule(engine):
    """The warm-up and cool-down floor (`step_floors`' second) is at most the simulated
    step for every schedule, whole backward and split (the zero-bubble ones' deferred W
    may fill the cool-down: only what it leaves counts), on a dense and an MoE model;
    and it is close: a 1F1B or GPipe pipeline of equal stages idles only in its warm-up
    and cool-down, which the floor counts."""
    planner = Planner(cluster_preset("h100"), *([MEGATRON] if engine == "megatron" else []))
    closest = {}
    for model in ("llama3-8b", "mixtral-8x7b"):
        ep = 2 if model == "mixtral-8x7b" else 1
        for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1),
                            ("zb-v", 2)]:  # fmt: skip
            for pp, tp, count in [(2, 1, 4), (4, 2, 8), (8, 1, 16), (4, 1, 32)]:
                cfg = layout_config(model_preset(model), 256, 4096, pp=pp, tp=tp,
                                    fsdp=16 // (pp * tp), ep=ep, microbatches=count,
                                    pp_schedule=schedule, virtual_stages=v)  # fmt: skip
                lay, m = planned(cfg)
                floor, started = planner.step_floors(lay, m)
                step = planner.predict(lay, m, detail=False).step_time_s
                assert floor <= started <= step * (1 + 1e-9), (model, schedule, pp, tp, count)
                closest[schedule] = max(closest.get(schedule, 0.0), started / step)
    assert closest["1f1b"] > 0.99 and closest["gpipe"] > 0.99, closest


def test_search_table_is_one_row_a_layout_in_80_columns(capsys):
    from tetrad.cli import main

    argv = ["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100", "--global-batch",
            "64", "--seq-len", "4096", "--search", "--top", "8"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 8  # title, header, one line a layout
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert "…" not in "".join(lines)
    assert all(line.split()[0] == str(i) for i, line in enumerate(lines[2:], 1))


def test_layout_code():
    from tetrad.plan.cli import layout_code

    lay = dict(dp=1, fsdp=32, tp=1, pp=1, cp=2, zero_stage=2, sp=False, pp_schedule="1f1b",
               virtual_stages=1, microbatches=32, microbatch_size=1)  # fmt: skip
    assert layout_code(lay) == "fsdp32·cp2·z2 m32"
    lay.update(tp=8, pp=16, fsdp=1, cp=1, pp_schedule="interleaved-1f1b", virtual_stages=2,
               microbatch_size=2, sp=True)  # fmt: skip
    assert layout_code(lay) == "tp8·pp16 i1f1b/v2 m32x2"
    lay.update(sp=False, tp=2, pp=1)
    assert layout_code(lay) == "tp2·nosp m32x2"
