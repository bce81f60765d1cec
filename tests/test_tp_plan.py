"""The tensor-parallel plan and its shard arithmetic, checked without processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import tiny_config
from tetrad.comm import Comm
from tetrad.mesh import Group, Mesh
from tetrad.models.init import build_model, materialize
from tetrad.models.llama import Llama, RMSNorm, cross_entropy_sum
from tetrad.models.plans import LLAMA_PLAN, STYLES, assign, matches, style_of
from tetrad.parallel.tensor import VocabParallelCrossEntropy, apply_tp, shard_index, vocab_range


def _meta_llama(**model) -> nn.Module:
    with torch.device("meta"):
        return Llama(tiny_config(model=model).model)


def test_patterns_match_one_component_per_star():
    assert matches("layers.*.attention.wq", "layers.11.attention.wq")
    assert not matches("layers.*.attention", "layers.1.attention.wq")
    assert not matches("norm", "layers.0.ffn_norm")
    assert style_of("output", LLAMA_PLAN) == "vocab"
    assert style_of("layers.3", LLAMA_PLAN) is None


def test_plan_covers_every_weight_of_the_llama():
    model = _meta_llama()
    styles = assign([n for n, _ in model.named_modules() if n], LLAMA_PLAN)
    assert set(styles.values()) <= set(STYLES)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)):
            assert name in styles, name
        if isinstance(module, RMSNorm):
            assert styles[name] == "sequence", name
    # each region: column-wise (or kv) projections in, exactly one row-wise projection out
    for region in [n for n, s in styles.items() if s == "region"]:
        inner = [s for n, s in styles.items() if n.startswith(region + ".")]
        assert inner.count("rowwise") == 1 and len(inner) >= 2, region
        assert set(inner) <= {"colwise", "kv", "rowwise"}, region


def test_bad_plans_are_rejected():
    with pytest.raises(ValueError, match="unknown style 'colwize'"):
        assign(["output"], {"output": "colwize"})
    with pytest.raises(ValueError, match="several plan entries"):
        style_of("norm", {"norm": "sequence", "*": "replicated"})


def test_vocab_blocks_pad_to_a_multiple_of_tp():
    assert [vocab_range(66, 4, r) for r in range(4)] == [(0, 17), (17, 34), (34, 51), (51, 66)]
    assert [vocab_range(64, 4, r) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert vocab_range(9, 4, 3) == (9, 9)  # a tiny vocabulary may leave a rank empty
    assert shard_index("cols", (8, 12), 3, 2) == (slice(None), slice(8, 12))
    with pytest.raises(ValueError, match="not divisible by tp=5"):
        shard_index("rows", (8, 12), 5, 0)


def _shards(tp: int, sp: bool, **model) -> list[dict[str, torch.Tensor]]:
    """Every tp rank's materialised shards, built with pure meshes (no process group)."""
    cfg = tiny_config(model=model, parallel={"tp": tp, "sp": sp})
    out = []
    for rank in range(tp):
        mesh = Mesh.plan({"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": tp}, rank)
        with torch.device("meta"):
            model_ = Llama(cfg.model)
        layout = apply_tp(model_, LLAMA_PLAN, mesh, Comm(), cfg.model, cfg.parallel.sp)
        materialize(model_, cfg.model, cfg.train.seed, "cpu", layout.slicer)
        params = dict(model_.named_parameters())
        assert set(layout.replicated) == {n for n in params if not n.endswith("norm.weight")}
        out.append({n: (p.detach(), layout.slicer(n)) for n, p in params.items()})
    return out


@pytest.mark.parametrize(
    "tp,model",
    [(2, {}), (4, {"vocab": 66}), (4, {"heads": 4, "kv_heads": 4})],
    ids=["tp2", "tp4-kv<tp-v66", "tp4-kv=tp"],
)
def test_shards_tile_the_single_process_weights(tp, model):
    full = dict(build_model(tiny_config(model=model).model, seed=0).named_parameters())
    shards = _shards(tp, sp=True, **model)
    for name, value in full.items():
        rebuilt = torch.full_like(value, float("nan"))
        for rank in shards:
            local, index = rank[name]
            if index is None:  # replicated: every rank holds the whole tensor
                assert torch.equal(local, value), name
                rebuilt = local
            else:
                rebuilt[index] = local
        assert torch.equal(rebuilt, value), name


def test_kv_heads_below_tp_compute_the_head_of_their_queries():
    model = _meta_llama()  # heads=4, kv_heads=2
    cfg = tiny_config(parallel={"tp": 4})
    heads = []
    for rank in range(4):
        mesh = Mesh.plan({"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 4}, rank)
        model = _meta_llama()
        apply_tp(model, LLAMA_PLAN, mesh, Comm(), cfg.model, cfg.parallel.sp)
        wk = model.layers["0"].attention.wk
        assert tuple(wk.weight.shape) == (2 * 8, 32 // 4)  # all kv heads, 1/tp of the inputs
        heads.append(wk.head)
    assert heads == [0, 0, 1, 1]  # query head r uses kv head r // (heads / kv_heads)


def test_unplanned_linear_is_an_error():
    model = _meta_llama()
    plan = {k: v for k, v in LLAMA_PLAN.items() if k != "output"}
    mesh = Mesh.plan({"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 2}, 0)
    with pytest.raises(ValueError, match="no entry for module 'output'"):
        apply_tp(model, plan, mesh, Comm(), tiny_config().model, False)


def test_vocab_parallel_loss_on_one_rank_is_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 1] = -100  # padding
    loss_fn = VocabParallelCrossEntropy(Comm(), Group("tp", [0], 0), start=0)
    got = loss_fn(logits, targets)
    (grad,) = torch.autograd.grad(got, logits)
    want = cross_entropy_sum(logits, targets)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)
