"""Seconds of one microbatch's forward, input-gradient and weight-gradient work on one rank.

Three kinds of kernels, each charged at what bounds it, instead of one efficiency that
hides them all:

- GEMMs (every linear): 2·M·K·N FLOPs at `peak x efficiency x g(K) x g(N)`, with
  g(x) = x / (x + GEMM_HALF_WIDTH): a matmul whose local K or N is small (a small model,
  or a large one cut by tp) feeds the tensor cores worse. `efficiency` is the share of
  the peak large GEMMs reach in a training step on that device kind (fitted).
- Flash attention: the causal half of the s x s square (the FLOPs flash attention runs),
  at the share of the peak its kernel reaches on that device (`ATTENTION`, published).
- Elementwise work (norms, rotary, residual adds, SwiGLU's gate, the loss's softmax):
  bytes read and written at HBM bandwidth. Eager PyTorch runs each op as its own kernel
  (a norm reads and writes its input five times, in fp32); fused kernels (Megatron's
  and Transformer Engine's, torch.compile) do one pass. The engine says which.

The backward of an elementwise op moves about twice the forward's bytes (it reads the
saved input and the output gradient, writes the input gradient); flash attention's
backward runs 2.5x the forward's FLOPs (five matmuls to two).

Under FP8 (--fp8) the block's linears run at `FP8_GEMM_SHARE` of the device's FP8 peak x
efficiency, and every FP8 linear's input (forward) and output gradient (backward) is cast
to FP8 first: `fp8_cast_bytes` of HBM traffic an element (docs/plan.md, "Low precision").

A mixture of experts' routed experts run as grouped GEMMs, one matmul per expert over the
token copies routed to it: each at the rate of its own shape (the expert's width, not the
k experts' sum) and of its tokens, `M / (M + GROUPED_HALF_TOKENS)` for M copies an
expert, the most loaded rank of the ep group setting the pace (`ROUTING_IMBALANCE`). The
router (fp32 logits, softmax, top-k) and the permutation of the copies to and from the
experts are elementwise bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.config import DTYPE_BYTES, ModelConfig
from tetrad.devices import Device
from tetrad.models.families import spec_for

# Width (elements) at which a GEMM dimension halves the large-GEMM rate: a stated fit on
# the development rows (docs/plan.md, "Efficiency"); cpu: no size effect is modelled.
GEMM_HALF_WIDTH = 384.0

# Share of the dense peak flash attention reaches, fwd + bwd, causal, head dim 128, by
# device and kernel: "fa2" is FlashAttention-2 (PyTorch's sdpa), "fa3" the Hopper kernels
# (FlashAttention-3, cuDNN's, which Megatron uses through Transformer Engine). Dao 2023
# (FA2, Fig. 6: A100 fwd+bwd causal 176-203 TFLOP/s of 312); Shah et al. 2024 (FA3: FA2
# reaches about 35% of H100's peak; FA3 75% forward, backward 1.5-1.75x FA2's).
ATTENTION = {
    "a100": {"fa2": 0.60, "fa3": 0.60},
    "h100": {"fa2": 0.32, "fa3": 0.55},
    "h100-hbm2e": {"fa2": 0.32, "fa3": 0.55},
    "h200": {"fa2": 0.32, "fa3": 0.55},
}
BACKWARD_ATTENTION = 2.5  # flash attention's backward FLOPs over its forward's
# bytes an s x s score element moves forward without flash attention, in 16-bit units of
# 2 bytes: the fused scale-mask-softmax reads the scores and writes the probabilities
# (2 + 2), the dropout reads them and writes its output and a 1-byte mask (2 + 2 + 1)
UNFUSED_SCORE_BYTES = 9
BACKWARD_ELEMENTWISE = 2.0  # bytes an elementwise backward moves over its forward's
# Token copies an expert's GEMM needs to reach half its shape's rate (a grouped GEMM of few
# rows per expert is latency- and load-bound): a stated fit on the published Qwen3-30B-A3B
# row (docs/plan.md, "Mixtures of experts, against published runs")
GROUPED_HALF_TOKENS = 1024.0
# Copies the most loaded rank of an ep group receives over the mean, with a dropless
# router trained with its balancing loss: a stated fit on the Megatron-MoE model zoo's
# forced-balance against dropless Qwen3-235B rows (docs/plan.md)
ROUTING_IMBALANCE = 1.2
# FP8 GEMMs reach this share of what bf16 GEMMs reach of their own peak (a stated fit on the
# published FP8/bf16 step-time ratios of NeMo's Llama 3.1 8B and 70B recipes on H100,
# tests/data/megatron_bridge_fp8.csv; docs/plan.md, "Low precision")
FP8_GEMM_SHARE = 0.82


def fp8_cast_bytes(c: int) -> int:
    """HBM bytes an element of a tensor in dtype bytes `c` costs to reach an FP8 GEMM: the
    amax read (dynamic scaling: this step's scale), the cast's read, and two one-byte
    writes (row-wise for this GEMM, transposed for the weight gradient's)."""
    return 2 * c + 2


@dataclass(frozen=True)
class Kernels:
    """How an implementation runs the non-GEMM work: `fused` elementwise kernels (one
    pass per fused op) or eager ones; `attention` kernel class ("fa2", "fa3", or
    "unfused": batched matmuls and a softmax over the materialised s x s scores);
    `gqa_native`: the attention kernel reads the kv heads as they are (Transformer
    Engine, flash-attn), where PyTorch's sdpa path repeats them to the query heads first
    and keeps the repeated copies for backward."""

    fused: bool = False
    attention: str = "fa2"
    gqa_native: bool = False


@dataclass(frozen=True)
class Parts:
    """Seconds of one microbatch on one rank, by kernel kind, for F, B and W."""

    gemm: float
    attention: float
    elementwise: float
    cast: float = 0.0  # FP8 casts of this pass (--fp8)
    cast_back: float = 0.0  # a forward's: the FP8 casts its backward will make

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.cast


def gemm_factor(width: float) -> float:
    """Share of the large-GEMM rate a GEMM with a dimension of `width` elements reaches."""
    return width / (width + GEMM_HALF_WIDTH)


class ComputeModel:
    """Per-rank seconds of the blocks and of the head, for one device and kernel set."""

    def __init__(self, device: Device, kernels: Kernels, sized: bool = True):
        self.device, self.kernels, self.sized = device, kernels, sized

    def _gemm_rate(self, k: float, n: float, dtype: str) -> float:
        rate = self.device.flops_per_s(dtype) * (FP8_GEMM_SHARE if dtype == "fp8" else 1.0)
        return rate * gemm_factor(k) * gemm_factor(n) if self.sized else rate

    def _attention_rate(self, dtype: str) -> float:
        share = ATTENTION.get(self.device.name, {}).get(self.kernels.attention)
        if share is None:  # a device without published kernels: the GEMM rate
            return self.device.flops_per_s(dtype)
        return self.device.peak_tflops[dtype] * 1e12 * share

    def block_forward(self, m: ModelConfig, t: int, sp: bool, tokens: int, seqs: int,
                      s: int, dtype: str, cp: int = 1, gemm_dtype: str = "", ep: int = 1,
                      imbalance: float = 1.0) -> Parts:  # fmt: skip
        """One block's forward on one rank for `tokens` local tokens of `seqs` sequences of
        length `s`; with context parallelism a rank holds s/cp of each sequence and, the
        chunks load-balanced, 1/cp of the causal attention. `gemm_dtype`: the linears'
        (fp8 under --fp8), where not `dtype`. `ep`, `imbalance`: the routed experts' ep
        degree and the most loaded rank's copies over the mean (where ep > 1)."""
        g = gemm_dtype or dtype
        gemm, spec = 0.0, spec_for(m)
        for name, (k, n) in spec.block_linears(m, t).items():  # (K, N) on this rank
            rate = self._gemm_rate(k, n, g)
            side = spec.routed_linears.get(name)
            if side and self.sized:  # one GEMM an expert, of its rows
                load = imbalance if ep > 1 else 1.0
                rows = tokens * m.top_k * ep / (t * m.experts) * load
                shape = (m.expert_dim, n) if side == "k" else (k, m.expert_dim)
                rate = self._gemm_rate(*shape, g) * rows / (rows + GROUPED_HALF_TOKENS) / load
            gemm += 2 * tokens * k * n / rate
        nbytes = tokens * self.elementwise_bytes(m, t, sp, dtype)
        if self.kernels.attention == "unfused":
            attention = self._unfused_attention(m, t, seqs, s, dtype) / cp
        else:
            width = m.heads * m.head_dim  # the query width (Qwen3 sets it apart from dim)
            attention = seqs * 2 * s * s * width / t / cp / self._attention_rate(dtype)
        casts = self.fp8_casts(m, t, sp, dtype) if g == "fp8" else (0.0, 0.0)
        cast, back = (tokens * e / self.device.hbm_Bps for e in casts)
        return Parts(gemm, attention, nbytes / self.device.hbm_Bps, cast, back)

    def fp8_casts(self, m: ModelConfig, t: int, sp: bool, dtype: str) -> tuple[float, float]:
        """HBM bytes a token's FP8 casts move in one block on one rank, (forward, backward):
        every linear's input forward and output gradient backward, `fp8_cast_bytes` an
        element. A routed expert's side other than its width carries top_k/t copies of
        a token. Fused kernels (Transformer Engine's fused QKV and gate/up linears) cast an
        input the column-wise linears of one module share once; eager ones (torchao's
        Float8Linear) once a linear. Under SP a rank casts its own sequence shard of what
        is gathered (the column-wise linears' input, the row-wise ones' output gradient)
        and gathers it in FP8, 1/t of it."""
        spec, each = spec_for(m), fp8_cast_bytes(DTYPE_BYTES[dtype])
        copies = m.top_k / t if m.moe else 1.0
        fwd = bwd = 0.0
        shared = set()  # modules whose shared input is cast already
        for name, (k, n) in spec.block_linears(m, t).items():
            side = spec.routed_linears.get(name)
            k, n = (k * copies, n) if side == "n" else (k, n * copies) if side else (k, n)
            module = name.rpartition(".")[0]
            style = spec.tp_plan.get(spec.block_prefix("*") + name)
            column = side == "n" or style in ("colwise", "kv")
            gathered = 1 / t if sp and not side else 1.0  # the experts' copies are the rank's
            if not (self.kernels.fused and column and module in shared):
                fwd += k * each * (gathered if column else 1.0)
            if column:
                shared.add(module)
            bwd += n * each * (1.0 if column else gathered)
        return fwd, bwd

    def selective_redo(self, m: ModelConfig, t: int, tokens: int, dtype: str, fwd: Parts) -> float:
        """Seconds tetrad's selective recomputation redoes in one block's backward
        (models/recompute.py): the matmuls of the linears its family's policy neither
        keeps nor drops (the others' outputs are kept, or never read) and the elementwise
        forward (norms, rotary, SwiGLU's product, the residual sums); not attention."""
        spec = spec_for(m)
        named = spec.selective.modules()
        redone = [kn for name, kn in spec.block_linears(m, t).items() if name not in named]
        gemm = sum(2 * tokens * k * n / self._gemm_rate(k, n, dtype) for k, n in redone)
        return gemm + fwd.elementwise

    def _unfused_attention(self, m: ModelConfig, t: int, seqs: int, s: int, dtype: str) -> float:
        """Forward seconds of attention without a flash kernel (Megatron before 2022): two
        batched matmuls over the whole s x s square (the causal mask is applied to the
        scores, not skipped: 4·s²·h FLOPs a sequence) at the GEMM rate of an s-wide
        matmul, and the s x s tensors through the fused scale-mask-softmax and the
        dropout: `UNFUSED_SCORE_BYTES` bytes an element forward (twice backward, as for
        every elementwise op), at HBM bandwidth; per tp rank its a/t heads."""
        c = DTYPE_BYTES[dtype]
        flops = seqs * 4 * s * s * m.heads * m.head_dim / t
        scores = seqs * (m.heads / t) * s * s * UNFUSED_SCORE_BYTES * c / 2
        return flops / self._gemm_rate(s, s, dtype) + scores / self.device.hbm_Bps

    def elementwise_bytes(self, m: ModelConfig, t: int, sp: bool, dtype: str) -> float:
        """HBM bytes a block's elementwise forward moves per token on one rank."""
        c, h = DTYPE_BYTES[dtype], m.dim
        f = (m.top_k + m.shared_experts) * m.expert_dim if m.moe else m.hidden_dim
        kv = m.kv_heads * m.head_dim
        if self.kernels.fused:  # one read and one write per fused op
            norms, rotary, gate = 2 * (2 * c * h), 2 * c * (h + kv), 3 * c * f
        else:  # fp32 cast, square-mean, scale, cast back, weight; complex rotary; silu, mul
            norms, rotary, gate = 2 * (20 * h + 4 * c * h), (2 * c + 16) * (h + kv), 5 * c * f
        residual = 2 * 3 * c * h
        # MoE: the router's fp32 logits written, softmaxed and read by top-k; the k copies
        # gathered to the experts (read and written) and back (read, weighted, summed)
        routing = (3 * 4 * m.experts + (3 * m.top_k + 1) * c * h) if m.moe else 0
        return (norms + residual) / (t if sp else 1) + (rotary + gate + routing) / t

    def backward(self, fwd: Parts) -> Parts:
        """The input-gradient part of a block's backward, from its forward, for this kernel
        set: unfused attention's backward is its two matmuls' four and the score tensors'
        passes twice over, 2x its forward."""
        unfused = self.kernels.attention == "unfused"
        attention = BACKWARD_ELEMENTWISE if unfused else BACKWARD_ATTENTION
        return Parts(fwd.gemm, attention * fwd.attention, BACKWARD_ELEMENTWISE * fwd.elementwise,
                     fwd.cast_back)  # fmt: skip

    def head(self, m: ModelConfig, t: int, tokens: int, dtype: str) -> Parts:
        """The head matmul and the loss's forward on one rank (no attention)."""
        c, v = DTYPE_BYTES[dtype], m.vocab / t
        gemm = 2 * tokens * m.dim * v / self._gemm_rate(m.dim, v, dtype)
        loss = (8 + 2 * c) if self.kernels.fused else (12 + c)  # bytes a token per vocab entry
        return Parts(gemm, 0.0, tokens * v * loss / self.device.hbm_Bps)
