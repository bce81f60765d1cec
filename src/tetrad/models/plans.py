"""Tensor-parallel sharding plans, as data: module-name patterns -> styles.

A plan says *what* each module is; `tetrad.parallel.tensor.apply_tp` decides how that is
carried out (which weight dimension is split, which collective goes where). Patterns are
dotted module names in which `*` matches exactly one name component (`layers.*.attention`).

Styles:
- `colwise`: a linear whose output features are split over tp; its input must already be
  in the tp region (replicated, or gathered along the sequence with SP).
- `kv`: a key or value projection: column-wise by whole kv heads when tp divides kv_heads;
  when kv_heads < tp each head is computed by the tp/kv_heads ranks that need it.
- `rowwise`: a linear whose input features are split; its partial outputs are summed
  (all-reduce, or reduce-scatter along the sequence with SP).
- `vocab`: an embedding or output head split over the vocabulary; the head's logits stay
  split and feed the vocabulary-parallel cross-entropy.
- `region`: a module whose (single) input enters the tp region once for all the column-wise
  linears inside it (identity forward / all-reduce backward, or all-gather with SP).
- `sequence`: a norm that works on s/tp of the sequence under SP (replicated otherwise);
  its weight's gradient is summed over tp. Inside a region (Qwen3's per-head q/k norms,
  after the column-wise projections) each tp rank normalises its own heads, so the
  gradient is partial and summed over tp with or without SP.
- `replicated`: identical on every tp rank; nothing to do.
- `once`: a replicated module inside a region (an MoE layer's router): every tp rank
  computes it alike, and its input gradient is counted on one tp rank only, so the
  region's sum of partial gradients stays exact. Under SP an MoE layer is no region (each
  tp rank routes its own s/tp of the tokens): the router's weight gradient, partial on
  each rank, is summed over tp instead, as a `sequence` norm's.
- `tokens`: an MoE layer's shared expert. Without SP it is inside the layer's region;
  under SP it is a region of its own over the rank's tokens (all-gathered in, its
  row-wise output reduce-scattered back to the rank's tokens).
"""

from __future__ import annotations

STYLES = (
    "colwise", "kv", "rowwise", "vocab", "region", "sequence", "replicated", "once", "tokens",
)  # fmt: skip

# Megatron's split of a pre-norm Llama block: q/k/v and gate/up column-wise, o and down
# row-wise, so each half of the block costs one collective forward and one backward.
LLAMA_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab",
    "layers.*.attention_norm": "sequence",
    "layers.*.attention": "region",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "kv",
    "layers.*.attention.wv": "kv",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "sequence",
    "layers.*.feed_forward": "region",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "sequence",
    "output": "vocab",
}


# An MoE block (models/moe.py): attention and dense layers as Llama; in a mixture-of-experts
# feed-forward (itself a region) the shared expert split as a dense SwiGLU, the router
# replicated and counted once, and the routed experts left to the expert dispatcher, which
# splits the tokens over tp and leaves each rank the gradient of its share
# (parallel/expert.py). Under SP the tokens are split already: the layer is no region, the
# router routes and the dispatcher sends the rank's own tokens, and the shared expert alone
# gathers them (`tokens`).
MOE_PLAN: dict[str, str] = {
    **LLAMA_PLAN,
    "layers.*.feed_forward.router": "once",
    "layers.*.feed_forward.shared": "tokens",
    "layers.*.feed_forward.shared.w1": "colwise",
    "layers.*.feed_forward.shared.w3": "colwise",
    "layers.*.feed_forward.shared.w2": "rowwise",
}


def matches(pattern: str, name: str) -> bool:
    """Whether dotted `name` matches `pattern` component by component (`*` = any one)."""
    want, got = pattern.split("."), name.split(".")
    return len(want) == len(got) and all(w in ("*", g) for w, g in zip(want, got))


def style_of(name: str, plan: dict[str, str]) -> str | None:
    """The style the plan gives module `name`, or None when no pattern matches it."""
    found = [style for pattern, style in plan.items() if matches(pattern, name)]
    if len(found) > 1:
        raise ValueError(f"module {name!r} matches several plan entries: {found}")
    return found[0] if found else None


def assign(names: list[str], plan: dict[str, str]) -> dict[str, str]:
    """Style of every named module the plan covers, in the order given. Unknown styles are
    refused first (a typo must not silently leave a module unsharded)."""
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan entry {pattern!r}: unknown style {style!r}; known: {STYLES}")
    return {name: style for name in names if (style := style_of(name, plan)) is not None}


def decays(name: str) -> bool:
    """Weight decay applies to matrices, not to norm gains or biases (decided by logical
    name, as Megatron decides it)."""
    return not name.endswith(("norm.weight", ".bias"))
