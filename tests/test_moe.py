"""The MoE family on one process: routing (both routers, ties), the grouped experts and
the dispatcher against per-token loops, the sequence-wise auxiliary loss and its gradient
against a hand computation, the loss-free bias update, recomputation, the CLI flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from harness import tiny_config, trainer_for
from tetrad.cli import build_config, parser
from tetrad.config import MODEL_PRESETS, ModelConfig
from tetrad.models.families import spec_for
from tetrad.models.init import build_model
from tetrad.models.moe import (
    Experts,
    LocalDispatch,
    MoEFeedForward,
    Router,
    moe_layers,
    set_aux_scale,
    top_k_stable,
)

CFG = ModelConfig(**{**MODEL_PRESETS["moe-tiny"], "vocab": 64})


def _filled(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


# --- routing ----------------------------------------------------------------------------


def test_top_k_breaks_ties_to_the_lower_index():
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0], [0.0, 1.0, 1.0, 1.0]])
    assert top_k_stable(scores, 2).tolist() == [[1, 2], [0, 1], [1, 2]]


def test_softmax_router_renormalises_its_top_k():
    router = _filled(Router(dataclasses.replace(CFG, top_k=2)), 0)
    x = torch.randn(5, CFG.dim, generator=torch.Generator().manual_seed(7))
    probs, ids, weights = router(x)
    want = F.softmax(x @ router.weight.T, dim=-1)
    torch.testing.assert_close(probs, want)
    for t in range(5):
        order = sorted(range(CFG.experts), key=lambda e: (-float(want[t, e].detach()), e))[:2]
        assert ids[t].tolist() == order
        chosen = want[t, order]
        torch.testing.assert_close(weights[t], chosen / chosen.sum())


def test_equal_router_rows_tie_and_the_lower_expert_wins():
    router = Router(dataclasses.replace(CFG, top_k=1))
    with torch.no_grad():
        router.weight.zero_()
        router.weight[1:] = 1.0  # experts 1, 2, 3 score alike, above expert 0
    _, ids, weights = router(torch.ones(3, CFG.dim))
    assert ids.flatten().tolist() == [1, 1, 1]
    assert weights.flatten().tolist() == [1.0, 1.0, 1.0]


def test_sigmoid_router_chooses_on_biased_scores_and_weighs_by_its_own():
    router = _filled(Router(dataclasses.replace(CFG, router="sigmoid", top_k=2)), 1)
    x = torch.randn(6, CFG.dim, generator=torch.Generator().manual_seed(8))
    scores = torch.sigmoid(x @ router.weight.T).detach()
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 always in
    probs, ids, weights = router(x)
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True))
    for t in range(6):
        rest = max(range(3), key=lambda e: (float(scores[t, e]), -e))
        assert ids[t].tolist() == [3, rest]
        chosen = scores[t, [3, rest]]  # the bias chose, the scores weigh
        torch.testing.assert_close(weights[t], chosen / chosen.sum())


def test_bias_update_moves_toward_the_mean_load():
    router = Router(CFG)
    router.update_bias(torch.tensor([8.0, 2.0, 5.0, 5.0]), rate=0.5)
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


# --- experts and dispatch ----------------------------------------------------------------


def _swiglu(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def test_grouped_experts_equal_one_swiglu_per_group():
    """Both implementations (the grouped matmul, taken on CPU, and the loop)."""
    experts = _filled(Experts(4, 8, 12), 2)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(5))
    got, looped = experts(x, counts), experts._loop(x, counts)
    bounds = [0, 3, 3, 8, 10]
    for e in range(4):
        lo, hi = bounds[e], bounds[e + 1]
        want = _swiglu(x[lo:hi], experts.w1[e], experts.w3[e], experts.w2[e])
        torch.testing.assert_close(looped[lo:hi], want, rtol=0, atol=0)
        # the grouped kernel blocks its sums otherwise: fp32 round-off apart
        torch.testing.assert_close(got[lo:hi], want, rtol=1e-6, atol=1e-7)


def test_dispatch_sums_each_tokens_weighted_experts():
    experts = _filled(Experts(4, 8, 12), 3)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 8, generator=gen)
    ids = torch.tensor([[2, 0], [0, 1], [3, 2], [1, 3], [2, 1], [0, 3]])
    weights = torch.rand(6, 2, generator=gen)
    got = LocalDispatch()(x, ids, weights, experts)
    for t in range(6):
        want = sum(
            weights[t, j] * _swiglu(x[t : t + 1], *(w[ids[t, j]] for w in _ws(experts)))
            for j in range(2)
        )
        torch.testing.assert_close(got[t : t + 1], want, rtol=1e-6, atol=1e-6)


def _ws(experts):
    return experts.w1, experts.w3, experts.w2


# --- the auxiliary loss ------------------------------------------------------------------


def _hand_aux(probs: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> list[float]:
    """Σ_e f_e·P_e per sequence, with explicit loops: probs [b, s, n], ids [b, s, k]."""
    out = []
    for seq_p, seq_ids in zip(probs.tolist(), ids.tolist()):
        s = len(seq_p)
        total = 0.0
        for e in range(n):
            f = n / (k * s) * sum(row.count(e) for row in seq_ids)
            p = sum(row[e] for row in seq_p) / s
            total += f * p
        out.append(total)
    return out


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_loss_value_and_gradient_match_a_hand_computation(router):
    """The recorded value is the hand formula's; the injected gradient is that of
    coef · mean over the global batch's sequences (here 5, the microbatch has 2)."""
    cfg = dataclasses.replace(CFG, router=router, aux_loss_coef=0.3)
    ffn = _filled(MoEFeedForward(cfg), 4)
    ffn.aux_scale = 1 / 5
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 7, cfg.dim, generator=gen, requires_grad=True)
    out = ffn(x)
    probs, ids, _ = ffn.router(x.detach().reshape(-1, cfg.dim))
    hand = _hand_aux(probs.view(2, 7, -1), ids.view(2, 7, -1), cfg.experts, cfg.top_k)
    assert ffn.stats[cfg.experts] == pytest.approx(sum(hand), rel=1e-6)
    upstream = torch.randn(out.shape, generator=gen)
    (out * upstream).sum().backward()
    got = ffn.router.weight.grad.clone()

    # the same model, the same upstream gradient, with the aux loss added to the loss
    ffn.router.weight.grad = None
    ffn.balance = "none"
    plain = ffn(x.detach())
    probs, ids, _ = ffn.router(x.detach().reshape(-1, cfg.dim))
    f = torch.zeros(2, cfg.experts)
    for b in range(2):
        for e in range(cfg.experts):
            f[b, e] = cfg.experts / (cfg.top_k * 7) * (ids.view(2, 7, -1)[b] == e).sum()
    aux = (f * probs.view(2, 7, -1).mean(dim=1)).sum() * 0.3 / 5
    ((plain * upstream).sum() + aux).backward()
    atol = 1e-6 * float(got.abs().max())  # fp32 round-off of sums of that size
    torch.testing.assert_close(got, ffn.router.weight.grad, rtol=1e-5, atol=atol)
    aux_part = (got - _router_grad_without_aux(ffn, x, upstream)).abs().max()
    assert aux_part > 20 * atol  # the injected gradient is there, far above round-off


def _router_grad_without_aux(ffn, x, upstream):
    ffn.router.weight.grad = None
    ((ffn(x.detach()) * upstream).sum()).backward()
    return ffn.router.weight.grad


def test_trainer_sets_the_aux_scale_to_the_global_batch():
    cfg = tiny_config(model={**MODEL_PRESETS["moe-tiny"], "vocab": 64}, train={"steps": 1})
    trainer = trainer_for(cfg, 0)
    layers = moe_layers(trainer.engine.model)
    assert sorted(layers) == [0, 1]
    assert all(ffn.aux_scale == 1 / cfg.train.global_batch for ffn in layers.values())
    row = trainer.fit()[0]
    aux = sum(v["aux_loss"] for v in row["moe_layers"].values())
    assert row["moe_aux_loss"] == pytest.approx(aux)
    assert 0.9 * 2 * 0.01 < row["moe_aux_loss"] < 3 * 2 * 0.01  # ≈ coef per layer, balanced
    for v in row["moe_layers"].values():  # every token counted once, k times
        assert v["load_mean"] * 4 == cfg.train.global_batch * cfg.train.seq_len * 2


def test_a_bias_step_follows_the_steps_loads():
    cfg = tiny_config(
        model={**MODEL_PRESETS["moe-tiny"], "vocab": 64, "router": "sigmoid", "balance": "bias"},
        train={"steps": 1},
    )
    trainer = trainer_for(cfg, 0)
    trainer.train_step()
    for ffn in moe_layers(trainer.engine.model).values():
        load = ffn.stats[: cfg.model.experts]
        want = cfg.model.bias_rate * torch.sign(load.mean() - load)
        torch.testing.assert_close(ffn.router.expert_bias.double(), want)
        assert ffn.router.expert_bias.abs().sum() > 0


# --- recomputation, flags, refusals --------------------------------------------------------


def _grads_and_stats(model, mode: str):
    spec_for(CFG).set_recompute(model, mode)
    model.zero_grad(set_to_none=True)
    for ffn in moe_layers(model).values():
        ffn.reset_stats()
    ids = torch.randint(0, CFG.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, [ffn.stats.clone() for ffn in moe_layers(model).values()]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_is_bit_equal_and_counts_routing_once(mode):
    cfg = dataclasses.replace(CFG, dense_layers=1, layers=3)
    model = build_model(cfg, seed=1)
    set_aux_scale(model, 2)
    plain, plain_stats = _grads_and_stats(model, "none")
    got, stats = _grads_and_stats(model, mode)
    assert all(torch.equal(plain[n], got[n]) for n in plain)
    assert all(torch.equal(a, b) for a, b in zip(plain_stats, stats))


def test_capacity_factor_is_refused():
    with pytest.raises(ValueError, match="capacity_factor=1.25.*dropless"):
        spec_for(CFG).build(dataclasses.replace(CFG, capacity_factor=1.25))


def test_experts_flag_makes_a_dense_preset_moe():
    args = parser().parse_args(["train", "--model", "tiny", "--experts", "4", "--top-k", "1",
                                "--router", "sigmoid", "--balance", "bias"])  # fmt: skip
    m = build_config(args).model
    assert (m.family, m.experts, m.top_k, m.router, m.balance) == ("moe", 4, 1, "sigmoid", "bias")
    args = parser().parse_args(["train", "--model", "moe-tiny", "--experts", "0"])
    assert build_config(args).model.family == "llama"


def test_report_plots_expert_load(tmp_path):
    pytest.importorskip("matplotlib")
    from tetrad.report import report

    cfg = tiny_config(model={**MODEL_PRESETS["moe-tiny"], "vocab": 64}, train={"steps": 2})
    rows = trainer_for(cfg, 0).fit()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text, files = report(tmp_path)
    assert tmp_path / "report" / "experts.png" in files
    worst = max(v["load_max"] / v["load_mean"] for v in rows[-1]["moe_layers"].values())
    assert f"-> {worst:.2f} (the most imbalanced layer)" in text


def test_flops_count_the_active_parameters_of_the_built_model():
    """6 x (matmul parameters a token uses, counted on the model: the top_k of E experts'
    share of the stacked weights, all the rest but norms and the embedding lookup)
    + attention's 12·L·(heads·hd)·s; Mixtral 8x7B's active count is its published ~12.9B."""
    cfg = dataclasses.replace(CFG, layers=3, dense_layers=1, head_size=16)
    active = 0.0
    for name, p in spec_for(cfg).build(cfg).named_parameters():
        if name.endswith("norm.weight") or name.startswith("tok_embeddings"):
            continue
        share = cfg.top_k / cfg.experts if ".experts." in name else 1.0
        active += share * p.numel()
    attention = 12.0 * cfg.layers * cfg.heads * cfg.head_dim * 64
    assert spec_for(cfg).flops_per_token(cfg, 64) == pytest.approx(6 * active + attention)
    mixtral = ModelConfig(**MODEL_PRESETS["mixtral-8x7b"])
    embedding = mixtral.vocab * mixtral.dim  # a lookup, not a matmul: in the count, not FLOPs
    per_token = spec_for(mixtral).flops_per_token(mixtral, 0) / 6 + embedding
    assert per_token == pytest.approx(12.9e9, rel=0.01)
