"""`ModelSpec`: everything parallel and planning code may know about a model family.

A family (dense Llama today) lives in `models/` and declares one `ModelSpec` beside its
model; `models/families.py` finds it from a `ModelConfig`. Parallel code reads module
roles, the tied weight, the tensor-parallel plan, ZeRO's unit order, the recompute
policy, the cost and activation formulas and the Hugging Face names from the spec and
never spells a parameter name itself, so a new family adds files here, not in parallel/.

What the spec cannot say, the family's model class provides (the interface the engine
calls): `first`, `last` and `logits` flags, `forward_span(x, layers, embed, head)`,
`head_weight()`, `keep_stage(layers, dropped_roots, embeds, heads)`, and its blocks in
a `ModuleDict` keyed by `str(layer index)` at `blocks`.
The pieces parallel code changes the behaviour of (the norm under sequence parallelism,
rotary under context parallelism, an MoE layer's router and experts under sequence
parallelism and zero-bubble) it reaches through the spec too (`norm_class`, `rotary`, `moe`),
and calls only through the seams documented here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from tetrad.config import ModelConfig

# recomputation modes the planner's formulas take: the engine's, and "op" (torchtitan's
# per-op policy, for the planner's comparisons)
RECOMPUTE = ("none", "selective", "full", "op")


def check_recompute(recompute: str) -> None:
    """Refuse a recomputation mode the formulas do not know."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")


@dataclass(frozen=True)
class Saved:
    """A tensor kept for backward: bytes per token, per position (independent of the
    microbatch size), per microbatch (fixed), and how tp divides it ("tp": 1/t always;
    "seq": 1/t under sequence parallelism; "rank": what one tp rank holds)."""

    name: str
    per_token: float = 0.0
    split: str = "tp"
    per_position: float = 0.0
    fixed: float = 0.0


@dataclass(frozen=True)
class Keep:
    """Selective recomputation's policy for a block: the kernels its rerun does not redo,
    by the module (a path inside the block) that runs them and the kernel's kind ("mm": a
    linear's matmul, "attention": a fused attention kernel). `keep`: the first such kernel
    of the module, its output saved in forward. `drop`: the module's one such kernel,
    whose output no backward reads (it only feeds a residual sum): nothing saved, an
    uninitialised tensor in the rerun (models/recompute.py checks there is exactly one)."""

    keep: Mapping[str, str] = field(default_factory=dict)
    drop: Mapping[str, str] = field(default_factory=dict)

    def modules(self) -> dict[str, tuple[str, str]]:
        """Module path -> (kernel kind, "keep" or "drop")."""
        keep = {name: (kind, "keep") for name, kind in self.keep.items()}
        return keep | {name: (kind, "drop") for name, kind in self.drop.items()}


class ActivationFormulas(Protocol):
    """Bytes a family's pieces save for backward, per token (`Saved` lists), for the
    memory planner; `t` is the tp degree, `dtype` the compute dtype's name.
    `SHARED_ACROSS_MICROBATCHES`: the names of a block's items made once and kept by the
    layer, which a stage's microbatches in flight share (none: an empty tuple)."""

    SHARED_ACROSS_MICROBATCHES: tuple[str, ...]

    def layer(self, m: ModelConfig, t: int, dtype: str, recompute: str = "none",
              sp_shards: bool = False, fused: bool = False,
              gqa_native: bool = False) -> list[Saved]: ...  # fmt: skip

    def attention_scores(self, m: ModelConfig, seq_len: int) -> list[Saved]: ...

    def cp_gathered_kv(self, m: ModelConfig, t: int, dtype: str, cp: int, seq_len: int,
                       gqa_native: bool = False) -> list[Saved]: ...  # fmt: skip

    def head(self, m: ModelConfig, t: int, dtype: str, sp_shards: bool = False,
             chunked: bool = False) -> list[Saved]: ...  # fmt: skip

    def embedding(self, t: int, dtype: str) -> list[Saved]: ...

    def pending_w(self, m: ModelConfig, t: int, dtype: str) -> list[Saved]: ...

    def pending_w_head(self, m: ModelConfig, t: int, dtype: str) -> list[Saved]: ...

    def stage_output(self, m: ModelConfig, dtype: str) -> list[Saved]: ...


@dataclass(frozen=True)
class Rotary:
    """The family's rotary position embedding, which context parallelism applies at a
    rank's global positions: `tables(positions, head_dim, theta)` -> the tables of those
    positions; `apply(x, tables)` -> x [b, s, heads, head_dim] rotated."""

    tables: Callable[[torch.Tensor, int, float], torch.Tensor]
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MoEParts:
    """A mixture-of-experts family's layers as parallel and training code reach them.

    `router`: the router class, with a `weight` and `use_logits(fn)` (fn: x [T, d] -> the
    fp32 logits [T, E] of `F.linear` by the weight; sequence parallelism and zero-bubble
    change how the weight meets the tokens, not what the router computes) and `logits_fn`
    (what it installed). `experts`: the routed experts' class, with stacked weights and
    `use_matmul(fn)`, fn computing `grouped_linear(x, weight, counts)` (an expert weight
    [n, out, in] over the token groups of `counts`); `grouped_weight_grad(x, grad, counts)`,
    that weight's gradient [n, out, in] by itself (zero-bubble's W). `layers(model)`: a model's MoE
    feed-forwards by block index (a pipeline stage holds some); each has `stats` (its
    step's statistics, [experts + stat_extra] float64, or None), `reset_stats()` and
    `router.update_bias(load, rate)`.
    `set_aux_scale(model, sequences)`: the auxiliary loss as a mean over the global batch's
    sequences."""

    router: type[nn.Module]
    experts: type[nn.Module]
    grouped_linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    grouped_weight_grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    layers: Callable[[nn.Module], dict[int, nn.Module]]
    set_aux_scale: Callable[[nn.Module, int], None]
    stat_extra: int  # statistics of a layer after the per-expert loads


@dataclass(frozen=True)
class ModelSpec:
    """A model family as parallel code sees it. Module paths are dotted, relative to the
    model (`embedding`, `final_norm`, `head`, `blocks`) or to a block (the recompute
    policy, `block_linears`' keys); tp plan patterns as in models/plans.py."""

    family: str
    build: Callable[[ModelConfig], nn.Module]  # the whole model on the meta device
    embedding: str  # the token embedding (first stage)
    blocks: str  # the ModuleDict of transformer blocks
    final_norm: str  # the norm before the head (last stage)
    head: str  # the output projection; None on the model when tied to the embedding
    tied_weight: str  # the parameter a tied head reuses
    attention_core: str  # plan pattern of the modules context parallelism swaps
    tp_plan: Mapping[str, str]
    selective: Keep
    set_recompute: Callable[[nn.Module, str], None]  # "none", "selective" or "full"
    full_shape: Callable[[str, ModelConfig], tuple[int, ...]]  # a logical parameter's
    # analytic FLOPs of one sequence, forward + backward: [embedding, layers..., head+loss]
    layer_costs: Callable[[ModelConfig, int], list[float]]
    flops_per_token: Callable[[ModelConfig, int], float]  # (cfg, seq_len), for MFU
    # (K, N) of each linear of a block on one tp rank, by module path, in forward order
    block_linears: Callable[[ModelConfig, int], dict[str, tuple[int, int]]]
    activations: ActivationFormulas
    # parameter -> Hugging Face name; "{i}" is a block index, and "{j}" (a stacked tensor,
    # such as an MoE layer's experts) the index along its first dimension
    hf_names: Mapping[str, str]
    # the norm class (every one is a weight-carrying module the tp plan must cover), with a
    # gain `weight` and `use_gain(fn)`: its forward then multiplies by fn(weight) (sequence
    # parallelism passes the gain through the tp region)
    norm_class: type[nn.Module]
    rotary: Rotary  # what context parallelism's attention cores rotate with
    moe: MoEParts | None = None  # the router and experts, in a mixture-of-experts family
    # the routed experts' linears among `block_linears`' keys, each with the side ("k" or
    # "n") that is one expert's width: the planner prices them as grouped GEMMs, one matmul
    # an expert of that width (block_linears gives the k experts' sum on a tp rank)
    routed_linears: Mapping[str, str] = field(default_factory=dict)
    # (cfg) -> (channels a token brings into the attention's tp region, elements of the
    # weight gradients summed over tp under SP before it): the planner's tp bytes. None:
    # the block's input (dim), nothing summed but the norms' gains
    attention_entry: Callable[[ModelConfig], tuple[int, int]] | None = None

    @property
    def roots(self) -> tuple[str, ...]:
        """The modules outside the blocks, in the order forward uses them (ZeRO's root
        unit gathers and hooks them in this order)."""
        return (self.embedding, self.final_norm, self.head)

    def block_prefix(self, layer: str | int) -> str:
        """The parameter-name prefix of block `layer`."""
        return f"{self.blocks}.{layer}."

    def block_of(self, name: str) -> str | None:
        """The block path ("<blocks>.<i>") parameter or module `name` lies in, or None."""
        head, _, rest = name.partition(self.blocks + ".")
        if head or not rest:
            return None
        return self.blocks + "." + rest.split(".", 1)[0]

    def stage_roots(self, embeds: bool, heads: bool, tied: bool) -> tuple[str, ...]:
        """Root modules a pipeline stage holds: the embedding on the first stage (and on
        the last when the head reuses it), the final norm and the head on the last."""
        first = (self.embedding,) if embeds or (heads and tied) else ()
        return first + ((self.final_norm, self.head) if heads else ())

    def stage_parameters(
        self, names: Sequence[str], layers: Sequence[str], embeds: bool, heads: bool
    ) -> set[str]:
        """The parameters of `names` that a stage with these blocks and ends uses."""
        tied = not any(n.startswith(self.head + ".") for n in names)
        prefixes = [self.block_prefix(layer) for layer in layers]
        prefixes += [root + "." for root in self.stage_roots(embeds, heads, tied)]
        return {n for n in names if n.startswith(tuple(prefixes))}

    def prune(self, model: nn.Module, layers: Sequence[str], embeds: bool, heads: bool) -> None:
        """Make `model` (on the meta device) a pipeline stage's part: the blocks `layers`,
        the root modules a stage with these ends uses (the model's own `keep_stage`)."""
        tied = module_at(model, self.head) is None
        keep = set(self.stage_roots(embeds, heads, tied))
        model.keep_stage(layers, [r for r in self.roots if r not in keep], embeds, heads)

    def hf_name(self, name: str) -> str:
        """The Hugging Face name of parameter `name`."""
        if name in self.hf_names:
            return self.hf_names[name]
        block = self.block_of(name)
        if block is None:
            raise KeyError(f"{self.family}: no Hugging Face name for {name!r}")
        index = block.rsplit(".", 1)[1]
        # replaced, not formatted: a name may hold other fields ("{j}": an expert's index)
        return self.hf_names[self.block_prefix("{i}") + name[len(block) + 1 :]].replace(
            "{i}", index
        )


def module_at(model: nn.Module, path: str) -> nn.Module | None:
    """The module at dotted `path`, or None where an attribute on the way is None."""
    return functools.reduce(
        lambda module, part: getattr(module, part, None), path.split("."), model
    )
