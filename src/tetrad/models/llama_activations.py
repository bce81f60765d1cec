"""Activation bytes of tetrad's Llama, per token, as autograd actually saves them: the
family's `ActivationFormulas` (models/spec.py), which the memory planner reads.

Checked against a live count of saved tensors: RMSNorm keeps an fp32 copy of its input,
rotary keeps only the cos/sin table, flash attention keeps q, the repeated k and v, its
output and log-sum-exp (no s x s scores), SwiGLU keeps four f-wide tensors. Each item says
how tensor parallelism divides it (`Saved.split`).
"""

from __future__ import annotations

from tetrad.config import DTYPE_BYTES, ModelConfig
from tetrad.models.spec import Saved, check_recompute


def _local_heads(m: ModelConfig, t: int, gqa_native: bool = False) -> tuple[int, int, int]:
    """(query heads, kv heads) one tp rank computes (kv_heads < tp leaves one kv head
    each), and the width of its k (or v) as attention holds it: repeated to the query
    heads, unless the kernel reads kv heads natively (`gqa_native`)."""
    heads, kv = m.heads // t, max(m.kv_heads // t, 1)
    return heads, kv, (heads if heads > kv and not gqa_native else kv) * m.head_dim


def layer(
    m: ModelConfig, t: int, dtype: str, recompute: str = "none", sp_shards: bool = False,
    fused: bool = False, gqa_native: bool = False,
) -> list[Saved]:  # fmt: skip
    """One transformer block of tetrad's Llama on a tp rank (pass t=1 without tp).

    c is the compute dtype's bytes. In fp32 the norm's `x.float()` is its input itself,
    so the count (4 + c)·h covers both dtypes. The cos/sin table is made once per layer and
    kept per position, shared by the microbatches in flight (SHARED_ACROSS_MICROBATCHES).
    kv_heads < tp gathers the k and v weights for each forward and the linear keeps the
    gathered weight (a fixed cost per microbatch). sp_shards: the
    column-parallel linears keep their input's SP shard (Megatron) instead of the
    gathered whole (tetrad). fused: a fused RMSNorm keeps its c-byte input and the fp32
    rsqrt (no fp32 copy), a fused SwiGLU its two inputs and product (Transformer Engine,
    torch.compile), 3 f-wide tensors, not 4. gqa_native: the attention kernel keeps k
    and v as they are, not repeated to the query heads. Attention is heads·head_dim wide
    (Qwen3's differs from h); QK-norm keeps what a norm keeps, per head of q and k.
    """
    check_recompute(recompute)
    c, h, f, hd = DTYPE_BYTES[dtype], m.dim, m.hidden_dim, m.head_dim
    if recompute == "full":  # a checkpointed block keeps its input
        return [Saved("block input", c * h, "seq")]
    heads, kv, kv_width = _local_heads(m, t, gqa_native)  # kv_width: (repeated) k, v
    if recompute == "op":
        return _op_policy(m, c, heads)
    if recompute == "selective":
        return _selective(m, c, heads, kv)
    norm = c * h + 4 if fused else (4 + c) * h + 4  # (fp32 copy,) normalised, fp32 rsqrt
    linear_in = "seq" if sp_shards else "rank"
    items = [
        Saved("attention norm", norm, "seq"),
        Saved("qkv input", c * h, linear_in),
        Saved("ffn norm", norm, "seq"),
        Saved("w1/w3 input", c * h, linear_in),
        Saved("rotary cos/sin", per_position=4 * hd, split="rank"),
        Saved("sdpa q, out", 2 * c * m.heads * hd, "tp"),
        Saved("attention k, v", 2 * c * kv_width, "rank"),
        Saved("sdpa log-sum-exp", 4 * heads, "rank"),
        Saved("w1 out, w3 out, (silu out,) product", (3 if fused else 4) * c * f, "tp"),
    ]
    if m.qk_norm:  # (fp32 copies of) q and k, normalised, an fp32 rsqrt per head
        qk = (c if fused else 4 + c) * (heads + kv) * hd + 4 * (heads + kv)
        items.append(Saved("QK-norm", qk, "rank"))
    if m.kv_heads < t:
        items.append(
            Saved("gathered k, v weights", fixed=2 * c * m.kv_heads * hd * h, split="rank")
        )
    return items


def attention_scores(m: ModelConfig, seq_len: int) -> list[Saved]:
    """What attention without a flash kernel keeps per query token (Korthikanti's 5as/h
    term, 16-bit): the softmax output, the dropout's 1-byte mask and its output, one
    element per head and key position."""
    return [Saved("softmax out, dropout mask and out", 5 * m.heads * seq_len, "tp")]


def cp_gathered_kv(m: ModelConfig, t: int, dtype: str, cp: int, seq_len: int,
                   gqa_native: bool = False) -> list[Saved]:  # fmt: skip
    """What an all-gather context-parallel core keeps beyond the local layer, per local
    token: the other cp - 1 shards' keys and values (repeated to the query heads unless
    the kernel reads kv heads natively), which attention saves for its backward; and per
    local position the boolean causal mask against all `seq_len` global positions."""
    c, width = DTYPE_BYTES[dtype], _local_heads(m, t, gqa_native)[2]
    return [
        Saved("other shards' k, v", 2 * c * width * (cp - 1), "rank"),
        Saved("mask by global position", per_position=seq_len, split="rank"),
    ]


def _selective(m: ModelConfig, c: int, heads: int, kv: int) -> list[Saved]:
    """tetrad's selective recomputation (models/recompute.py): the block input, the kept
    kernel outputs (k and v, the attention output and log-sum-exp, wo's output before the
    tp reduction, over the whole sequence, and w1's); nothing else."""
    hd = m.head_dim
    return [
        Saved("block input", c * m.dim, "seq"),
        Saved("k, v", 2 * c * kv * hd, "rank"),
        Saved("attention out", c * heads * hd, "rank"),
        Saved("attention log-sum-exp", 4 * heads, "rank"),
        Saved("wo out (partial sum under tp)", c * m.dim, "rank"),
        Saved("w1 out (gate)", c * m.hidden_dim, "tp"),
    ]


def _op_policy(m: ModelConfig, c: int, heads: int) -> list[Saved]:
    """torchtitan's per-op selective checkpointing: the block input, flash attention's
    outputs and every other matmul output are kept; the rest is recomputed."""
    h, f, q, kv_dim = m.dim, m.hidden_dim, m.heads * m.head_dim, m.kv_heads * m.head_dim
    # matmul outputs: wq, wk, wv, w1, w3 (tp-split), wo, w2 (the reduced h, "seq")
    inner = q + 2 * kv_dim + 2 * f
    return [
        Saved("block input", c * h, "seq"),
        Saved("sdpa out", c * q, "tp"),
        Saved("sdpa log-sum-exp", 4 * heads, "rank"),
        Saved("half the tp-split matmul outputs", c * inner / 2, "tp"),
        Saved("half the row-parallel matmul outputs", c * h, "seq"),
    ]


def head(
    m: ModelConfig, t: int, dtype: str, sp_shards: bool = False, chunked: bool = False
) -> list[Saved]:
    """The last stage's final norm, head input and loss: the fp32 log-probabilities (tp=1,
    F.cross_entropy) or fp32 logits (vocabulary-parallel loss), 4·V/t bytes a token; or,
    `chunked` (tetrad's --loss-chunk), no logits at all: the head's input, one fp32
    log-sum-exp and the target's column and masks per token (models/loss.py)."""
    c, h = DTYPE_BYTES[dtype], m.dim
    items = [
        Saved("final norm", (4 + c) * h + 4, "seq"),
        Saved("head input", c * h, "seq" if sp_shards else "rank"),
    ]
    if chunked:
        return items + [Saved("log-sum-exp, target column, masks", 4 + 8 + 2, "rank")]
    return items + [
        Saved("fp32 logits", 4 * m.vocab, "tp"),
        Saved("targets, log-sum-exp", 8 + (6 if t > 1 else 0), "rank"),
    ]


def embedding(t: int, dtype: str) -> list[Saved]:
    """The first stage's token ids (and, under tp, the vocabulary mask)."""
    return [Saved("token ids", 8 + (DTYPE_BYTES[dtype] if t > 1 else 0), "rank")]


def pending_w(m: ModelConfig, t: int, dtype: str) -> list[Saved]:
    """What a zero-bubble schedule keeps between a block's B and its W: each deferred
    linear's input and output gradient. Under tp the column-parallel linears (wq, wk, wv,
    w1, w3) keep their whole input (gathered over the sequence under SP) and their
    output gradients' 1/t; the row-parallel ones (wo, w2) their inputs' 1/t and whole
    output gradients: h + q/t + h + f/t inputs, q/t + 2·kv/t + h + 2f/t + h gradients (q:
    the attention's width, heads·head_dim)."""
    c, h, f, q = DTYPE_BYTES[dtype], m.dim, m.hidden_dim, m.heads * m.head_dim
    kv_dim = max(m.kv_heads // t, 1) * m.head_dim * t  # the rank's kv heads, times t
    whole = c * (h + h) + c * (h + h)  # qkv and w1/w3 inputs; wo and w2 output grads
    shard = c * (q + f) + c * (q + 2 * kv_dim + 2 * f)  # wo, w2 inputs; wq/wk/wv, w1/w3 grads
    return [
        Saved("deferred column-parallel inputs, row-parallel output grads", whole, "rank"),
        Saved("deferred row-parallel inputs, column-parallel output grads", shard, "tp"),
    ]


def pending_w_head(m: ModelConfig, t: int, dtype: str) -> list[Saved]:
    """The head's share of a zero-bubble W when it is deferred (no chunked loss): its
    input (whole, gathered under SP) and its logits' gradient (the rank's 1/t of the
    vocabulary)."""
    c = DTYPE_BYTES[dtype]
    return [
        Saved("head input", c * m.dim, "rank"),
        Saved("logit gradient", c * m.vocab, "tp"),
    ]


def stage_output(m: ModelConfig, dtype: str) -> list[Saved]:
    """A pipeline stage's output [b, s(/t), h], held until its send completes."""
    return [Saved("stage output awaiting its send", DTYPE_BYTES[dtype] * m.dim, "seq")]


# The block items a stage's microbatches in flight share, held once however many there
# are: each layer's attention core makes its rotary tables once per (s, device) and every
# microbatch's backward reads the same (models/llama.py, `CausalCore.tables`). The planner
# counts them once per stage (`Footprint.stage_shared`).
SHARED_ACROSS_MICROBATCHES = ("rotary cos/sin",)
