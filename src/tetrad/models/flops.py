"""Model FLOPs, one count for every family: for MFU (counted the PaLM way: matmuls +
attention, no recompute), per pipeline item for the stage partitioner, and each block
linear's shape.

A token computes attention (Llama's q, k, v and o projections, unless a family gives its
own sizes: DeepSeek-V3's MLA), then a dense layer's SwiGLU, or in an MoE layer the router
(dim · experts) plus top_k routed and `shared_experts` shared SwiGLUs of `expert_dim`
(the active parameters); times 6 for forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

from tetrad.config import ModelConfig


def param_count(cfg: ModelConfig) -> int:
    """All parameters: embedding, layers (with Qwen2's q/k/v biases and Qwen3's per-head
    q/k norms when configured), final norm, and the head unless tied."""
    d, hd = cfg.dim, cfg.head_dim
    per_layer = llama_attention(cfg)[0] + 3 * d * cfg.hidden_dim + 2 * d
    per_layer += hd * (cfg.heads + 2 * cfg.kv_heads) * cfg.qkv_bias + 2 * hd * cfg.qk_norm
    head = 0 if cfg.tie_embeddings else cfg.vocab * d
    return cfg.vocab * d + cfg.layers * per_layer + d + head


def active_ffn(m: ModelConfig) -> int:
    """The SwiGLU inner width one token runs through in an MoE layer: its top_k routed
    experts and the shared ones."""
    return (m.top_k + m.shared_experts) * m.expert_dim


def ffn_params(m: ModelConfig) -> int:
    """Parameters of one token's feed-forward matmuls over all layers: the dense SwiGLUs
    (every layer's in a dense model), and the router and the active experts of each MoE
    layer."""
    dense = m.dense_layers if m.moe else m.layers
    routed = (m.layers - dense) * (3 * m.dim * active_ffn(m) + m.dim * m.experts)
    return dense * 3 * m.dim * m.hidden_dim + routed


# (model) -> (weights of one layer's attention matmuls, channels a query meets per position
# over all heads: q·kᵀ and p·v), which the FLOP counts below take (DeepSeek-V3 gives MLA's)
Attention = Callable[[ModelConfig], tuple[int, int]]


def llama_attention(m: ModelConfig) -> tuple[int, int]:
    """Llama's attention: the q, k, v and o projections, heads of head_dim channels (the
    query width, which Qwen3 sets apart from the model width)."""
    return m.dim * m.head_dim * (2 * m.heads + 2 * m.kv_heads), 2 * m.heads * m.head_dim


def matmul_params(m: ModelConfig, attention: Attention = llama_attention) -> int:
    """Parameters one token's matmuls use: attention, the feed-forwards (`ffn_params`) and
    the head (not the embedding's lookup)."""
    return m.layers * attention(m)[0] + ffn_params(m) + m.vocab * m.dim


def flops_per_token(m: ModelConfig, seq_len: int, attention: Attention = llama_attention) -> float:
    """Forward + backward FLOPs per token: 6·(active matmul params) + 6·L·(scores' width)·s."""
    return 6.0 * matmul_params(m, attention) + 6.0 * m.layers * attention(m)[1] * seq_len


def layer_costs(
    m: ModelConfig, seq_len: int, attention: Attention = llama_attention
) -> list[float]:
    """[embedding, layers..., head+loss] FLOPs of one sequence, forward + backward (3x
    forward), the partitioner's analytic item costs. A layer: attention's projections
    (k, v narrowed by grouped-query attention), its scores and values over the full
    s x s square, then a dense layer's SwiGLU, or an MoE layer's router and SwiGLUs of
    the active width. The embedding is a lookup (s·dim moves, no matmul); the head
    2·s·dim·vocab, the loss's softmax (O(s·vocab)) left out as 1/dim of it."""
    s, d = seq_len, m.dim
    weights, width = attention(m)
    attn = 2 * s * weights + 2 * s * s * width
    dense = attn + 2 * s * 3 * d * m.hidden_dim
    moe = attn + 2 * s * (3 * d * active_ffn(m) + d * m.experts)
    layers = [3.0 * (moe if m.moe and i >= m.dense_layers else dense) for i in range(m.layers)]
    return [3.0 * s * d, *layers, 3.0 * 2 * s * d * m.vocab]


def llama_layer_costs(
    n_layers: int,
    dim: int,
    ffn_dim: int,
    n_heads: int,
    n_kv_heads: int,
    vocab: int,
    seq_len: int,
    head_dim: int | None = None,
) -> list[float]:
    """`layer_costs` of a Llama of these shapes (tests and benchmarks/pp.py give shapes,
    not a config): [embedding, layer_0, ..., layer_{L-1}, head+loss]. `head_dim`: given
    when it is not dim/n_heads (Qwen3)."""
    if (head_dim is None and dim % n_heads) or n_heads % n_kv_heads:
        raise ValueError(f"dim={dim}, n_heads={n_heads}, n_kv_heads={n_kv_heads} do not divide")
    shape = dict(dim=dim, ffn_dim=ffn_dim, heads=n_heads, kv_heads=n_kv_heads, vocab=vocab)
    return layer_costs(ModelConfig(layers=n_layers, head_size=head_dim or 0, **shape), seq_len)


def block_linears(cfg: ModelConfig, t: int) -> dict[str, tuple[int, int]]:
    """(K, N) of each linear of a block on one tp rank, by module path, in forward order."""
    h, f, hd = cfg.dim, cfg.hidden_dim, cfg.head_dim
    q, kv = cfg.heads * hd // t, max(cfg.kv_heads // t, 1) * hd
    attention = {"attention.wq": (h, q), "attention.wk": (h, kv), "attention.wv": (h, kv)}
    return {**attention, "attention.wo": (q, h), **swiglu_linears("feed_forward", h, f // t)}


def swiglu_linears(path: str, dim: int, inner: int) -> dict[str, tuple[int, int]]:
    """(K, N) of the SwiGLU at `path` (model width `dim`, `inner` wide on one tp rank):
    the gate and up projections (w1, w3), then the down one (w2)."""
    return {f"{path}.w1": (dim, inner), f"{path}.w3": (dim, inner), f"{path}.w2": (inner, dim)}
