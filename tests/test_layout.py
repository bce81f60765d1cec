"""`Layout`: derived once, validated once per launch, and the only layout the parts read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from harness import tiny_config
from tetrad import layout as layout_module
from tetrad.layout import Layout, check_schedule

SRC = Path(__file__).resolve().parents[1] / "src" / "tetrad"


def test_local_shapes_and_dtypes_are_derived_once():
    cfg = tiny_config(
        parallel={"dp": 2, "cp": 2, "tp": 2, "sp": True, "microbatches": 2, "reduce_dtype": "bf16"},
        train={"global_batch": 8, "seq_len": 16, "dtype": "bf16"},
    )
    lay = Layout.build(cfg, 8)
    assert lay.degrees == {"pp": 1, "dp": 2, "fsdp": 1, "cp": 2, "tp": 2}
    assert lay.world == 8 and lay.data_ranks == 2
    assert lay.microbatch_size == 8 // (2 * 2)  # sequences per microbatch per data rank
    assert lay.local_seq == 16 // 2  # cp: this rank's share of each sequence
    assert lay.act_seq == 16 // 2 // 2  # sp: split again over tp between the blocks
    assert lay.microbatch_tokens == 2 * 8
    assert (lay.compute_dtype, lay.reduce_dtype, lay.master_dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )


def test_a_layout_from_its_three_sections_is_the_configs():
    """`Layout.of` (what the planner builds from a model, its training settings and the
    degrees) is `Layout.build`'s layout, and refuses what build refuses of those sections."""
    cfg = tiny_config(parallel={"dp": 2, "tp": 2, "sp": True, "microbatches": 2})
    assert Layout.of(cfg.model, cfg.train, cfg.parallel, 4) == Layout.build(cfg, 4)
    with pytest.raises(ValueError, match="8"):
        Layout.of(cfg.model, cfg.train, cfg.parallel, 8)
    odd = tiny_config(train={"global_batch": 3}, parallel={"dp": 2})
    with pytest.raises(ValueError, match="global_batch"):
        Layout.of(odd.model, odd.train, odd.parallel)


def test_split_is_checked_and_fixed_once():
    cfg = tiny_config(model={"layers": 4}, parallel={"pp": 2, "pp_split": "3,1"})
    assert Layout.build(cfg, 2).split == (3, 1)
    measured = Layout.build(tiny_config(parallel={"pp": 2, "pp_split": "measured"}), 2)
    assert measured.split is None and measured.split_measured
    fixed = measured.with_split([1, 1])
    assert fixed.split == (1, 1) and not fixed.split_measured
    with pytest.raises(ValueError, match="has 3 stages, not 2"):
        measured.with_split([1, 1, 0])


@pytest.mark.parametrize(
    "request_, needle",
    [
        (("zb-v", 2, 4, 1), "virtual_stages=2, got 1"),
        (("interleaved-1f1b", 2, 3, 2), "microbatches=3, pp=2"),
        (("1f1b", 2, 4, 2), "one stage per rank"),
        (("pipedream", 2, 4, 1), "unknown pipeline schedule 'pipedream'"),
    ],
)
def test_schedule_rules_name_the_values(request_, needle):
    with pytest.raises(ValueError, match=needle):
        check_schedule(*request_)


def _count_builds(monkeypatch) -> list[int]:
    calls: list[int] = []
    checks = layout_module.check_sections

    def counted(cfg):
        calls.append(1)
        return checks(cfg)

    monkeypatch.setattr(layout_module, "check_sections", counted)
    return calls


def test_validation_runs_once_per_launch(monkeypatch, tmp_path):
    """`tetrad train` on one process: the command line, the rank's run and its trainer
    share the one Layout the command built (no second or third validation)."""
    from tetrad.cli import main

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    calls = _count_builds(monkeypatch)
    args = ["train", "--model", "tiny", "--vocab", "64", "--seq-len", "16", "--global-batch"]
    args += ["4", "--steps", "1", "--data", "synthetic", "--no-progress", "--nproc", "1"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 0
    assert len(calls) == 1


def test_a_rank_validates_once(monkeypatch, tmp_path):
    """A rank torchrun started (`run`, as the worker calls it) builds its Layout once."""
    from tetrad.train.run import run

    monkeypatch.setenv("WORLD_SIZE", "1")
    calls = _count_builds(monkeypatch)
    cfg = tiny_config(train={"steps": 1, "out": str(tmp_path / "run")})
    run(cfg)
    assert len(calls) == 1


def test_parallel_and_train_read_no_whole_config():
    """parallel/ takes a Layout and the sub-configs it reads; the whole `Config` enters
    only the trainer, its checkpoints and data (which record or read the whole job)."""
    whole = re.compile(r"\bConfig\b")
    offenders = [
        f"{path.relative_to(SRC)}:{n}"
        for path in sorted((SRC / "parallel").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if whole.search(line)
    ]
    assert not offenders, offenders
