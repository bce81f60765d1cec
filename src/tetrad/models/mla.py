"""DeepSeek-V3: multi-head latent attention (MLA) on tetrad's MoE decoder (docs/models.md).

Each head's query and key are `qk_nope_dim` channels without position and `qk_rope_dim`
rotated ones; its value has `v_head_dim`. Queries go through a rank-`q_lora_rank`
bottleneck (wq_a, q_a_norm, wq_b; or one wq when the rank is 0); keys and values come
from one rank-`kv_lora_rank` latent (wkv_a, kv_a_norm, wkv_b), and wkv_a also gives the
rotated key part, one for all heads. Softmax scale 1/sqrt(qk_nope_dim + qk_rope_dim).

Rotary rotates interleaved channel pairs, as tetrad's Llama and as DeepSeek's weights are
laid out (transformers' `rope_interleave`), so no row is permuted on import. Free of
parallelism: it imports only torch and the other model files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.config import ModelConfig
from tetrad.models.llama import Block, Llama, RMSNorm, apply_rotary, rotary
from tetrad.models.moe import MoEFeedForward, keep_selective
from tetrad.models.moe import param_shape as moe_shape
from tetrad.models.spec import Keep

# the bottleneck norms' epsilon: transformers' DeepseekV3RMSNorm default, whatever
# rms_norm_eps says
LATENT_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention: low-rank projections around a swappable core."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, qk = cfg.heads, cfg.qk_nope_dim + cfg.qk_rope_dim
        self.kv_rank = cfg.kv_lora_rank
        self.wq_a: nn.Linear | None = None  # q_lora_rank 0: wq_b is the one query projection
        self.q_a_norm: RMSNorm | None = None
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_EPS)
        self.wq_b = nn.Linear(cfg.q_lora_rank or cfg.dim, h * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(h * cfg.v_head_dim, cfg.dim, bias=False)
        self.core: nn.Module = MLACore(cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(x if self.wq_a is None else self.q_a_norm(self.wq_a(x)))
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.core.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(latent))  # [b, s, heads · (nope + v)]
        return self.wo(self.core(q, kv, k_rot))


class MLACore(nn.Module):
    """Rotary on the decoupled part, then causal softmax(qkᵀ/√(nope+rope))v. Local heads
    are read from the inputs' widths."""

    def __init__(self, nope_dim: int, rope_dim: int, theta: float):
        super().__init__()
        self.nope_dim, self.rope_dim, self.theta = nope_dim, rope_dim, theta

    def forward(self, q: torch.Tensor, kv: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
        """q [b, s, heads · (nope + rope)], kv [b, s, heads · (nope + v)], k_rot [b, s, rope]
        -> [b, s, heads · v]."""
        b, s = q.shape[:2]
        q = q.unflatten(-1, (-1, self.nope_dim + self.rope_dim))  # [b, s, h, nope + rope]
        heads = q.shape[2]
        k_nope, v = kv.unflatten(-1, (heads, -1)).split(
            [self.nope_dim, kv.shape[-1] // heads - self.nope_dim], dim=-1
        )
        rope = rotary(s, self.rope_dim, self.theta, q.device)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary(q_rot, rope)], dim=-1)
        k_rot = apply_rotary(k_rot[:, :, None], rope).expand(-1, -1, heads, -1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2).reshape(b, s, -1)


class MLABlock(Block):
    """A pre-norm block with latent attention and a dense or an MoE feed-forward."""

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__(cfg)
        self.attention = MLAttention(cfg)
        if moe:
            self.feed_forward = MoEFeedForward(cfg)
        self.keep = keep_mla(cfg, moe)

    def selective_policy(self) -> Keep:
        return self.keep


def keep_mla(cfg: ModelConfig, moe: bool) -> Keep:
    """Selective recomputation's policy: the attention core and the output projection are
    kept; of the feed-forward, what the MoE block keeps (dense: the gate's matmul)."""
    attention = {"attention.core": "attention", "attention.wo": "mm"}
    if not moe:
        return Keep(keep={**attention, "feed_forward.w1": "mm"}, drop={"feed_forward.w2": "mm"})
    ffn = keep_selective(cfg)
    rest = {k: v for k, v in ffn.keep.items() if not k.startswith("attention.")}
    return Keep(keep={**attention, **rest}, drop=ffn.drop)


class DeepSeekV3(Llama):
    """The decoder: MLA everywhere, dense feed-forwards before `dense_layers`, MoE after."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, block=lambda c, i: MLABlock(c, moe=i >= c.dense_layers))


def meta_deepseek(cfg: ModelConfig) -> DeepSeekV3:
    """The whole model on the meta device (see llama.meta_llama)."""
    dims = (cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim)
    if min(dims) <= 0 or cfg.qk_rope_dim % 2 or cfg.experts <= 0:
        raise ValueError(
            f"model.family='deepseek_v3' needs kv_lora_rank, qk_nope_dim, qk_rope_dim (even) "
            f"and v_head_dim > 0 and experts > 0; got {dims}, experts={cfg.experts}"
        )
    with torch.device("meta"):
        return DeepSeekV3(cfg)


def param_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of the logical parameter `name` of a DeepSeek-V3 model (attention here, the
    rest as the MoE family's)."""
    h, d, qk = cfg.heads, cfg.dim, cfg.qk_nope_dim + cfg.qk_rope_dim
    shapes = {
        "wq_a": (cfg.q_lora_rank, d),
        "q_a_norm": (cfg.q_lora_rank,),
        "wq_b": (h * qk, cfg.q_lora_rank or d),
        "wkv_a": (cfg.kv_lora_rank + cfg.qk_rope_dim, d),
        "kv_a_norm": (cfg.kv_lora_rank,),
        "wkv_b": (h * (cfg.qk_nope_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "wo": (d, h * cfg.v_head_dim),
    }
    parts = name.split(".")
    if "attention" in parts and parts[-2] in shapes:
        return shapes[parts[-2]]
    return moe_shape(name, cfg)
