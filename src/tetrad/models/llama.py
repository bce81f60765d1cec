"""A Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Free of parallelism: it imports only torch. Layers sharded by tensor parallelism are the
same modules with smaller weights, so attention reads its local head count from its
weights' shapes, never from the config. A pipeline stage is this model with the modules it
does not own set to None (`first`/`last` say whether it embeds tokens and computes logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.compiling import graph_break, ready
from tetrad.config import ModelConfig
from tetrad.models.flops import block_linears
from tetrad.models.loss import cross_entropy_sum  # noqa: F401  (its historical home)
from tetrad.models.recompute import recompute
from tetrad.models.spec import Keep
from tetrad.precision import widen

# What selective recomputation does not redo in a block (models/recompute.py), by the
# module running the kernel: the k, v, o and gate projections' matmuls and the attention
# core's fused kernel are kept; w2's output only feeds the residual sum, so it is dropped.
KEEP_SELECTIVE = Keep(
    keep={
        "attention.wk": "mm",
        "attention.wv": "mm",
        "attention.core": "attention",
        "attention.wo": "mm",
        "feed_forward.w1": "mm",
    },
    drop={"feed_forward.w2": "mm"},
)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self._gain: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = self.weight if self._gain is None else self._gain(self.weight)
        xf = widen(x)  # normalised in float32 at least, then back in x's dtype before the gain
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * gain

    def use_gain(self, gain: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Multiply by `gain(weight)` instead of the weight itself: how parallel code
        changes the way the gain enters (sequence parallelism sums its gradient over
        tp), not what the norm computes."""
        self._gain = gain


def rotary(seq_len: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """cos/sin tables of positions 0..s-1, [s, head_dim/2, 2] in float32."""
    return rotary_at(torch.arange(seq_len, device=device), head_dim, theta)


@torch.library.custom_op("tetrad::rotary_at", mutates_args=())
def rotary_at(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """cos/sin tables of the given (global) positions, [len, head_dim/2, 2] in float32.

    An opaque op to torch.compile: the tables are float32 even in an fp64 model, and a
    compiled block's own pow, cos and sin differ from ATen's by float32 ulps, which an
    fp64 comparison sees (1e-10 after 4 steps): compiled, the tables stay ATen's."""
    device = positions.device
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(positions.float(), inv)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


@rotary_at.register_fake
def _(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    return positions.new_empty((positions.shape[0], head_dim // 2, 2), dtype=torch.float32)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [b, s, heads, head_dim] by position.

    Eagerly one complex multiplication (a pair is a complex number, its rotation e^{iθ}):
    one kernel each way, where the real arithmetic takes six forward and more backward.
    A compiled block keeps the real arithmetic, which inductor fuses (complex operators
    it leaves to ATen, one by one)."""
    xr = widen(x).unflatten(-1, (-1, 2))  # [b, s, h, d/2, 2]
    if torch.compiler.is_compiling():
        cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
        x0, x1 = xr[..., 0], xr[..., 1]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        turn = torch.view_as_complex(rope)[None, :, None]  # [1, s, 1, d/2]
        out = torch.view_as_real(torch.view_as_complex(xr.contiguous()) * turn)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention: projections around a swappable core.

    `core` is the part that sees the whole sequence at once (rotary, softmax(qkᵀ)v);
    context parallelism replaces it with one that exchanges keys and values across the
    ranks that hold the other parts of the sequence (parallel/context.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd, bias = cfg.head_dim, cfg.qkv_bias  # Qwen2: biases on q, k and v
        self.wq = nn.Linear(cfg.dim, cfg.heads * hd, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=bias)
        self.wo = nn.Linear(cfg.heads * hd, cfg.dim, bias=False)
        # Qwen3: each head's queries and keys RMS-normed over head_dim, before rotary
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.core: nn.Module = CausalCore(hd, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # with sequence parallelism x is [b, s/tp, h] and the projections gather the sequence,
        # so the sequence length is read from their outputs.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [b, s, local (kv) heads · hd]
        if self.q_norm is not None:
            q, k = _per_head(self.q_norm, q), _per_head(self.k_norm, k)
        # a core swapped in (context parallelism's: its own autograd functions around
        # collectives) runs eagerly under torch.compile, one graph break
        out = self.core(q, k, v) if type(self.core) is CausalCore else eager(self.core, q, k, v)
        return self.wo(out)


@graph_break
def eager(fn: Callable, *args):
    """fn(*args), run eagerly when called from a compiled region (a graph break there): for
    the parts whose own autograd functions, collectives or host reads a graph cannot hold."""
    return fn(*args)


def _per_head(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` over each head's channels of x [b, s, heads · hd]."""
    return norm(x.unflatten(-1, (-1, norm.weight.shape[0]))).flatten(-2)


class CausalCore(nn.Module):
    """Rotary, repeated kv heads and causal softmax(qkᵀ)v: [b, s, heads·hd] each way.

    Local heads are read from the inputs' widths (tensor parallelism shrinks them)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self._tables: torch.Tensor | None = None  # see `tables`

    def tables(self, s: int, device: torch.device) -> torch.Tensor:
        """Rotary's tables of positions 0..s-1, made once per (s, device) and kept: every
        step's are the same. Each layer keeps its own, as its backward keeps them (the
        planner's count). A compiled block reads the kept ones as a graph input (made
        eagerly: `Llama.forward_span`), or else makes them inside its graph, at every call."""
        kept = self._tables
        if kept is not None and kept.shape[0] == s and kept.device == device:
            return kept
        if torch.compiler.is_compiling():
            return rotary(s, self.head_dim, self.theta, device)
        # made in inference mode, backward could not save them: made outside it
        with torch.inference_mode(False):
            self._tables = rotary(s, self.head_dim, self.theta, device)
        return self._tables

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[:2]
        # [b, s, local heads, hd]; k and v [b, s, local kv heads, hd]
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        rope = self.tables(s, q.device)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        rep = q.shape[2] // k.shape[2]
        # repeated, not sdpa's enable_gqa: on SSE4.2 kernels that moves the fp32 single
        # process's rounding enough to fail test_rounding's tp and cp bounds (docs/compile.md)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2).reshape(b, s, -1)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        # "full": only the block's input is kept for backward; "selective": also the
        # kernel outputs `keep` names (a family's block sets its own)
        self.recompute = "none"
        self.keep = KEEP_SELECTIVE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            return recompute(self.body, x)
        if self.recompute == "selective":
            return recompute(self.body, x, keep=self.keep, root=self)
        return self.body(x)

    def compile(self, *args, **kwargs) -> None:
        """torch.compile (`args`, `kwargs` its own) of the body only, where
        nn.Module.compile would take the whole call: the hooks around the block (ZeRO's
        gathers) and the recomputation region stay eager, and the region's rerun in
        backward runs the compiled body again. Blocks alike share one compiled graph (the
        parameters are its inputs), so compiling costs one graph per distinct block."""
        ready()  # the graph breaks' disabled twins, before the first trace
        self.body = torch.compile(self.body, *args, **kwargs)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The decoder. Build it under `torch.device("meta")`, shard, then materialise."""

    def __init__(
        self, cfg: ModelConfig, block: Callable[[ModelConfig, int], nn.Module] | None = None
    ):
        """`block(cfg, i)` builds block i (a family built on this decoder varies them)."""
        super().__init__()
        block = block or (lambda c, i: Block(c))
        self.cfg = cfg
        self.first = True  # embeds token ids (a pipeline stage after the first gets hidden states)
        self.last = True  # applies the final norm and the output head
        # False: the last stage ends at the final norm and a fused loss applies the head
        # (models/loss.py), so no full logits are ever built
        self.logits = True
        self._tables_kept = False  # see `_keep_tables`
        self.tok_embeddings: nn.Embedding | None = _embedding(cfg.vocab, cfg.dim)
        # string keys keep parameter names ("layers.7....") stable when a stage drops layers
        self.layers = nn.ModuleDict({str(i): block(cfg, i) for i in range(cfg.layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] (first stage) or hidden [b, s, h] -> logits [b, s, V] or hidden."""
        return self.forward_span(x, list(self.layers), self.first, self.last)

    def forward_span(self, x: torch.Tensor, layers: list[str], embed: bool, head: bool):
        """Run a contiguous span of this model's layers (a pipeline chunk), optionally
        preceded by the embedding lookup and followed by the final norm and head."""
        h = self.tok_embeddings(x) if embed else x
        self._keep_tables(h.shape[1], h.device)
        for name in layers:
            h = self.layers[name](h)
        return self.head(self.norm(h)) if head else h

    def _keep_tables(self, s: int, device: torch.device) -> None:
        """Each attention core's rotary tables, made here (eagerly) where it has none yet:
        a compiled block then reads them as an input, where it would make them in its
        graph at every call (1.5% of a compiled dp step's CPU time at benchmarks/compile.py's
        shape). Under sp `s` is a shard's length: eagerly the core remakes them at its own,
        compiled it makes them in its graph as before. Other cores (cp's) keep their own."""
        if not self._tables_kept:
            for core in self.modules():
                if isinstance(core, CausalCore) and core._tables is None:
                    core.tables(s, device)
            self._tables_kept = True

    def keep_stage(
        self, layers: Sequence[str], dropped: Sequence[str], embeds: bool, heads: bool
    ) -> None:
        """Become a pipeline stage's part: only the blocks `layers`, without the root
        modules `dropped`; `embeds`/`heads`: whether it starts at token ids and ends at the
        head."""
        for name in [n for n in self.layers if n not in set(layers)]:
            del self.layers[name]
        for root in dropped:
            setattr(self, root, None)
        self.first, self.last = embeds, heads

    def end_at_norm(self) -> None:
        """From now on the last stage returns the final-normed hidden states: a fused
        loss (models/loss.py) applies the head in chunks, so full logits never exist."""
        self.logits = False

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Output projection, tied to the embedding when configured (or, with `logits`
        off, nothing: the loss projects)."""
        if not self.logits:
            return h
        return F.linear(h, self.head_weight()) if self.output is None else self.output(h)

    def head_weight(self) -> torch.Tensor:
        """The output projection's weight [V, d]: the head's, or the tied embedding's."""
        return (self.output if self.output is not None else self.tok_embeddings).weight


def _embedding(vocab: int, dim: int) -> nn.Embedding:
    """nn.Embedding(vocab, dim), whose default init (normal_) is skipped on the meta
    device: there it imports torch._dynamo (1.6 s of CPU, most of a `tetrad plan`), and
    a meta model's values are written by models/init.py after sharding anyway."""
    weight = torch.empty(vocab, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding.from_pretrained(weight, freeze=False)


def set_recompute(model: nn.Module, mode: str) -> None:
    """Activation recomputation for every block of `model`: "none", "selective" (keeping
    the costly kernel outputs) or "full" (keeping only the block inputs); see
    models/recompute.py."""
    for block in model.modules():
        if isinstance(block, Block):
            block.recompute = mode


def meta_llama(cfg: ModelConfig) -> Llama:
    """The whole model on the meta device: shapes and names, no memory. Every layout
    starts here (then keeps its stages and shards, then materialises)."""
    with torch.device("meta"):
        return Llama(cfg)


def param_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of the logical (unsharded) parameter `name` of a Llama with config `cfg`: a
    block linear's weight [N, K] of its (K, N) at tp 1 (`flops.block_linears`, the one
    table of them), its bias [N]."""
    d, hd = cfg.dim, cfg.head_dim
    leaf = name.split(".")[-2]
    shapes = {path.rsplit(".", 1)[1]: (n, k) for path, (k, n) in block_linears(cfg, 1).items()}
    shapes |= {"tok_embeddings": (cfg.vocab, d), "output": (cfg.vocab, d)}
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (hd,)
    if name.endswith("norm.weight"):
        return (d,)
    if leaf not in shapes:
        raise ValueError(f"no known full shape for parameter {name!r}")
    return shapes[leaf][:1] if name.endswith(".bias") else shapes[leaf]
