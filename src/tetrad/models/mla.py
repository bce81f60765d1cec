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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.config import ModelConfig
from tetrad.models.llama import KEEP_SELECTIVE, Block, Llama, RMSNorm, apply_rotary, rotary
from tetrad.models.moe import MoEFeedForward, keep_selective
from tetrad.models.spec import Keep

# the bottleneck norms' epsilon: transformers' DeepseekV3RMSNorm default, whatever
# rms_norm_eps says
LATENT_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention: low-rank projections around a swappable core.

    The down projections (wq_a, wkv_a) and their norms see every head; what follows them
    is per head. `use_entry(fn)` puts `fn` between the two, on the narrow inputs of the
    per-head part (the query and kv latents and the shared rotary key, concatenated):
    tensor parallelism enters its region there, after the down projections, not before.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, qk = cfg.heads, cfg.qk_nope_dim + cfg.qk_rope_dim
        self.kv_rank, self.nope_dim = cfg.kv_lora_rank, cfg.qk_nope_dim
        self.rope_dim, self.v_dim = cfg.qk_rope_dim, cfg.v_head_dim
        # q_lora_rank 0: no query bottleneck, wq_b is the one query projection
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False) if cfg.q_lora_rank else None
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_EPS) if cfg.q_lora_rank else None
        self.wq_b = nn.Linear(cfg.q_lora_rank or cfg.dim, h * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(h * cfg.v_head_dim, cfg.dim, bias=False)
        self.core: nn.Module = MLACore(qk, cfg.qk_rope_dim, cfg.v_head_dim, cfg.rope_theta)
        self.entry: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_entry(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply `fn` to [q latent | kv latent | rotary key] [b, s, widths] before the heads."""
        self.entry = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_in = x if self.wq_a is None else self.q_a_norm(self.wq_a(x))
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        q_in, kv_in, k_rot = self._enter(q_in, self.kv_a_norm(latent), k_rot)
        q = self.wq_b(q_in)  # [b, s, heads · (nope + rope)]
        kv = self.wkv_b(kv_in).unflatten(-1, (-1, self.nope_dim + self.v_dim))
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [b, s, h, ·]
        k = torch.cat([k_nope, k_rot[:, :, None].expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return self.wo(self.core(q, k.flatten(2), v.flatten(2)))

    def _enter(self, *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.entry is None:
            return parts
        widths = [p.shape[-1] for p in parts]
        return self.entry(torch.cat(parts, dim=-1)).split(widths, dim=-1)


class MLACore(nn.Module):
    """Causal softmax(qkᵀ/√head_dim)v over per-head q, k of `head_dim` (nope + rope)
    channels and v of `v_head_dim`, rotary on the last `rope_dim` channels of q and k only.
    Local heads are read from the inputs' widths; context parallelism swaps it whole."""

    def __init__(self, head_dim: int, rope_dim: int, v_head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.rope_dim, self.v_head_dim = head_dim, rope_dim, v_head_dim
        self.theta = theta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k [b, s, heads · head_dim], v [b, s, heads · v_head_dim] -> [b, s, heads · v]."""
        b, s = q.shape[:2]
        q, k = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k))
        rope = rotary(s, self.rope_dim, self.theta, q.device)
        q, k = apply_rotary_tail(q, rope), apply_rotary_tail(k, rope)
        # torch's flash kernels take one head size for q, k and v; without it attention
        # falls back to the unfused one, which keeps the whole [b, h, s, s] softmax for
        # backward. Zero channels change no score and no output: pad, then cut.
        width = max(self.head_dim, self.v_head_dim)
        q, k, v = (
            _pad(t, width).transpose(1, 2) for t in (q, k, v.unflatten(-1, (-1, self.v_head_dim)))
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return out[..., : self.v_head_dim].transpose(1, 2).reshape(b, s, -1)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def apply_rotary_tail(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, d] with its last channels, as many as the tables `rope` [s, r/2, 2]
    rotate, rotated (interleaved pairs, `apply_rotary`); the first d - r untouched."""
    rope_dim = 2 * rope.shape[-2]
    plain, rot = x.split([x.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([plain, apply_rotary(rot, rope)], dim=-1)


class MLABlock(Block):
    """A pre-norm block with latent attention and a dense or an MoE feed-forward."""

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__(cfg)
        self.attention = MLAttention(cfg)
        if moe:
            self.feed_forward = MoEFeedForward(cfg)
        self.keep = keep_mla(cfg, moe)


def keep_mla(cfg: ModelConfig, moe: bool) -> Keep:
    """Selective recomputation's policy: the attention core and the output projection are
    kept; of the feed-forward, what the MoE block keeps (dense: the gate's matmul)."""
    attention = {"attention.core": "attention", "attention.wo": "mm"}
    ffn = keep_selective(cfg) if moe else KEEP_SELECTIVE
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
