"""Hugging Face Mixtral and Qwen3-MoE in and out, checked against transformers (offline):
a random model saved by transformers and imported gives its logits; a tetrad MoE model
exported and loaded by `from_pretrained` gives tetrad's; what neither can express is
refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import tiny_config, trainer_for
from tetrad.config import MODEL_PRESETS, ModelConfig
from tetrad.interop import hf
from tetrad.models.families import spec_for
from tetrad.models.init import build_model

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-5
SHAPE = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
    initializer_range=0.15, num_experts_per_tok=2,
)  # fmt: skip
ARCH = {
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(intermediate_size=48, num_local_experts=4, rope_theta=5000.0),
    ),
    "qwen3_moe": (  # head_dim 16 != 32 / 4, a dense first layer, QK-norm
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(intermediate_size=80, moe_intermediate_size=24, num_experts=4, head_dim=16,
             norm_topk_prob=True, mlp_only_layers=[0]),
    ),
}  # fmt: skip


def save_hf_moe(path, arch: str, seed: int = 0) -> None:
    model_cls, config_cls, extra = ARCH[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**SHAPE, **extra)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # gains other than 1 (QK-norm's permutation shows)
            elif "experts" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.15)  # stacked expert weights are not initialised by HF's std
    model.save_pretrained(path)


def hf_logits(path, arch: str, tokens: torch.Tensor) -> torch.Tensor:
    cls = getattr(transformers, ARCH[arch][0])
    with torch.no_grad():
        return cls.from_pretrained(path, dtype=torch.float32)(tokens).logits


def tetrad_logits(model_cfg: ModelConfig, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = build_model(model_cfg, seed=0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("expert_bias") for k in missing)
    with torch.no_grad():
        return model(tokens)


TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", list(ARCH))
def test_import_gives_hf_logits(tmp_path, arch):
    save_hf_moe(tmp_path, arch)
    cfg = tiny_config(train={"steps": 1})
    cfg.model = hf.model_config(tmp_path)
    assert (cfg.model.family, cfg.model.experts, cfg.model.top_k) == ("moe", 4, 2)
    if arch == "qwen3_moe":
        assert (cfg.model.qk_norm, cfg.model.head_dim, cfg.model.dense_layers) == (True, 16, 1)
    state = trainer_for(cfg, 0).engine.full_state_dict()  # through the engine's load
    ours, theirs = tetrad_logits(cfg.model, state, TOKENS), hf_logits(tmp_path, arch, TOKENS)
    assert theirs.abs().max() > 1
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOGIT_ATOL)


def _exportable(arch: str) -> ModelConfig:
    base = ModelConfig(**{**MODEL_PRESETS["moe-tiny"], "vocab": 96, "shared_experts": 0})
    base = dataclasses.replace(base, init_std=0.15, rope_theta=5000.0)
    if arch == "qwen3_moe":
        return dataclasses.replace(base, qk_norm=True, head_size=16, dense_layers=1, layers=3)
    return base


@pytest.mark.parametrize("arch", list(ARCH))
def test_export_loads_in_hf_with_the_same_logits(tmp_path, arch):
    m = _exportable(arch)
    model = build_model(m, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    state = {n: p.detach() for n, p in model.named_parameters()}
    files = hf.save(state, m, tmp_path, max_shard_bytes=40_000)  # sharded, with an index
    assert (tmp_path / hf.INDEX) in files
    ours, theirs = tetrad_logits(m, state, TOKENS), hf_logits(tmp_path, arch, TOKENS)
    assert theirs.abs().max() > 1
    torch.testing.assert_close(theirs, ours, rtol=0, atol=LOGIT_ATOL)
    assert hf.model_config(tmp_path).experts == m.experts  # and it reads back


@pytest.mark.parametrize(
    "change, field",
    [({"shared_experts": 1}, "shared_experts"), ({"router": "sigmoid"}, "router"),
     ({"balance": "bias"}, "balance"), ({"dense_layers": 1}, "dense_layers")],
)  # fmt: skip
def test_what_hf_cannot_express_is_refused(tmp_path, change, field):
    m = dataclasses.replace(_exportable("mixtral"), **change)
    state = {n: p.detach() for n, p in build_model(m, seed=0).named_parameters()}
    with pytest.raises(ValueError, match=f"model.{field}=.*cannot be exported"):
        hf.save(state, m, tmp_path)
    assert not list(tmp_path.iterdir())  # refused before writing


def test_spec_names_every_moe_parameter():
    for m in (_exportable("mixtral"), _exportable("qwen3_moe")):
        names = [n for n, _ in spec_for(m).build(m).named_parameters()]
        keys = [k for n in names for k in hf.hf_keys(n, m)]
        assert len(set(keys)) == len(keys)
