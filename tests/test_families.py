"""The Qwen3, Qwen2/2.5 and Mistral families: Llama's decoder with QK-norm, q/k/v biases
and a sliding window (docs/models.md).

Oracles: every layout reproduces the single process in fp64 (EXACT): each family in dp 2,
tp 2 + SP, pp 2, ZeRO-3 over fsdp 2 and cp 2; QK-norm and the biases at tp 2 without SP
too, and a kv head shared by both tp ranks (its bias replicated); the Qwen3-MoE family
(QK-norm) at tp 2, with SP and with ep 2. A random transformers model of each family,
imported, gives transformers' logits and loss, and an export loads as the same class
with tetrad's; a Qwen2 import trained at tp 2 + SP reads only each rank's slices and
exports back. A window shorter than the sequence is refused by name.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from harness import EXACT, Jobs, assert_close_run, tiny_config, train_worker, trainer_for
from test_interop_hf import _import_and_train
from test_plan_activations import _layer_saves
from tetrad.cli import main as cli_main
from tetrad.config import MODEL_PRESETS, model_preset
from tetrad.interop import hf
from tetrad.layout import Layout
from tetrad.models.init import build_model
from tetrad.models.llama import Llama
from tetrad.models.llama_spec import LLAMA
from tetrad.plan import activations as act

transformers = pytest.importorskip("transformers")

MODELS = {  # the test vocabulary; qwen3's head size (16) is not dim / heads (8)
    "qwen3": {**MODEL_PRESETS["qwen3-tiny"], "vocab": 64},
    "qwen2": {**MODEL_PRESETS["qwen2-tiny"], "vocab": 64},
    "mistral": {**MODEL_PRESETS["mistral-tiny"], "vocab": 64},  # window 128 >= seq_len 16
    "qwen2-kv1": {**MODEL_PRESETS["qwen2-tiny"], "vocab": 64, "kv_heads": 1},
    "qwen3-moe": {**MODEL_PRESETS["moe-tiny"], "vocab": 64, "qk_norm": True, "head_size": 16},
}
LAYOUTS = {
    "dp2": {"dp": 2},
    "tp2-sp": {"tp": 2, "sp": True},
    "pp2": {"pp": 2},
    "fsdp2": {"fsdp": 2, "zero_stage": 3},
    "cp2": {"cp": 2},
}
CASES = {
    f"{f}-{name}": (f, par) for f in ("qwen3", "qwen2", "mistral") for name, par in LAYOUTS.items()
}
CASES |= {
    "qwen3-tp2": ("qwen3", {"tp": 2}),
    "qwen2-tp2": ("qwen2", {"tp": 2}),
    "qwen2-kv1-tp2-sp": ("qwen2-kv1", {"tp": 2, "sp": True}),
    "qwen3-moe-tp2": ("qwen3-moe", {"tp": 2}),
    "qwen3-moe-tp2-sp": ("qwen3-moe", {"tp": 2, "sp": True}),
    "qwen3-moe-tp2-ep2": ("qwen3-moe", {"tp": 2, "ep": 2}),
}  # fmt: skip
STEPS = 3


def _config(model: str, parallel: dict):
    """Two microbatches everywhere: one single-process reference serves every layout."""
    return tiny_config(
        model=MODELS[model], parallel={**parallel, "microbatches": 2}, train={"steps": STEPS}
    )


HF = {  # family -> (transformers class, its config class, what differs from SHAPE)
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 64}),
}
SHAPE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rope_theta=5000.0, rms_norm_eps=1e-6, initializer_range=0.15,
)  # fmt: skip
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def _randomise(model: torch.nn.Module) -> None:
    """Gains other than 1 and biases other than 0 (HF initialises them so), so that a
    wrong permutation or a dropped tensor cannot hide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.15)


def save_hf(path, family: str) -> None:
    cls, config_cls, extra = HF[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, config_cls)(**SHAPE, **extra))
    _randomise(model)
    model.save_pretrained(path)


def hf_out(path, family: str, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and mean next-token loss of the transformers model in `path`."""
    model = getattr(transformers, HF[family][0]).from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model(tokens, labels=tokens)
    return out.logits, out.loss


def tetrad_out(m, state: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model = build_model(m, seed=0)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    return logits, loss


def assert_same(ours: tuple, theirs: tuple) -> None:
    """Logits and loss equal within fp32 round-off, relative 1e-5 (logits: of their scale)."""
    scale = theirs[0].abs().max()
    assert scale > 1  # not a near-zero model that any mapping would pass
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-5 * float(scale))
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=0)


# --- layouts ----------------------------------------------------------------------------


def _import_configs(root) -> list:
    """A Qwen2 import at tp 2 + SP (5 steps, saved at the end) from root/hf."""
    cfg = tiny_config(parallel={"tp": 2, "sp": True}, train={"steps": 5, "out": str(root / "run")})
    cfg.model = hf.model_config(root / "hf")
    cfg.checkpoint.every = 5
    return [cfg]


def declare_jobs(jobs: Jobs) -> None:
    """Every layout, and the Qwen2 import, in one 2-rank world."""
    jobs.add_training("layouts", [_config(*case) for case in CASES.values()])
    root = jobs.tmp("import")
    save_hf(root / "hf", "qwen2")
    jobs.add("import", 2, _import_and_train, [c.to_dict() for c in _import_configs(root)])


@pytest.fixture(scope="module")
def single():
    """The single-process run of each model, cached."""
    cache: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in cache:
            cache[model] = train_worker(0, 1, _config(model, {}).to_dict())
        return cache[model]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_single_process(jobs, single, name):
    got = jobs["layouts"][0][list(CASES).index(name)]
    assert_close_run(got, single(CASES[name][0]), rtol=EXACT)


@pytest.mark.distributed
def test_qwen2_import_at_tp2_sp_reads_its_slices_and_exports(jobs):
    root = jobs.tmp("import")
    for rank in jobs["import"]:  # each rank read its own slices, no more
        assert rank[0]["read"] == rank[0]["held"]
    got = jobs["import"][0][0]
    ref_cfg = tiny_config(train={"steps": 5})
    ref_cfg.model = hf.model_config(root / "hf")
    (ref,) = _import_and_train(0, 1, [ref_cfg.to_dict()])
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0
    )
    out = root / "exported"
    assert cli_main(["export", str(root / "run"), "--hf", str(out)]) == 0
    assert transformers.AutoConfig.from_pretrained(out).architectures == ["Qwen2ForCausalLM"]
    assert_same(tetrad_out(ref_cfg.model, got["state"], TOKENS), hf_out(out, "qwen2", TOKENS))


# --- transformers, both ways ------------------------------------------------------------


@pytest.mark.parametrize("family", list(HF))
def test_import_gives_hf_logits_and_loss(tmp_path, family):
    save_hf(tmp_path, family)
    cfg = tiny_config(train={"steps": 1, "dtype": "fp32"})
    cfg.model = hf.model_config(tmp_path)
    m = cfg.model
    assert (m.family, m.qk_norm, m.qkv_bias) == (family, family == "qwen3", family == "qwen2")
    want = {"qwen3": (16, 0), "qwen2": (8, 0), "mistral": (8, 64)}[family]
    assert (m.head_dim, m.sliding_window) == want  # head_dim and window as config.json says
    state = trainer_for(cfg, 0).engine.full_state_dict()  # through the engine's load
    assert_same(tetrad_out(m, state, TOKENS), hf_out(tmp_path, family, TOKENS))


@pytest.mark.parametrize("family", list(HF))
def test_export_loads_as_the_same_class_with_the_same_logits(tmp_path, family):
    m = dataclasses.replace(model_preset(f"{family}-tiny"), vocab=96, init_std=0.2)
    model = build_model(m, seed=3)
    _randomise(model)
    state = {n: p.detach() for n, p in model.named_parameters()}
    hf.save(state, m, tmp_path, max_shard_bytes=20_000)  # sharded, with an index
    assert transformers.AutoConfig.from_pretrained(tmp_path).architectures == [HF[family][0]]
    assert_same(tetrad_out(m, state, TOKENS), hf_out(tmp_path, family, TOKENS))
    back = hf.HFWeights(tmp_path, hf.model_config(tmp_path))  # and back, tensor for tensor
    assert all(torch.equal(back[name][...], t) for name, t in state.items())


@pytest.mark.parametrize(
    "family, change, field",
    [("qwen3", {"qk_norm": False}, "qk_norm"), ("llama", {"qkv_bias": True}, "qkv_bias"),
     ("qwen2", {"sliding_window": 32}, "sliding_window")],
)  # fmt: skip
def test_what_the_class_cannot_express_is_refused(tmp_path, family, change, field):
    base = model_preset("tiny" if family == "llama" else f"{family}-tiny")
    m = dataclasses.replace(base, **change)
    state = {n: p.detach() for n, p in build_model(m, seed=0).named_parameters()}
    with pytest.raises(ValueError, match=f"model.{field}=.*cannot be exported"):
        hf.save(state, m, tmp_path)


def test_a_window_shorter_than_the_sequence_is_refused_by_name():
    for par in ({}, {"tp": 2, "sp": True}, {"cp": 2}):
        cfg = tiny_config(model={"sliding_window": 8}, parallel=par)
        with pytest.raises(ValueError, match=r"sliding_window=8 < train.seq_len=16"):
            Layout.build(cfg, world=cfg.parallel.world)
    Layout.build(tiny_config(model={"sliding_window": 16}, parallel={"cp": 2}), world=2)


def test_the_model_help_names_every_preset():
    from test_cli import train_parser

    (text,) = [a.help for a in train_parser()._actions if "--model" in a.option_strings]
    assert set(MODEL_PRESETS) <= set(re.findall(r"[\w.-]+", text))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_planner_counts_what_autograd_saves(dtype):
    """A block's activations (the family's formulas) with QK-norm, a head size other than
    dim / heads and q/k/v biases, against a live count of the tensors autograd saves."""
    m = dataclasses.replace(
        model_preset("qwen3-tiny"), dim=64, head_size=32, ffn_dim=96, qkv_bias=True
    )
    b, s = 2, 32
    saved = _layer_saves(Llama, m, dtype, b, s)
    assert saved == act.total_bytes(LLAMA.activations.layer(m, 1, dtype), b, s)
