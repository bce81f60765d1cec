"""Model FLOPs of a Llama: for MFU (counted the PaLM way: matmuls + attention, no
recompute), per pipeline item for the stage partitioner, and each block linear's shape."""

from __future__ import annotations

from tetrad.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (the output head, not the lookup)."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * hd * (2 * cfg.heads + 2 * cfg.kv_heads)
    mlp = 3 * d * cfg.hidden_dim
    return cfg.layers * (attn + mlp) + cfg.vocab * d


def param_count(cfg: ModelConfig) -> int:
    """All parameters: embedding, layers (with Qwen2's q/k/v biases and Qwen3's per-head
    q/k norms when configured), final norm, and the head unless tied."""
    d, hd = cfg.dim, cfg.head_dim
    per_layer = d * hd * (2 * cfg.heads + 2 * cfg.kv_heads) + 3 * d * cfg.hidden_dim + 2 * d
    per_layer += hd * (cfg.heads + 2 * cfg.kv_heads) * cfg.qkv_bias + 2 * hd * cfg.qk_norm
    head = 0 if cfg.tie_embeddings else cfg.vocab * d
    return cfg.vocab * d + cfg.layers * per_layer + d + head


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6·(matmul params) + 12·L·(heads·head_dim)·s for
    attention (the query width, which Qwen3 sets apart from the model width)."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.layers * cfg.heads * cfg.head_dim * seq_len


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
    """Analytic FLOPs of one sequence, forward plus backward (3x forward), per item:
    [embedding, layer_0, ..., layer_{L-1}, head+loss].

    A layer: q/k/v/o projections (k, v narrowed by grouped-query attention), attention
    scores and values over the full s x s square, and a SwiGLU MLP of three matrices.
    The embedding is a lookup (s*dim moves, no matmul); head = 2*s*dim*vocab, the
    softmax of the loss (O(s*vocab)) is left out as 1/dim of it. `head_dim`: given when
    it is not dim/n_heads (Qwen3).
    """
    if (head_dim is None and dim % n_heads) or n_heads % n_kv_heads:
        raise ValueError(f"dim={dim}, n_heads={n_heads}, n_kv_heads={n_kv_heads} do not divide")
    hd = head_dim or dim // n_heads
    s, q_dim, kv_dim = seq_len, n_heads * hd, n_kv_heads * hd
    projections = 2 * s * dim * (2 * q_dim + 2 * kv_dim)
    attention = 2 * 2 * s * s * q_dim  # q·kᵀ and p·v
    mlp = 3 * 2 * s * dim * ffn_dim
    layer = 3.0 * (projections + attention + mlp)
    return [3.0 * s * dim] + [layer] * n_layers + [3.0 * 2 * s * dim * vocab]


def layer_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """`llama_layer_costs` of a model config: the partitioner's analytic item costs."""
    c = cfg
    return llama_layer_costs(
        c.layers, c.dim, c.hidden_dim, c.heads, c.kv_heads, c.vocab, seq_len, c.head_dim
    )


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
