"""Llama's `ModelSpec`: what parallel and planning code may know of the dense family."""

from __future__ import annotations

import dataclasses

from tetrad.models import llama_activations
from tetrad.models.flops import block_linears, flops_per_token, layer_costs
from tetrad.models.llama import (
    KEEP_SELECTIVE,
    RMSNorm,
    apply_rotary,
    meta_llama,
    param_shape,
    rotary_at,
    set_recompute,
)
from tetrad.models.plans import LLAMA_PLAN
from tetrad.models.spec import ModelSpec, Rotary


def swiglu_names(tetrad: str, hf: str, suffix: str = ".weight") -> dict[str, str]:
    """The Hugging Face names (gate_proj, up_proj, down_proj under `hf`) of the SwiGLU at
    tetrad path `tetrad` (its w1, w3, w2, each followed by `suffix`)."""
    projections = {"w1": "gate", "w3": "up", "w2": "down"}
    return {f"{tetrad}.{w}{suffix}": f"{hf}.{p}_proj.weight" for w, p in projections.items()}


# tetrad parameter -> Hugging Face LlamaForCausalLM parameter ("{i}": the block index)
HF_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    **{
        f"layers.{{i}}.attention.w{x}.weight": f"model.layers.{{i}}.self_attn.{x}_proj.weight"
        for x in "qkvo"
    },
    **swiglu_names("layers.{i}.feed_forward", "model.layers.{i}.mlp"),
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}
# Qwen3's QK-norm gains and Qwen2's q, k, v biases, as their checkpoints name them
QK_NORM_NAMES = {
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
QKV_BIAS_NAMES = {
    f"layers.{{i}}.attention.w{x}.bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias"
    for x in "qkv"
}
# QK-norm's gains are norms inside the attention region: each tp rank normalises its own
# heads, so parallel/tensor.py sums their gradients over tp (with or without SP)
QK_NORM_PLAN = {"layers.*.attention.q_norm": "sequence", "layers.*.attention.k_norm": "sequence"}

LLAMA = ModelSpec(
    family="llama",
    build=meta_llama,
    embedding="tok_embeddings",
    blocks="layers",
    final_norm="norm",
    head="output",
    tied_weight="tok_embeddings.weight",
    attention_core="layers.*.attention.core",
    tp_plan={**LLAMA_PLAN, **QK_NORM_PLAN},
    selective=KEEP_SELECTIVE,
    set_recompute=set_recompute,
    full_shape=param_shape,
    layer_costs=layer_costs,
    flops_per_token=flops_per_token,
    block_linears=block_linears,
    activations=llama_activations,
    hf_names=HF_NAMES,
    norm_class=RMSNorm,
    rotary=Rotary(tables=rotary_at, apply=apply_rotary),
)

# Llama's decoder as other Hugging Face families write it. The model is the same, its config
# switches (qk_norm, qkv_bias, sliding_window) say what differs; the family names the
# parameters and the class a model is exported as (interop/hf.py)
MISTRAL = dataclasses.replace(LLAMA, family="mistral")
QWEN2 = dataclasses.replace(LLAMA, family="qwen2", hf_names={**HF_NAMES, **QKV_BIAS_NAMES})
QWEN3 = dataclasses.replace(LLAMA, family="qwen3", hf_names={**HF_NAMES, **QK_NORM_NAMES})
