"""The DeepSeek-V3 family: multi-head latent attention on the MoE decoder, the sigmoid
router with group-limited top-k and routed scaling (docs/models.md).

Oracles: a random transformers `DeepseekV3ForCausalLM` (query bottleneck or not, with a
trained routing bias or not), imported, gives transformers' logits and loss (fp32,
relative 1e-5), and an export loads as the same class with tetrad's logits; every layout
(dp 2, tp 2 with and without SP, cp 2 all-gather and ring, the unfused block kernel too,
pp 2, ZeRO-3 over fsdp 2, ep 2, and tp 2 + SP with ep 2, with pp 2 zb-h1, with cp 2;
tp 2 + SP without the query bottleneck) and recomputation reproduce the single process
in fp64 (EXACT); a dense MLA layer's tp bytes are docs/models.md's formula; an import
trained at tp 2 + SP has transformers' first-step loss; the group-limited choice equals
a brute-force one; what is not implemented (yarn, rotate_half weights) is refused by name.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from harness import (
    EXACT,
    Jobs,
    assert_close_run,
    one_step_comm,
    tiny_config,
    train_worker,
    trainer_for,
)
from test_families import assert_same
from test_interop_hf import _import_and_train
from tetrad.cli import main as cli_main
from tetrad.config import MODEL_PRESETS, model_preset
from tetrad.interop import hf
from tetrad.layout import Layout
from tetrad.models import deepseek_spec
from tetrad.models.families import spec_for
from tetrad.models.init import build_model
from tetrad.models.moe import Router
from tetrad.train.checkpoint import load_model

transformers = pytest.importorskip("transformers")

MODEL = {**MODEL_PRESETS["deepseek-tiny"], "vocab": 64}
LAYOUTS = {
    "dp2": {"dp": 2},
    "pp2": {"pp": 2},
    "pp2-zb": {"pp": 2, "pp_schedule": "zb-h1"},  # MLA's weight gradients deferred
    "fsdp2": {"fsdp": 2, "zero_stage": 3},
    "ep2": {"dp": 2, "ep": 2},
    "tp2": {"tp": 2},  # the down projections replicated, the latents entering the region
    "tp2-sp": {"tp": 2, "sp": True},  # ... on each rank's s/2, their gradients summed
    "cp2": {"cp": 2},  # all-gather core: k (nope + rope) and v (v_head_dim) side by side
    "cp2-ring": {"cp": 2, "cp_attention": "ring"},
    "cp2-unfused": {"cp": 2, "cp_kernel": "unfused"},  # the reference block kernel
    "tp2-sp-ep2": {"tp": 2, "sp": True, "ep": 2},
}
LAYOUTS4 = {  # one 4-rank world: SP's down projections deferred to W; cp inside tp
    "tp2-sp-pp2-zb": {"tp": 2, "sp": True, "pp": 2, "pp_schedule": "zb-h1"},
    "cp2-tp2-sp": {"cp": 2, "tp": 2, "sp": True, "cp_attention": "ring"},
}
STEPS = 3

HF_SHAPE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=80, moe_intermediate_size=24,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
    kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
    max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-6, initializer_range=0.15,
)  # fmt: skip
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def _config(parallel: dict, **model):
    """Two microbatches everywhere: one single-process reference serves every layout."""
    return tiny_config(
        model={**MODEL, **model}, parallel={**parallel, "microbatches": 2}, train={"steps": STEPS}
    )


PLAIN_Q = {"q_lora_rank": 0}  # wq_b reads the input itself: it enters the region whole


IMPORTS = {"pp2": {"pp": 2}, "ep2": {"dp": 2, "ep": 2}}


def _import_configs(root, parallel: dict, name: str) -> list:
    """A random transformers model (root/hf) imported and trained 3 steps in fp64, saved."""
    cfg = tiny_config(parallel=parallel, train={"steps": STEPS, "out": str(root / name)})
    cfg.model = hf.model_config(root / "hf")
    cfg.checkpoint.every = STEPS
    return [cfg]


# the comm step: one dense MLA layer more (2 and 3 layers, 1 and 2 dense), fp32, dim 64
# against latents of 16 + 12 + 4 = 32 channels (the input's width would move twice as much)
COMM = [
    tiny_config(
        model={**MODEL, "dim": 64, "layers": dense + 1, "dense_layers": dense},
        parallel={"tp": 2, "sp": sp, "microbatches": 2},
        train={"dtype": "fp32"},
    )
    for sp in (False, True)
    for dense in (1, 2)
]


def _first_step_config(root, parallel: dict):
    """The model with a trained routing bias (root/hf-bias), one fp32 step."""
    cfg = tiny_config(parallel=parallel, train={"steps": 1, "dtype": "fp32"})
    cfg.model = hf.model_config(root / "hf-bias")
    return cfg


def declare_jobs(jobs: Jobs) -> None:
    """Every layout, the imports at pp 2 and ep 2 and at tp 2 + SP, in one 2-rank world;
    the combinations of four ranks in one 4-rank world."""
    jobs.add_training("layouts", [_config(par) for par in LAYOUTS.values()])
    jobs.add_training("layouts4", [_config(par) for par in LAYOUTS4.values()])
    jobs.add("comm", 2, one_step_comm, [c.to_dict() for c in COMM])
    jobs.add_training("plain-q", [_config({"tp": 2, "sp": True}, **PLAIN_Q)])
    root = jobs.tmp("import")
    save_hf(root / "hf", 16)
    for name, par in IMPORTS.items():
        cfgs = [c.to_dict() for c in _import_configs(root, par, name)]
        jobs.add(f"import-{name}", 2, _import_and_train, cfgs)
    save_hf(root / "hf-bias", 16, bias=0.5)
    cfg = _first_step_config(root, {"tp": 2, "sp": True})
    jobs.add("import-tp2-sp", 2, _import_and_train, [cfg.to_dict()])


@pytest.fixture(scope="module")
def single() -> dict:
    return train_worker(0, 1, _config({}).to_dict())


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS) + list(LAYOUTS4))
def test_layout_matches_single_process(jobs, single, name):
    job, names = ("layouts", list(LAYOUTS)) if name in LAYOUTS else ("layouts4", list(LAYOUTS4))
    got = jobs[job][0][names.index(name)]
    assert_close_run(got, single, rtol=EXACT)


@pytest.mark.distributed
def test_without_the_query_bottleneck_at_tp2_sp(jobs):
    """The input, not a latent, enters the region for wq_b (concatenated with the kv
    latent and the rotary key): still the single process's run."""
    single = train_worker(0, 1, _config({}, **PLAIN_Q).to_dict())
    assert_close_run(jobs["plain-q"][0][0], single, rtol=EXACT)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_matches(single, recompute):
    """MLA's selective policy (core and output projection kept) and full recomputation."""
    cfg = _config({})
    cfg.train.recompute = recompute
    assert_close_run(train_worker(0, 1, cfg.to_dict()), single, rtol=EXACT)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(IMPORTS))
def test_import_in_a_layout_reads_its_slices_trains_and_exports(jobs, name):
    """Each rank reads only what it holds; the losses are the single process's (fp64); the
    checkpoint, with its trained routing bias, exports to transformers' logits."""
    root = jobs.tmp("import")
    for rank in jobs[f"import-{name}"]:
        assert rank[0]["read"] == rank[0]["held"]
    (ref,) = _import_and_train(0, 1, [c.to_dict() for c in _import_configs(root, {}, "single")])
    got = jobs[f"import-{name}"][0][0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=EXACT, atol=0)  # fmt: skip
    cfg, state = load_model(root / name, buffers=True)
    assert any(b.any() for n, b in state.items() if n.endswith("expert_bias"))
    hf.save(state, cfg.model, root / f"{name}-hf")
    state = {n: t.float() for n, t in state.items()}
    m = dataclasses.replace(cfg.model, init_from_hf="")
    assert_same(tetrad_out(m, state, TOKENS), hf_out(root / f"{name}-hf", TOKENS))


def _bus(summary: dict, *ops: str) -> float:
    return sum(summary.get(f"tp/{op}", {}).get("bus_bytes", 0.0) for op in ops)


@pytest.mark.distributed
def test_the_tp_region_moves_the_latents_not_the_input(jobs):
    """Per dense MLA layer per microbatch, fp32 elements on the bus (docs/models.md): the
    latents' w = q_lora_rank + kv_lora_rank + qk_rope_dim where Llama's attention moves
    dim, the rest as Megatron's block; under SP besides, the down projections' and the
    four norms' weight gradients summed over tp."""
    plain1, plain2, sp1, sp2 = jobs["comm"][0]
    m, cfg = COMM[0].model, COMM[0]
    b, s, t, mb = Layout.build(cfg).microbatch_size, cfg.train.seq_len, 2, 2
    w, d = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim, m.dim
    region = 2 * (t - 1) / t * 4 * b * s * (w + 3 * d) * mb  # f/g, or gather/scatter pairs
    assert _bus(plain2, "all_reduce") - _bus(plain1, "all_reduce") == pytest.approx(region)
    moved = _bus(sp2, "all_gather", "reduce_scatter") - _bus(sp1, "all_gather", "reduce_scatter")
    assert moved == pytest.approx(region)
    weights = d * w + 2 * d + m.q_lora_rank + m.kv_lora_rank  # wq_a, wkv_a; norm gains
    summed = 2 * (t - 1) / t * 4 * weights * mb
    assert _bus(sp2, "all_reduce") - _bus(sp1, "all_reduce") == pytest.approx(summed)


@pytest.mark.distributed
def test_import_at_tp2_sp_has_the_first_step_loss_of_transformers(jobs):
    """A random model with a trained routing bias, imported at tp 2 + SP (each rank reads
    its slices; the bias, a buffer, read whole): its first loss, over the first batch,
    is transformers' on the same tokens (fp32, relative 1e-5)."""
    root = jobs.tmp("import")
    for rank in jobs["import-tp2-sp"]:
        assert rank[0]["read"] == rank[0]["held"]
    got = jobs["import-tp2-sp"][0][0]["losses"][0]
    batch = trainer_for(_first_step_config(root, {}), 0).loader.batch(0)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(root / "hf-bias")
    with torch.no_grad():
        logits = torch.cat([model(mb.inputs).logits for mb in batch])
    targets = torch.cat([mb.targets for mb in batch])
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=0)


# --- transformers, both ways ------------------------------------------------------------


def save_hf(path, q_lora_rank: int | None, seed: int = 0, bias: float = 0.0, **routing) -> None:
    """A random DeepseekV3ForCausalLM: gains other than 1, experts and router of a scale
    that routes differently by token (so a wrong group mask or scale shows); `bias`: the
    std of a trained routing bias (e_score_correction_bias; 0: untrained)."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**HF_SHAPE, q_lora_rank=q_lora_rank, **routing)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "experts" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias") and bias:
                b.normal_(0, bias)
    model.save_pretrained(path)


def tetrad_out(m, state: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and mean next-token loss of tetrad's model with `state` (the parameters; the
    routing bias buffers stay at zero)."""
    model = build_model(m, seed=0)
    missing, unexpected = model.load_state_dict(state, strict=False)  # the bias: if given
    assert not unexpected and all(k.endswith("expert_bias") for k in missing)
    with torch.no_grad():
        logits = model(tokens)
    return logits, F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def hf_out(path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model(tokens, labels=tokens)
    return out.logits, out.loss


@pytest.mark.parametrize(
    "q_lora_rank, routing",
    [(16, {}), (None, {"norm_topk_prob": False, "routed_scaling_factor": 1.5})],
    ids=["q-bottleneck", "plain-q-unnormalised"],
)
def test_import_gives_hf_logits_and_loss(tmp_path, q_lora_rank, routing):
    save_hf(tmp_path, q_lora_rank, **routing)
    cfg = tiny_config(train={"steps": 1, "dtype": "fp32"})
    cfg.model = m = hf.model_config(tmp_path)
    assert (m.family, m.q_lora_rank, m.kv_lora_rank) == ("deepseek_v3", q_lora_rank or 0, 12)
    assert (m.v_head_dim, m.n_group, m.topk_group, m.dense_layers) == (6, 4, 2, 1)
    want = (1.5, False) if routing else (2.5, True)
    assert (m.routed_scaling, m.norm_topk_prob) == want
    state = trainer_for(cfg, 0).engine.full_state_dict()  # through the engine's load
    assert_same(tetrad_out(m, state, TOKENS), hf_out(tmp_path, TOKENS))


def test_export_loads_as_the_same_class_with_the_same_logits(tmp_path):
    m = dataclasses.replace(model_preset("deepseek-tiny"), vocab=96, init_std=0.2)
    model = build_model(m, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, bias in model.named_buffers():  # a trained loss-free bias
            bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    params = {n: p.detach() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="expert_bias of layers \\[1, 2\\] is not in the state"):
        hf.save(params, m, tmp_path)
    buffers = dict(model.named_buffers())
    state = params | buffers
    hf.save(state, m, tmp_path, max_shard_bytes=20_000)  # sharded, with an index
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.architectures == ["DeepseekV3ForCausalLM"]
    assert_same(tetrad_out(m, state, TOKENS), hf_out(tmp_path, TOKENS))
    back = hf.HFWeights(tmp_path, hf.model_config(tmp_path))  # and back, the bias too
    for name, b in buffers.items():
        box = tuple((0, n) for n in b.shape)
        assert torch.equal(back.read_buffer(f"buffer/{name}", box), b)


def _edit_config(path, **change) -> None:
    file = path / hf.CONFIG
    file.write_text(json.dumps(json.loads(file.read_text()) | change))


@pytest.mark.parametrize(
    "change, match",
    [({"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4}},
      "rope_type='yarn' is not supported"),
     ({"rope_interleave": False}, "rope_interleave=false is not supported"),
     ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config is set"),
     ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported")],
)  # fmt: skip
def test_what_tetrad_does_not_compute_is_refused_on_import(tmp_path, change, match):
    save_hf(tmp_path, 16)
    _edit_config(tmp_path, **change)
    with pytest.raises(ValueError, match=match):
        hf.model_config(tmp_path)


def test_a_trained_routing_bias_imports_and_exports(tmp_path):
    """transformers (a trained e_score_correction_bias) -> tetrad, through the engine's
    load -> export: the same logits and loss each way; without the bias they differ."""
    save_hf(tmp_path / "hf", 16, bias=0.5)
    cfg = tiny_config(train={"steps": 1, "dtype": "fp32"})
    cfg.model = m = hf.model_config(tmp_path / "hf")
    engine = trainer_for(cfg, 0).engine
    buffers = {n: b.clone() for n, b in engine.model.named_buffers()}
    assert all(b.any() for b in buffers.values()) and len(buffers) == m.layers - m.dense_layers
    state = engine.full_state_dict() | buffers
    theirs = hf_out(tmp_path / "hf", TOKENS)
    assert_same(tetrad_out(m, state, TOKENS), theirs)
    dropped = tetrad_out(m, engine.full_state_dict(), TOKENS)[0]  # routed otherwise
    assert (dropped - theirs[0]).abs().max() > 1e-2 * theirs[0].abs().max()
    hf.save(state, m, tmp_path / "out")
    assert_same(tetrad_out(m, state, TOKENS), hf_out(tmp_path / "out", TOKENS))


# --- the router and the layouts refused ---------------------------------------------------


def test_group_limited_choice_is_the_best_within_the_best_groups():
    """Against brute force: each token's top_k among the experts of its topk_group groups
    with the largest sums of their two best scores; weights renormalised, then scaled."""
    m = dataclasses.replace(model_preset("deepseek-tiny"), experts=12, n_group=4, top_k=3)
    router = Router(m).double()
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, m.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, ids, weights = router(x)
    scores = router.logits(x).sigmoid()
    for t in range(x.shape[0]):
        groups = scores[t].view(4, 3).topk(2).values.sum(-1).topk(2).indices
        allowed = [e for e in range(12) if e // 3 in groups.tolist()]
        best = max(itertools.combinations(allowed, 3), key=lambda c: scores[t, list(c)].sum())
        assert sorted(ids[t].tolist()) == sorted(best)
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_impossible_groups_are_refused():
    m = dataclasses.replace(model_preset("deepseek-tiny"), topk_group=1, top_k=3)
    with pytest.raises(ValueError, match="n_group=4, topk_group=1"):
        spec_for(m).build(m)


def test_the_planner_prices_the_published_size_with_and_without_tp(capsys):
    base = ["plan", "--model", "deepseek-v3", "--gpus", "256", "--gpu", "h100",
            "--global-batch", "1024", "--seq-len", "4096", "--microbatches", "64",
            "--recompute", "full", "--pp", "16"]  # fmt: skip
    assert cli_main([*base, "--dp", "16", "--ep", "16"]) == 0
    assert "dp16·pp16·ep16" in capsys.readouterr().out
    assert cli_main([*base, "--tp", "2", "--dp", "8", "--ep", "8"]) == 0
    assert "dp8·tp2·pp16·ep8" in capsys.readouterr().out


def test_matmul_shapes_on_a_tp_rank():
    """The heads' projections split over tp, the down projections whole on every rank."""
    m = model_preset("deepseek-v3")
    one, two = deepseek_spec.block_linears(m, 1), deepseek_spec.block_linears(m, 2)
    for name in ("wq_a", "wkv_a"):
        assert two[f"attention.{name}"] == one[f"attention.{name}"]
    for name in ("wq_b", "wkv_b"):
        k, n = one[f"attention.{name}"]
        assert two[f"attention.{name}"] == (k, n // 2)
    k, n = one["attention.wo"]
    assert two["attention.wo"] == (k // 2, n) and k == m.heads * m.v_head_dim


def test_the_published_size():
    """deepseek-v3: 671B parameters, 37B of them active per token (its paper's counts,
    without the multi-token prediction module's 14B)."""
    m = model_preset("deepseek-v3")
    names = dict(spec_for(m).build(m).named_parameters())
    total = sum(p.numel() for p in names.values())
    assert round(total / 1e9) == 671
    active = deepseek_spec.matmul_params(m) + m.vocab * m.dim  # and the embedding's row
    assert active == pytest.approx(37e9, rel=0.02)


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_the_planner_prices_the_latents_entering_the_region(sp):
    """tp seconds per layer: the latents (w = 2112 of dim 7168) enter MLA's region, so its
    f moves w a token (backward; under SP the gather and its reduce-scatter, and the down
    projections' weight gradients summed), against 2 all-reduces of dim a way for a block
    entered at its input: the docs/models.md table, as the planner prices it."""
    from plan_helpers import layout_config
    from tetrad.plan.cost import Planner
    from tetrad.plan.hardware import cluster_preset

    m = dataclasses.replace(model_preset("deepseek-v3"), layers=4, dense_layers=1)
    cfg = layout_config(m, 4, 4096, "bf16", tp=8, sp=sp)
    lay, planner = Layout.build(cfg), Planner(cluster_preset("h100"))
    got = planner._tp_times(lay, m)
    nbytes = lay.microbatch_tokens * m.dim * lay.element_bytes
    link = planner._link(1, 8)
    one = link.time("all_reduce", 8, nbytes)
    r = (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim) / m.dim
    f, b = ((r + 3) / 2, (r + 3) / 2) if sp else (2.0, 1 + r)
    if sp:
        down = m.dim * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim)
        summed = down + m.q_lora_rank + m.kv_lora_rank
        b += link.time("all_reduce", 8, summed * lay.element_bytes) / one
    head = {"F": 1 + sp, "B": 1}
    for kind, per in (("F", f), ("B", b)):
        assert got[kind][0] == pytest.approx((4 * per + head[kind]) * one, rel=1e-9)
    assert b < 2  # narrower than the input's
