"""Model FLOPs of a Llama, for MFU (counted the PaLM way: matmuls + attention, no recompute)."""

from __future__ import annotations

from tetrad.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (the output head, not the lookup)."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * hd * (2 * cfg.heads + 2 * cfg.kv_heads)
    mlp = 3 * d * cfg.hidden_dim
    return cfg.layers * (attn + mlp) + cfg.vocab * d


def param_count(cfg: ModelConfig) -> int:
    """All parameters: embedding, layers, final norm, and the head unless tied."""
    d, hd = cfg.dim, cfg.head_dim
    per_layer = d * hd * (2 * cfg.heads + 2 * cfg.kv_heads) + 3 * d * cfg.hidden_dim + 2 * d
    head = 0 if cfg.tie_embeddings else cfg.vocab * d
    return cfg.vocab * d + cfg.layers * per_layer + d + head


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6·(matmul params) + 12·L·h·s for attention."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.layers * cfg.dim * seq_len
