"""Every configuration check fails fast with a ValueError that names the offending values."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tetrad.config import Config, ParallelConfig, from_dict, load_raw, model_preset
from tetrad.layout import Layout

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def make(**sections) -> Config:
    """A valid tiny synthetic config with `sections` overlaid ({"model": {...}, ...})."""
    base = {
        "model": {"layers": 2, "dim": 32, "heads": 4, "kv_heads": 2, "vocab": 64},
        "train": {"global_batch": 8, "seq_len": 16},
        "data": {"source": "synthetic"},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return from_dict(base)


def test_valid_configs_pass():
    Layout.build(make())
    Layout.build(make(parallel={"dp": 2, "tp": 2}), world=4)
    Layout.build(Config(), world=1)  # the defaults (stdlib corpus, byte-level vocab)
    for path in sorted(CONFIGS.glob("*.toml")):
        cfg = from_dict(load_raw(path))
        Layout.build(cfg, cfg.parallel.world)


# (overrides, world size, regex the message must match: it names the values)
BAD = {
    "world size != product of degrees": (
        {"parallel": {"dp": 2, "tp": 2}}, 8,
        r"world size 8 != dp\*fsdp\*cp\*tp\*pp = 2\*1\*1\*2\*1 = 4",
    ),
    "degree < 1": ({"parallel": {"dp": 0}}, None, r"parallel\.dp must be >= 1, got 0"),
    "microbatches < 1": (
        {"parallel": {"microbatches": 0}}, None, r"parallel\.microbatches must be >= 1, got 0",
    ),
    "heads not divisible by tp": (
        {"parallel": {"tp": 8}}, None, r"model\.heads=4 is not divisible by tp=8",
    ),
    "kv heads and tp": (
        {"model": {"dim": 48, "heads": 6, "kv_heads": 3}, "parallel": {"tp": 2}},
        None, r"model\.kv_heads=3 and tp=2",
    ),
    "ffn not divisible by tp": (
        {"model": {"ffn_dim": 100, "heads": 8, "dim": 64}, "parallel": {"tp": 8}},
        None, r"ffn hidden size 100 is not divisible by tp=8",
    ),
    "global batch vs data ranks x microbatches": (
        {"parallel": {"dp": 3}}, None,
        r"global_batch=8 is not divisible by data ranks \(dp\*fsdp=3\) x microbatches=1 = 3",
    ),
    "global batch vs fsdp and microbatches": (
        {"parallel": {"fsdp": 2, "microbatches": 3}}, None,
        r"global_batch=8 .*dp\*fsdp=2.* microbatches=3 = 6",
    ),
    "seq_len > max_seq_len": (
        {"model": {"max_seq_len": 8}}, None, r"train\.seq_len=16 exceeds model\.max_seq_len=8",
    ),
    "cp degree < 1": ({"parallel": {"cp": 0}}, None, r"parallel\.cp must be >= 1, got 0"),
    "seq_len not divisible by 2*cp": (
        {"parallel": {"cp": 3}, "train": {"seq_len": 16}}, None,
        r"cp=3 splits every sequence into 2\*cp=6 equal chunks: seq_len=16 is not divisible"
        r" by 6",
    ),
    "cp world size": (
        {"parallel": {"cp": 2, "tp": 2}}, 2,
        r"world size 2 != dp\*fsdp\*cp\*tp\*pp = 1\*1\*2\*2\*1 = 4",
    ),
    "sp with cp needs seq_len/cp divisible by tp": (
        {"parallel": {"cp": 2, "tp": 4, "sp": True}, "train": {"seq_len": 20}}, None,
        r"seq_len/cp divisible by tp: seq_len=20, tp=4, cp=2",
    ),
    "seq_len < 2": ({"train": {"seq_len": 1}}, None, r"train\.seq_len must be >= 2, got 1"),
    "stdlib needs a byte vocabulary": (
        {"data": {"source": "stdlib"}}, None, r"model\.vocab=64 must be >= 256",
    ),
    "missing data path": (
        {"data": {"source": "no_such_dir/corpus.txt"}}, None, r"no_such_dir/corpus\.txt",
    ),
    "dim not divisible by heads": (
        {"model": {"dim": 30}}, None, r"model\.dim=30 is not divisible by heads=4",
    ),
    "odd head dim": (
        {"model": {"dim": 36, "heads": 4, "kv_heads": 2}}, None, r"head_dim=9 .* must be even",
    ),
    "heads not divisible by kv heads": (
        {"model": {"kv_heads": 3}}, None, r"model\.heads=4 is not divisible by kv_heads=3",
    ),
    "layers < 1": ({"model": {"layers": 0}}, None, r"model\.layers must be >= 1, got 0"),
    "bad schedule name": (
        {"parallel": {"pp_schedule": "zigzag"}}, None, r"pp_schedule='zigzag' is not one of",
    ),
    "bad zero stage": (
        {"parallel": {"zero_stage": 4}}, None, r"parallel\.zero_stage=4 is not one of \(1, 2, 3\)",
    ),
    "sp without tp": ({"parallel": {"sp": True}}, None, r"sp=True needs tp > 1"),
    "sp needs seq divisible by tp": (
        {"parallel": {"sp": True, "tp": 2}, "train": {"seq_len": 15}}, None,
        r"seq_len=15, tp=2",
    ),
    "virtual stages need an interleaved schedule": (
        {"parallel": {"pp": 2, "virtual_stages": 2, "pp_schedule": "1f1b"}}, None,
        r"1f1b runs one stage per rank: virtual_stages must be 1, got 2",
    ),
    "zb-v holds two stages per rank": (
        {"parallel": {"pp": 2, "virtual_stages": 1, "pp_schedule": "zb-v"}}, None,
        r"zb-v holds exactly 2 stages per rank: virtual_stages=2, got 1",
    ),
    "more stages than layers": (
        {"parallel": {"pp": 2, "virtual_stages": 3, "pp_schedule": "interleaved-1f1b",
                      "microbatches": 2}}, None,
        r"model\.layers=2 < pp\*virtual_stages-2=2\*3-2 = 4",
    ),
    "interleaved microbatches vs pp": (
        {"model": {"layers": 4}, "parallel": {"pp": 2, "pp_schedule": "interleaved-1f1b",
                                               "virtual_stages": 2, "microbatches": 1}}, None,
        r"microbatches=1, pp=2",
    ),
    "bucket size": ({"parallel": {"bucket_mb": 0.0}}, None, r"bucket_mb must be > 0, got 0\.0"),
    "reduce dtype": ({"parallel": {"reduce_dtype": "fp4"}}, None, r"reduce_dtype='fp4'"),
    "train dtype": ({"train": {"dtype": "fp16"}}, None, r"train\.dtype='fp16'"),
    "device": ({"train": {"device": "tpu"}}, None, r"train\.device='tpu'"),
    "lr": ({"train": {"lr": 0.0}}, None, r"train\.lr must be > 0, got 0\.0"),
    "steps": ({"train": {"steps": 0}}, None, r"train\.steps must be >= 1, got 0"),
    "min lr ratio": ({"train": {"min_lr_ratio": 1.5}}, None, r"min_lr_ratio must be in \[0, 1\]"),
    "warmup": ({"train": {"warmup_steps": -1}}, None, r"warmup_steps must be >= 0, got -1"),
    "grad clip": ({"train": {"grad_clip": -1.0}}, None, r"grad_clip must be >= 0"),
    "init std": ({"model": {"init_std": 0.0}}, None, r"init_std must be > 0, got 0\.0"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_raises_naming_values(case):
    overrides, world, pattern = BAD[case]
    with pytest.raises(ValueError, match=pattern):
        Layout.build(make(**overrides), world=world)


def test_unknown_section_and_key():
    with pytest.raises(ValueError, match=r"unknown config section \[optim\]"):
        from_dict({"optim": {"lr": 1.0}})
    with pytest.raises(ValueError, match=r"unknown key 'hidden' in \[model\]"):
        from_dict({"model": {"hidden": 3}})
    with pytest.raises(ValueError, match=r"section \[train\] must be a table"):
        from_dict({"train": 3})


@pytest.mark.parametrize(
    "section,key,value,pattern",
    [
        ("model", "layers", "4", r"\[model\] layers = '4' has type str, expected int"),
        ("model", "layers", 4.0, r"layers = 4\.0 has type float, expected int"),
        ("parallel", "dp", True, r"dp = True has type bool, expected int"),
        ("parallel", "sp", 1, r"sp = 1 has type int, expected bool"),
        ("train", "dtype", 16, r"dtype = 16 has type int, expected str"),
    ],
)
def test_wrong_types(section, key, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_dict({section: {key: value}})


def test_int_is_accepted_for_float():
    assert from_dict({"train": {"lr": 1}}).train.lr == 1.0


def test_toml_file_errors(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nlayers = 2\nwidth = 64\n")
    with pytest.raises(ValueError, match=r"unknown key 'width' in \[model\]"):
        from_dict(load_raw(path))
    path.write_text('[parallel]\ndp = 2\n[train]\nsteps = "ten"\n')
    with pytest.raises(ValueError, match=r"steps = 'ten' has type str"):
        from_dict(load_raw(path))


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown model 'gpt5'"):
        model_preset("gpt5")


def test_validation_survives_python_O():
    """Checks are `_require` calls, never `assert` statements, which `python -O` strips: no
    source file has one (an AST scan: a subprocess under -O recompiles torch, 20 s)."""
    src = Path(__file__).resolve().parents[1] / "src" / "tetrad"
    asserts = [
        f"{path.relative_to(src)}:{node.lineno}"
        for path in sorted(src.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert not asserts, asserts
    with pytest.raises(ValueError, match=r"world size 2 != dp\*fsdp\*cp\*tp\*pp = 3"):
        Layout.build(from_dict({"parallel": {"dp": 3}, "data": {"source": "synthetic"}}), world=2)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_zero_with_split_backward_and_tied_embeddings_is_accepted(schedule):
    """ZeRO composes with the zero-bubble schedules and with an embedding tied across the
    pipeline's ends (tests/test_pp_zero_bubble.py shows them equal to one process)."""
    cfg = Config()
    cfg.model.layers = 4
    cfg.model.tie_embeddings = True
    v = 2 if schedule == "zb-v" else 1
    cfg.parallel = ParallelConfig(
        fsdp=2, pp=2, pp_schedule=schedule, microbatches=2, virtual_stages=v
    )
    Layout.build(cfg, 4)


def test_what_this_machine_cannot_run_refuses_training_not_plans(monkeypatch):
    """FP8 without a CPU FP8 kernel (torch 2.6) and --compile without a C++ compiler are
    refused when training on CPU, naming the cause, and not when planning: a plan prices
    other machines (`tetrad plan --fp8` on a laptop with torch 2.6 was refused)."""
    from tetrad import config
    from tetrad.plan.candidates import layout_for

    monkeypatch.setattr(config, "_scaled_mm_on_cpu", lambda: False)
    monkeypatch.setattr(config, "_cpp_compiler", lambda: None)
    for train, cause in (({"fp8": "tensorwise"}, "no CPU kernel for FP8"),
                         ({"compile": True}, r"found no C\+\+ compiler")):  # fmt: skip
        cfg = from_dict({"train": {"device": "cpu", **train}})
        with pytest.raises(ValueError, match=cause):
            Layout.build(cfg, 1)
        assert Layout.build(from_dict({"train": {"device": "cuda", **train}}), 1)
    assert layout_for(model_preset("llama3-8b"), 64, 4096, "bf16", 8, "tensorwise", fsdp=8)
    # a GPU here (device auto): rowwise FP8 in fp32 refused for training, not for a plan
    monkeypatch.setattr(config.torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="rowwise' with train.dtype='fp32' on CUDA"):
        Layout.build(from_dict({"train": {"fp8": "rowwise", "dtype": "fp32"}}), 1)
    assert layout_for(model_preset("llama3-8b"), 64, 4096, "fp32", 8, "rowwise", fsdp=8)
