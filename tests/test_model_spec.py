"""ModelSpec: parallel and planning code know a model only through its family's spec
(no parameter or module name spelled in them), the spec agrees with the model it
declares, and selective recomputation refuses a block its policy no longer fits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tetrad.config import ModelConfig
from tetrad.models.families import family, spec_for
from tetrad.models.init import build_model, full_shape
from tetrad.models.llama import Block
from tetrad.models.llama_spec import LLAMA
from tetrad.models.plans import assign
from tetrad.models.recompute import recompute
from tetrad.models.spec import Keep, module_at

SRC = Path(__file__).resolve().parents[1] / "src" / "tetrad"
SCANNED = ("parallel", "plan")
# a Llama parameter or module, its builder, plan or policy, spelled where only the spec may
FORBIDDEN = [
    r"\b(tok_embeddings|attention_norm|ffn_norm|feed_forward)\b",
    r"\b(wq|wk|wv|wo|w1|w2|w3)\b",
    r"\b(meta_llama|LLAMA_PLAN|KEEP_SELECTIVE|ROOT_ORDER|TIED|LLAMA)\b",
    r"\bllama_\w+",
    r"\blayers\.",  # a block's parameter path ("layers.3.")
    r"(?<![\w.])model\.layers\b",  # the model's blocks (not cfg.model's count)
    r"\boutput\.",  # the head's parameters
    r"\bnorm\.",  # the final norm's, or any "*norm.weight"
    r"\.(output|norm)\b",  # the head or final norm as a model attribute
]
CFG = ModelConfig(name="tiny", layers=2, dim=32, heads=4, kv_heads=2, vocab=64)


def violations(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every forbidden name in `text`, comments included."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if any(re.search(p, line) for p in FORBIDDEN):
            out.append((number, line.strip()))
    return out


def test_parallel_and_plan_name_no_model_parameter_or_module():
    found = []
    for folder in SCANNED:
        for file in sorted((SRC / folder).rglob("*.py")):
            rel = file.relative_to(SRC.parent)
            found += [f"{rel}:{n}: {line}" for n, line in violations(file.read_text())]
    assert not found, "model names outside models/ (read them from the ModelSpec):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "line",
    [  # what parallel/ and plan/ said before the spec
        'TIED = "tok_embeddings.weight"  # the embedding a tied head reuses',
        'ROOT_ORDER = {"tok_embeddings": 0, "norm": 1, "output": 2}',
        'prefixes += ["norm.", "output."]',
        'prefixes = [f"layers.{layer}." for layer in chunk.layers]',
        "for name in list(model.layers):",
        "model.norm.register_forward_hook(lambda _, __, out: tp.enter(out))",
        "if self.model.output is not None:",
        "from tetrad.models.llama import meta_llama",
        "layout = apply_tp(model, LLAMA_PLAN, mesh, comm, cfg)",
        "costs = llama_layer_costs(",
        "layer = act.llama_layer(m, p.tp, dt)",
        '"""(K, N) of each linear of a block on one tp rank: wq, wk, wv, wo, w1, w3, w2."""',
        "# second-to-last child (a Llama block's ffn_norm)",
    ],
)
def test_the_scan_catches_what_parallel_code_used_to_spell(line):
    assert violations(line), line


def test_the_scan_lets_generic_code_through():
    for line in ["m.layers, cfg.model.layers", "chunk.layers", "spec.head", "the output head"]:
        assert not violations(line), line


# --- the spec agrees with the model it declares --------------------------------------------


def test_registry():
    assert spec_for(CFG) is family("llama") is LLAMA
    with pytest.raises(ValueError, match="unknown model family 'gpt'.*llama"):
        spec_for(ModelConfig(family="gpt"))


@pytest.mark.parametrize("tied", [False, True])
def test_module_roles_exist_on_the_model(tied):
    cfg = ModelConfig(**{**vars(CFG), "tie_embeddings": tied})
    model = LLAMA.build(cfg)
    for path in (LLAMA.embedding, LLAMA.final_norm, LLAMA.blocks):
        assert module_at(model, path) is not None, path
    assert (module_at(model, LLAMA.head) is None) == tied
    names = [n for n, _ in model.named_parameters()]
    assert LLAMA.tied_weight in names
    assert {LLAMA.block_of(n) for n in names} == {None, "layers.0", "layers.1"}
    for n in names:  # every parameter: a declared shape and a Hugging Face name
        assert tuple(dict(model.named_parameters())[n].shape) == full_shape(n, cfg)
        assert LLAMA.hf_name(n).startswith(("model.", "lm_head."))
    assert len({LLAMA.hf_name(n) for n in names}) == len(names)


def test_tp_plan_covers_every_weight_of_a_block():
    model = LLAMA.build(CFG)
    styles = assign([n for n, _ in model.named_modules() if n], dict(LLAMA.tp_plan))
    weighted = {n for n, m in model.named_modules() if getattr(m, "weight", None) is not None}
    assert weighted <= set(styles)


@pytest.mark.parametrize("t", [1, 2])
def test_block_linears_are_the_blocks_linears(t):
    block = LLAMA.build(CFG).get_submodule(LLAMA.block_prefix(0)[:-1])
    linears = LLAMA.block_linears(CFG, t)
    found = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    assert list(linears) == list(found)  # forward order: what the planner sums over
    if t == 1:
        assert linears == {n: (m.in_features, m.out_features) for n, m in found.items()}
    for path in LLAMA.selective.modules():  # the policy names modules the block has
        assert block.get_submodule(path) is not None


@pytest.mark.parametrize(("first", "last", "tied"), [(1, 0, 0), (0, 1, 0), (0, 1, 1), (0, 0, 1)])
def test_prune_keeps_what_a_stage_uses(first, last, tied):
    """`prune` (the model a stage builds) and `stage_parameters` (what the runtime and
    the planner count) agree."""
    cfg = ModelConfig(**{**vars(CFG), "tie_embeddings": bool(tied)})
    whole = [n for n, _ in LLAMA.build(cfg).named_parameters()]
    model = LLAMA.build(cfg)
    LLAMA.prune(model, ["1"], bool(first), bool(last))
    kept = {n for n, _ in model.named_parameters()}
    assert kept == LLAMA.stage_parameters(whole, ["1"], bool(first), bool(last))
    assert (model.first, model.last) == (bool(first), bool(last))


# --- selective recomputation's policy, checked against the block ----------------------------


class _TwoMatmuls(nn.Module):
    """A down projection with a low-rank correction: two matmuls in one module."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.a = nn.Parameter(torch.randn(4, linear.in_features) * 0.02)
        self.b = nn.Parameter(torch.randn(linear.out_features, 4) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.linear.weight) + F.linear(F.linear(x, self.a), self.b)


def _grads(model: nn.Module, mode: str) -> dict[str, torch.Tensor]:
    LLAMA.set_recompute(model, mode)
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab, (2, 8), generator=gen)
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_selective_equals_no_recompute_bit_for_bit():
    model = build_model(CFG, seed=1)
    plain, selective = _grads(model, "none"), _grads(model, "selective")
    assert all(torch.equal(plain[n], selective[n]) for n in plain)


def test_an_extra_matmul_elsewhere_in_a_block_does_not_move_the_policy():
    """A kernel before the block's linears (here in the first norm) shifted every call
    index: a policy by index would then drop another linear's output, silently."""
    torch.manual_seed(0)
    model = build_model(CFG, seed=1)
    for block in model.layers.values():
        extra = nn.Linear(CFG.dim, CFG.dim, bias=False)
        block.attention_norm = nn.Sequential(block.attention_norm, extra)
    plain, selective = _grads(model, "none"), _grads(model, "selective")
    assert all(torch.equal(plain[n], selective[n]) for n in plain)


def test_a_dropped_module_with_an_extra_matmul_fails_loudly():
    torch.manual_seed(0)
    model = build_model(CFG, seed=1)
    block = model.layers["0"]
    block.feed_forward.w2 = _TwoMatmuls(block.feed_forward.w2)
    with pytest.raises(RuntimeError, match=r"'feed_forward\.w2'.*more than one"):
        _grads(model, "selective")
    assert _grads(model, "none")  # the block itself is fine


def test_a_dropped_module_without_its_matmul_fails_loudly():
    """A biased down projection runs addmm, not the matmul the policy drops."""
    block = _block()
    block.feed_forward.w2 = nn.Linear(CFG.hidden_dim, CFG.dim, bias=True)
    x = torch.randn(1, 4, CFG.dim, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"'feed_forward\.w2'.*ran none"):
        recompute(block.body, x, keep=LLAMA.selective, root=block)


def _block() -> Block:
    block = Block(CFG)
    for p in block.parameters():
        nn.init.normal_(p, std=0.02)
    return block


def test_a_policy_naming_a_missing_module_fails_loudly():
    block = _block()
    x = torch.randn(1, 4, CFG.dim, requires_grad=True)
    policy = Keep(keep={"attention.wq": "mm"}, drop={"mlp.down": "mm"})
    with pytest.raises(ValueError, match=r"'mlp\.down'.*Block does not have"):
        recompute(block.body, x, keep=policy, root=block)
