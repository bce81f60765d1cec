"""The Llama model and its layout-invariant initialisation (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tetrad.config import ModelConfig, model_preset
from tetrad.models.flops import param_count
from tetrad.models.init import build_model, full_shape, full_value, materialize
from tetrad.models.llama import Llama, cross_entropy_sum

CFG = ModelConfig(name="tiny", layers=2, dim=32, heads=4, kv_heads=2, vocab=64)


def meta_model(cfg: ModelConfig = CFG) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


def shrink(module: nn.Linear | nn.Embedding, shape: tuple[int, ...]) -> None:
    """Replace a (meta) weight by a smaller one, as a sharding layout does."""
    module.weight = nn.Parameter(torch.empty(shape, device="meta"))


@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_materialisation_equals_slice_of_full(shards):
    full = build_model(CFG, seed=3)
    hd, f = CFG.head_dim, CFG.hidden_dim
    for part in range(shards):
        rows_q = slice(part * CFG.heads * hd // shards, (part + 1) * CFG.heads * hd // shards)
        cols_2 = slice(part * f // shards, (part + 1) * f // shards)
        rows_v = slice(part * CFG.vocab // shards, (part + 1) * CFG.vocab // shards)
        index = {
            "attention.wq.weight": (rows_q,),  # column-parallel: a row slice
            "feed_forward.w2.weight": (slice(None), cols_2),  # row-parallel: a column slice
            "tok_embeddings.weight": (rows_v,),  # vocab-parallel
        }
        model = meta_model()
        for block in model.layers.values():
            shrink(block.attention.wq, (rows_q.stop - rows_q.start, CFG.dim))
            shrink(block.feed_forward.w2, (CFG.dim, cols_2.stop - cols_2.start))
        shrink(model.tok_embeddings, (rows_v.stop - rows_v.start, CFG.dim))

        def slicer(name: str, index=index):
            return next((ix for suffix, ix in index.items() if name.endswith(suffix)), None)

        materialize(model, CFG, seed=3, slicer=slicer)
        ref = dict(full.named_parameters())
        for name, p in model.named_parameters():
            ix = slicer(name)
            want = ref[name][ix] if ix is not None else ref[name]
            assert torch.equal(p, want), name


def test_slice_shape_mismatch_is_an_error():
    model = meta_model()
    shrink(model.layers["0"].attention.wq, (8, CFG.dim))
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.wq\.weight: slice"):
        materialize(model, CFG, seed=0)


def test_init_depends_only_on_seed_and_name():
    a, b = build_model(CFG, seed=7), build_model(CFG, seed=7)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    shape = full_shape("layers.0.attention.wq.weight", CFG)
    x = full_value(7, "layers.0.attention.wq.weight", shape, CFG)
    assert not torch.equal(x, full_value(7, "layers.1.attention.wq.weight", shape, CFG))
    assert not torch.equal(x, full_value(8, "layers.0.attention.wq.weight", shape, CFG))
    assert torch.equal(full_value(0, "norm.weight", (CFG.dim,), CFG), torch.ones(CFG.dim))


def test_init_scale():
    big = ModelConfig(layers=8, dim=256, heads=8, kv_heads=4)
    wq = full_value(
        0, "layers.0.attention.wq.weight", full_shape("layers.0.attention.wq.weight", big), big
    )
    wo = full_value(
        0, "layers.0.attention.wo.weight", full_shape("layers.0.attention.wo.weight", big), big
    )
    assert wq.std().item() == pytest.approx(0.02, rel=0.05)
    assert wo.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # scaled by 1/sqrt(2L)


@pytest.mark.parametrize(
    "name,exact",
    [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)],
)
def test_large_presets_build_on_meta_with_known_sizes(name, exact):
    cfg = model_preset(name)
    model = meta_model(cfg)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == param_count(cfg) == exact  # 8.03B and 70.6B, as published


@pytest.mark.parametrize("name", ["tiny", "small", "base"])
def test_small_presets_count(name):
    cfg = model_preset(name)
    assert sum(p.numel() for p in meta_model(cfg).parameters()) == param_count(cfg)


def test_forward_shape_and_loss():
    model = build_model(CFG, seed=0)
    x = torch.randint(0, CFG.vocab, (3, 10))
    logits = model(x)
    assert logits.shape == (3, 10, CFG.vocab)
    targets = x.clone()
    targets[:, -2:] = -100  # padding is not counted
    total = cross_entropy_sum(logits, targets)
    mean = torch.nn.functional.cross_entropy(logits[:, :-2].flatten(0, 1), x[:, :-2].flatten())
    torch.testing.assert_close(total / 24, mean)


def test_causal():
    model = build_model(CFG, seed=0)
    x = torch.randint(0, CFG.vocab, (1, 8))
    y = x.clone()
    y[0, 5:] = (y[0, 5:] + 1) % CFG.vocab
    torch.testing.assert_close(model(x)[0, :5], model(y)[0, :5])


def test_tied_embeddings():
    cfg = ModelConfig(layers=1, dim=32, heads=4, kv_heads=2, vocab=64, tie_embeddings=True)
    model = build_model(cfg, seed=0)
    assert model.output is None
    names = [n for n, _ in model.named_parameters()]
    assert "output.weight" not in names
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert (
        param_count(cfg)
        == param_count(ModelConfig(**{**cfg.__dict__, "tie_embeddings": False})) - 64 * 32
    )
    x = torch.randint(0, 64, (2, 6))
    h = model.norm(model.layers["0"](model.tok_embeddings(x)))
    torch.testing.assert_close(model(x), h @ model.tok_embeddings.weight.T)
    cross_entropy_sum(model(x), x).backward()
    # the embedding is trained by both its uses: lookup rows and the output head
    assert model.tok_embeddings.weight.grad.count_nonzero() == 64 * 32


def test_pipeline_stage_flags():
    model = build_model(CFG, seed=0)
    x = torch.randint(0, CFG.vocab, (2, 6))
    ref = model(x)
    model.last = False
    hidden = model(x)
    assert hidden.shape == (2, 6, CFG.dim)
    model.first, model.last = False, True
    torch.testing.assert_close(model.head(model.norm(hidden)), ref)
