"""DeepSeek-V3's `ModelSpec`: the MoE family's, with multi-head latent attention.

FLOPs count what a token computes: MLA's five projections (q down and up, kv down and
up, out), scores over nope + rope channels and values of v_head_dim, then the feed-forward
as in the MoE family (dense SwiGLUs first, then the router and the active experts).
"""

from __future__ import annotations

import dataclasses
import functools

from tetrad.config import DTYPE_BYTES, ModelConfig
from tetrad.models import flops, llama_activations, moe_spec
from tetrad.models.llama import rotary_at
from tetrad.models.llama_spec import HF_NAMES as LLAMA_NAMES
from tetrad.models.llama_spec import swiglu_names
from tetrad.models.mla import apply_rotary_tail, keep_mla, meta_deepseek
from tetrad.models.moe import param_shape as moe_shape
from tetrad.models.moe_spec import MLP_MOE_NAMES, MOE, MoEActivations
from tetrad.models.plans import MOE_PLAN
from tetrad.models.spec import Rotary, Saved


def mla_attention_sizes(m: ModelConfig) -> tuple[int, int]:
    """(weights of one MLA layer's matmuls: its linears' K·N, `block_linears` on one tp
    rank; channels a query meets per position over all heads: q·kᵀ over nope + rope, p·v)."""
    linears = block_linears(m, 1).items()
    weights = sum(k * n for name, (k, n) in linears if name.startswith("attention."))
    return weights, m.heads * (m.qk_nope_dim + m.qk_rope_dim + m.v_head_dim)


# the counts every family shares (models/flops.py), MLA's attention in them
matmul_params = functools.partial(flops.matmul_params, attention=mla_attention_sizes)
flops_per_token = functools.partial(flops.flops_per_token, attention=mla_attention_sizes)
layer_costs = functools.partial(flops.layer_costs, attention=mla_attention_sizes)


def block_linears(m: ModelConfig, t: int) -> dict[str, tuple[int, int]]:
    """(K, N) per token of an MLA MoE block's matmuls on one tp rank: the down
    projections whole (replicated: every tp rank runs them; under SP on its s/t of the
    tokens, which this per-token count does not see), the up projections' and wo's heads
    1/t each; the feed-forward as the MoE family's."""
    h, d, r = m.heads // t, m.dim, m.q_lora_rank
    out = {"attention.wq_a": (d, r)} if r else {}
    out |= {
        "attention.wq_b": (r or d, h * (m.qk_nope_dim + m.qk_rope_dim)),
        "attention.wkv_a": (d, m.kv_lora_rank + m.qk_rope_dim),
        "attention.wkv_b": (m.kv_lora_rank, h * (m.qk_nope_dim + m.v_head_dim)),
        "attention.wo": (h * m.v_head_dim, d),
    }
    ffn = moe_spec.block_linears(m, t)
    return out | {k: v for k, v in ffn.items() if not k.startswith("attention.")}


def param_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of the logical parameter `name` of a DeepSeek-V3 model: an attention linear's
    weight [N, K] of its (K, N) at tp 1 (`block_linears`), the latent norms' gains; the
    rest as the MoE family's."""
    linears = block_linears(cfg, 1).items()
    attention = [(p.split(".")[-1], (n, k)) for p, (k, n) in linears if p.startswith("attention.")]
    shapes = dict(attention, q_a_norm=(cfg.q_lora_rank,), kv_a_norm=(cfg.kv_lora_rank,))
    parts = name.split(".")
    if "attention" in parts and parts[-2] in shapes:
        return shapes[parts[-2]]
    return moe_shape(name, cfg)


# the dense formulas' attention items, which MLA's replace (llama_activations.layer)
LLAMA_ATTENTION = ("attention norm", "qkv input", "rotary cos/sin", "sdpa q, out",
                   "attention k, v", "sdpa log-sum-exp", "QK-norm", "gathered k, v weights",
                   "block input", "k, v", "attention out", "attention log-sum-exp",
                   "wo out (partial sum under tp)")  # fmt: skip


def _norm(c: int, width: int, copy: int) -> float:
    """An RMSNorm's saved bytes a token: its fp32 input (`copy` bytes: itself in fp32, a
    view of a wider output then), the normalised value, the fp32 rsqrt."""
    return copy + c * width + 4


def mla_attention(m: ModelConfig, t: int, c: int) -> list[Saved]:
    """What an MLA block's attention saves, a token (c: the compute dtype's bytes), as a
    live count finds it (tests/test_plan_activations.py): the attention norm; the down
    projections' input (x, on the rank's s/t under SP); the latent norms (in fp32 the kv
    norm's input is a view of wkv_a's whole output, latent and rotary key); the latents
    entering the heads (one tensor under tp: q latent, kv latent and rotary key
    concatenated, the region's entry; apart without tp, where x is wq_b's own input
    without a query bottleneck); the rotary table of the rope channels; the attention
    kernel's q, k, v and output, each head padded to the wider of q·k's and v's head size
    (the flash kernels take one), and its log-sum-exp; wo's input."""
    d, r_q, r_kv, rope = m.dim, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_dim
    heads, width = m.heads, max(m.qk_nope_dim + rope, m.v_head_dim)
    entered = (r_q or d) + r_kv + rope if t > 1 else r_q + r_kv
    items = [
        Saved("attention norm", _norm(c, d, 4 * d), "seq"),
        Saved("down projections' input", c * d, "seq"),
        Saved("kv latent norm", _norm(c, r_kv, 4 * (r_kv + (rope if c == 4 else 0))), "seq"),
        Saved("latents entering the heads", c * entered, "rank"),
        Saved("rotary cos/sin", per_position=4 * rope, split="rank"),
        Saved("attention q, k, v, out (padded)", 4 * c * heads * width, "tp"),
        Saved("attention log-sum-exp", 4 * heads, "tp"),
        Saved("wo input", c * heads * m.v_head_dim, "tp"),
    ]
    if r_q:
        items.insert(2, Saved("q latent norm", _norm(c, r_q, 4 * r_q), "seq"))
    return items


class MLAActivations(MoEActivations):
    """The MoE family's estimates with MLA's attention (`mla_attention`) in place of the
    dense block's; other parts (the head, zero-bubble's pending W) priced as a block of
    `heads` query and key heads of nope + rope channels."""

    SHARED_ACROSS_MICROBATCHES = ()  # MLA makes its rotary tables at every call

    @staticmethod
    def _dense(m: ModelConfig) -> ModelConfig:
        qk = m.qk_nope_dim + m.qk_rope_dim
        return dataclasses.replace(MoEActivations._dense(m), head_size=qk, kv_heads=m.heads)

    def layer(self, m: ModelConfig, t: int, dtype: str, recompute: str = "none",
              sp_shards: bool = False, fused: bool = False,
              gqa_native: bool = False) -> list[Saved]:  # fmt: skip
        items = super().layer(m, t, dtype, recompute, sp_shards, fused, gqa_native)
        if recompute in ("full", "op"):  # the block input; torchtitan's policy, as dense
            return items
        c = DTYPE_BYTES[dtype]  # the feed-forward's items, its routing's (moe_spec.routing)
        ffn = [it for it in items if it.name not in LLAMA_ATTENTION]
        if recompute == "selective":  # the policy keeps the core's output and wo's
            return self._selective(m, c) + ffn
        return mla_attention(m, t, c) + ffn

    def cp_gathered_kv(self, m: ModelConfig, t: int, dtype: str, cp: int, seq_len: int,
                       gqa_native: bool = False) -> list[Saved]:  # fmt: skip
        """The dense formula's, the other shards' keys and values at MLA's widths: per head
        nope + rope key channels and v_head_dim value channels, side by side."""
        items = llama_activations.cp_gathered_kv(m, t, dtype, cp, seq_len, gqa_native)
        width = (m.heads // t) * (m.qk_nope_dim + m.qk_rope_dim + m.v_head_dim)
        kv = Saved("other shards' k, v", DTYPE_BYTES[dtype] * width * (cp - 1), "rank")
        return [kv if it.name == kv.name else it for it in items]

    @staticmethod
    def _selective(m: ModelConfig, c: int) -> list[Saved]:
        width = max(m.qk_nope_dim + m.qk_rope_dim, m.v_head_dim)
        return [
            Saved("block input", c * m.dim, "seq"),
            Saved("attention out (padded)", c * m.heads * width, "tp"),
            Saved("attention log-sum-exp", 4 * m.heads, "tp"),
            Saved("wo out (partial sum under tp)", c * m.dim, "rank"),
        ]


ATTENTION_NAMES = {
    "wq_a.weight": "q_a_proj.weight",
    "q_a_norm.weight": "q_a_layernorm.weight",
    "wq_b.weight": "q_b_proj.weight",
    "wkv_a.weight": "kv_a_proj_with_mqa.weight",
    "kv_a_norm.weight": "kv_a_layernorm.weight",
    "wkv_b.weight": "kv_b_proj.weight",
    "wo.weight": "o_proj.weight",
}
# tetrad parameter -> Hugging Face name, as a DeepseekV3ForCausalLM checkpoint stores it
HF_NAMES = {
    **{k: v for k, v in LLAMA_NAMES.items() if ".attention." not in k},
    **{f"layers.{{i}}.attention.{k}": f"model.layers.{{i}}.self_attn.{v}" for k, v in
       ATTENTION_NAMES.items()},
    **MLP_MOE_NAMES,
    "layers.{i}.feed_forward.router.expert_bias":  # a buffer: HFWeights.read_buffer
        "model.layers.{i}.mlp.gate.e_score_correction_bias",
    **swiglu_names("layers.{i}.feed_forward.shared", "model.layers.{i}.mlp.shared_experts"),
}  # fmt: skip
# without a query bottleneck (q_lora_rank 0) the one query projection is q_proj
PLAIN_Q_NAMES = {
    **HF_NAMES,
    "layers.{i}.attention.wq_b.weight": "model.layers.{i}.self_attn.q_proj.weight",
}


# Latent attention under tp: the heads split (wq_b and wkv_b column-wise, wo row-wise);
# the down projections and their norms, which every head reads, stay before the region
# (`sequence`: replicated without SP; under SP on each rank's s/tp, their weights'
# gradients summed over tp). The attention module enters the region after them, on the
# narrow latents (its `use_entry`), not on the full-width input (docs/models.md).
MLA_PLAN = {
    **{k: v for k, v in MOE_PLAN.items() if not k.startswith("layers.*.attention.")},
    "layers.*.attention.wq_a": "sequence",
    "layers.*.attention.q_a_norm": "sequence",
    "layers.*.attention.wq_b": "colwise",
    "layers.*.attention.wkv_a": "sequence",
    "layers.*.attention.kv_a_norm": "sequence",
    "layers.*.attention.wkv_b": "colwise",
    "layers.*.attention.wo": "rowwise",
}


def attention_entry(m: ModelConfig) -> tuple[int, int]:
    """The latents enter the tp region (docs/models.md): the q latent (or, without the
    query bottleneck, the input), the kv latent and the shared rotary key; under SP the
    down projections' and latent norms' weight gradients are summed over tp."""
    q = m.q_lora_rank or m.dim
    down = m.dim * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim)
    return q + m.kv_lora_rank + m.qk_rope_dim, down + m.q_lora_rank + m.kv_lora_rank


# the MoE family with latent attention: its router (sigmoid, bias, group-limited) and
# experts are the MoE family's
DEEPSEEK_V3 = dataclasses.replace(
    MOE,
    family="deepseek_v3",
    build=meta_deepseek,
    tp_plan=MLA_PLAN,
    selective=keep_mla(ModelConfig(family="deepseek_v3", experts=2, shared_experts=1), True),
    full_shape=param_shape,
    layer_costs=layer_costs,
    flops_per_token=flops_per_token,
    block_linears=block_linears,
    activations=MLAActivations(),
    # the core's last qk_rope_dim channels of each head rotate (cp: at global positions)
    rotary=Rotary(tables=rotary_at, apply=apply_rotary_tail),
    hf_names=HF_NAMES,  # without q_lora_rank: PLAIN_Q_NAMES (interop/hf.py)
    attention_entry=attention_entry,
)
