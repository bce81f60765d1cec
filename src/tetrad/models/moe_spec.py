"""The MoE family's `ModelSpec`: FLOPs of active parameters (`models/flops.py`, whose
counts take a mixture of experts), activation estimates, names."""

from __future__ import annotations

import dataclasses

from tetrad.config import DTYPE_BYTES, ModelConfig
from tetrad.models import llama_activations
from tetrad.models.flops import active_ffn, swiglu_linears
from tetrad.models.flops import block_linears as llama_block_linears
from tetrad.models.llama_spec import HF_NAMES as LLAMA_NAMES
from tetrad.models.llama_spec import LLAMA, QK_NORM_NAMES, QK_NORM_PLAN, swiglu_names
from tetrad.models.moe import (
    STAT_EXTRA,
    Experts,
    Router,
    grouped_linear,
    grouped_weight_grad,
    keep_selective,
    meta_moe,
    param_shape,
    set_aux_scale,
    set_recompute,
)
from tetrad.models.moe import moe_layers as moe_feed_forwards
from tetrad.models.plans import MOE_PLAN
from tetrad.models.spec import MoEParts, Saved


def block_linears(m: ModelConfig, t: int) -> dict[str, tuple[int, int]]:
    """(K, N) per token of an MoE block's matmuls on one tp rank: the k routed experts'
    matmuls as one of width k·expert_dim/t (experts are not split by tp, but each tp rank
    runs them for 1/t of the tokens, parallel/expert.py), the shared ones split like a
    dense SwiGLU."""
    h = m.dim
    routed = m.top_k * m.expert_dim // t
    shared = m.shared_experts * m.expert_dim // t
    dense = llama_block_linears(m, t)
    out = {k: v for k, v in dense.items() if k.startswith("attention.")}
    out |= {"feed_forward.router": (h, m.experts)}
    out |= swiglu_linears("feed_forward.experts", h, routed)
    return out | (swiglu_linears("feed_forward.shared", h, shared) if shared else {})


# the routed experts' linears in `block_linears` and their side of one expert's width: w1
# and w3 widen to it, w2 contracts over it
ROUTED_LINEARS = {
    "feed_forward.experts.w1": "n",
    "feed_forward.experts.w3": "n",
    "feed_forward.experts.w2": "k",
}


def routing(m: ModelConfig, c: int) -> list[Saved]:
    """What an MoE layer's router and dispatch keep a token (c: the compute dtype's bytes),
    live at the end of forward, as a live count finds it (tests/test_plan_activations.py,
    softmax and sigmoid routers): the fp32 scores (softmax's or sigmoid's output), the
    sort's int64 indices over every expert (the choice sorts them all; the ids are a view
    of them), the chosen scores and their sum (renormalised), the weights in the compute
    dtype and the k expert outputs they weight; the dispatch's two int64 orders and the k
    token copies entering the experts; the int32 group ends of the three grouped expert
    matmuls, a microbatch; under a narrower compute dtype the router's fp32 input and, a
    microbatch, its fp32 weight. The group-limited choice's own tensors (group scores,
    their sort, the mask) feed only the ids and are freed.

    Under tp without sp every tp rank routes all the tokens and weights the joined
    outputs ("seq") but dispatches 1/tp of them ("tp", parallel/expert.py); under sp a tp
    rank holds its s/tp tokens for all of it. Not counted: the auxiliary loss's per-sequence
    tensors (8·experts + 4 bytes a sequence; a `Saved` has no per-sequence bytes)."""
    e, k, d = m.experts, m.top_k, m.dim
    router = 12 * e + 4 * k + (4 if m.norm_topk_prob else 0) + c * k + c * k * d
    items = [
        Saved("routing: scores, sort, chosen, weights, expert outputs", router, "seq"),
        Saved("dispatch: orders, token copies", 2 * 8 * k + c * k * d, "tp"),
        Saved("grouped matmuls' group ends", split="rank", fixed=3 * 4 * e),
    ]
    if c < 4:
        items.append(Saved("router's fp32 input", 4 * d, "seq"))
        items.append(Saved("router's fp32 weight", split="rank", fixed=4 * e * d))
    return items


class MoEActivations:
    """Saved-tensor estimates of an MoE block (models/spec.ActivationFormulas): the dense
    formulas with the SwiGLU at the active width (each routed copy keeps its SwiGLU's
    tensors) plus the routing's own (`routing`). Exact at tp 1 for an MoE block (a live
    count, tests/test_plan_activations.py); the dense layers of `dense_layers` are priced
    as MoE layers, and the load is taken as perfectly balanced."""

    @staticmethod
    def _dense(m: ModelConfig) -> ModelConfig:
        return dataclasses.replace(m, family="llama", experts=0, ffn_dim=active_ffn(m))

    def layer(self, m: ModelConfig, t: int, dtype: str, recompute: str = "none",
              sp_shards: bool = False, fused: bool = False,
              gqa_native: bool = False) -> list[Saved]:  # fmt: skip
        items = llama_activations.layer(
            self._dense(m), t, dtype, recompute, sp_shards, fused, gqa_native
        )
        if recompute == "full":
            return items
        return items + routing(m, DTYPE_BYTES[dtype])

    def pending_w(self, m: ModelConfig, t: int, dtype: str) -> list[Saved]:
        return llama_activations.pending_w(self._dense(m), t, dtype)

    def __getattr__(self, name: str):
        # the rest as the dense family's: the head, the embedding, the scores, cp's keys,
        # the stage output, and the rotary tables the microbatches in flight share (the
        # attention is Llama's, its tables kept by the layer)
        return getattr(llama_activations, name)


# tetrad parameter -> Hugging Face name, as a MixtralForCausalLM checkpoint stores it
# ("{j}": one tensor per expert, stacked along tetrad's first dimension)
MIXTRAL_NAMES = {
    **LLAMA_NAMES,
    "layers.{i}.feed_forward.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "layers.{i}.feed_forward.experts.w1": "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
    "layers.{i}.feed_forward.experts.w3": "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
    "layers.{i}.feed_forward.experts.w2": "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight",
}
# an MoE feed-forward as Qwen3-MoE and DeepSeek-V3 name it: router and experts under `mlp`
MLP_MOE_NAMES = {
    "layers.{i}.feed_forward.router.weight": "model.layers.{i}.mlp.gate.weight",
    **swiglu_names("layers.{i}.feed_forward.experts", "model.layers.{i}.mlp.experts.{j}", ""),
}
# ... and as a Qwen3MoeForCausalLM checkpoint stores them (its dense layers keep Llama's names)
QWEN3_MOE_NAMES = {**LLAMA_NAMES, **QK_NORM_NAMES, **MLP_MOE_NAMES}


# Llama's decoder with expert feed-forwards: its module roles (embedding, blocks, norm,
# head, tied weight, attention core) are Llama's, the rest is the family's own
MOE = dataclasses.replace(
    LLAMA,
    family="moe",
    build=meta_moe,
    # attention, dense layers, shared experts; routed experts: parallel/expert
    tp_plan={**MOE_PLAN, **QK_NORM_PLAN},
    selective=keep_selective(ModelConfig(family="moe", experts=2, shared_experts=1)),
    set_recompute=set_recompute,
    full_shape=param_shape,
    block_linears=block_linears,
    activations=MoEActivations(),
    routed_linears=ROUTED_LINEARS,
    hf_names=MIXTRAL_NAMES,  # Qwen3-MoE's: interop/hf.py, by `model_type`
    moe=MoEParts(
        router=Router,
        experts=Experts,
        grouped_linear=grouped_linear,
        grouped_weight_grad=grouped_weight_grad,
        layers=moe_feed_forwards,
        set_aux_scale=set_aux_scale,
        stat_extra=STAT_EXTRA,
    ),
)
