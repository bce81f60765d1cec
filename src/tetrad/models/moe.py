"""A mixture-of-experts decoder: the Llama decoder with routed SwiGLU experts (docs/moe.md).

From layer `dense_layers` on, each block's feed-forward is a `MoEFeedForward`: a router
scores every token against `experts` experts in fp32, the top `top_k` of them (ties to
the lower index, the same everywhere) each run a SwiGLU on the token, and their outputs,
weighted, are summed; `shared_experts` more run on every token. Dropless: every token
reaches its k experts, whatever the batch.

Free of parallelism like the dense family: how token copies reach the experts is the
dispatcher's business (`LocalDispatch` here; expert parallelism swaps in one that moves
tokens to the ranks holding their experts, through `MoEFeedForward.use_dispatch`), and
the per-sequence reduction the auxiliary loss needs is a function
(`MoEFeedForward.use_sequence_sum`) that context parallelism, which splits a sequence over
ranks, gives it. The dispatcher also runs the shared expert (it may while tokens travel).

Load balance (`ModelConfig.balance`):
- "aux": DeepSeek-V3's sequence-wise auxiliary loss, coef · Σ_e f_e · P_e per sequence,
  averaged over the global batch's sequences and summed over layers. It is attached to
  the layer's output by an autograd function that passes the activations through and
  injects the loss's gradient in backward, so no schedule carries a second loss. Per
  sequence, so the same in every grouping of sequences into microbatches and ranks.
- "bias": DeepSeek-V3's loss-free balance: a per-expert bias added to the scores only to
  choose the experts, nudged after each optimizer step toward the mean load.
- "none".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.config import ModelConfig
from tetrad.models.llama import KEEP_SELECTIVE, Block, FeedForward, Llama, eager
from tetrad.models.llama import set_recompute as set_dense_recompute
from tetrad.models.spec import Keep
from tetrad.precision import wide, widen

# A sum over the ranks that hold parts of the same sequences (identity: whole sequences)
SequenceSum = Callable[[torch.Tensor], torch.Tensor]

# Statistics one MoE layer accumulates over a step, [experts + STAT_EXTRA] float64:
# tokens per expert, then the sum of per-sequence auxiliary losses (coef not applied),
# the sum of per-token router entropies, and the tokens routed.
STAT_EXTRA = 3


def keep_selective(cfg: ModelConfig) -> Keep:
    """Selective recomputation's policy for an MoE block: attention as in the dense block;
    of the feed-forward the router's logits are kept (the routing is not recomputed from
    scratch) and the shared expert's down projection dropped (it only feeds a sum); the
    routed experts run again."""
    keep = {k: v for k, v in KEEP_SELECTIVE.keep.items() if k.startswith("attention.")}
    drop = {"feed_forward.shared.w2": "mm"} if cfg.shared_experts else {}
    return Keep(keep={**keep, "feed_forward.router": "mm"}, drop=drop)


def top_k_stable(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of each row's k largest scores, equal scores to the lower index
    (a stable descending sort: the same choice on every device and in every layout)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def check_groups(cfg: ModelConfig) -> None:
    """Refuse a group-limited routing that cannot choose top_k experts."""
    g, kg = cfg.n_group, cfg.topk_group
    per = cfg.experts // g if g > 0 and cfg.experts % g == 0 else 0
    if g > 1 and not (per >= 2 and 1 <= kg <= g and cfg.top_k <= kg * per):
        raise ValueError(
            f"model.n_group={g}, topk_group={kg}: {cfg.experts} experts must split into groups "
            f"of at least 2, and top_k={cfg.top_k} fit in topk_group groups"
        )


# (tokens grouped by expert, a stacked weight, tokens per expert) -> each group times its expert
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Router(nn.Module):
    """Scores tokens against experts in fp32 and picks each token's top k.

    softmax: probabilities over all experts, the top k of them renormalised (Mixtral,
    Qwen3-MoE). sigmoid: independent scores, the chosen ones normalised to sum to one
    (DeepSeek-V3). Either way the k are chosen on the scores plus `expert_bias` (the
    loss-free balance's buffer, zero unless balance is "bias") and weighted by the
    scores alone. DeepSeek-V3 also limits the choice to each token's `topk_group` best of
    `n_group` expert groups, and scales the weights by `routed_scaling` (after
    renormalising them, unless `norm_topk_prob` is off)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_groups(cfg)
        self.kind, self.top_k = cfg.router, cfg.top_k
        self.groups, self.topk_group = cfg.n_group, cfg.topk_group
        self.scaling, self.renormalise = cfg.routed_scaling, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.dim))
        self.register_buffer("expert_bias", torch.zeros(cfg.experts))
        # what `use_logits` installed, if anything
        self.logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d] -> (affinities [T, E] normalised over experts, ids [T, k], weights [T, k]),
        all fp32 but the int64 ids."""
        logits = self.logits(x) if self.logits_fn is None else self.logits_fn(x)  # [T, E]
        scores = logits.softmax(dim=-1) if self.kind == "softmax" else logits.sigmoid()
        choice = scores + widen(self.expert_bias)
        if self.groups > 1:
            choice = self._in_best_groups(choice)
        ids = top_k_stable(choice, self.top_k)
        chosen = scores.gather(1, ids)
        probs = scores if self.kind == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        if self.renormalise:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return probs, ids, chosen * self.scaling

    def _in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's `topk_group` best groups at
        -inf; a group scores the sum of its two best (DeepSeek-V3's group-limited routing)."""
        grouped = choice.unflatten(-1, (self.groups, -1))  # [T, groups, E/groups]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
        best = top_k_stable(group_scores, self.topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> the scores' logits [T, E], fp32."""
        return F.linear(widen(x), widen(self.weight))

    def use_logits(self, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Take the logits from `logits(x)` (the same F.linear of the fp32 weight): how
        parallel code changes the way the weight meets the tokens (its gradient summed
        over ranks, or computed later), not what the router computes."""
        self.logits_fn = logits

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """The loss-free balance's step: raise underloaded experts' bias, lower overloaded
        ones', by `rate` (`load`: tokens per expert over the step's global batch)."""
        load = load.to(self.expert_bias.device, torch.float64)
        self.expert_bias += (rate * torch.sign(load.mean() - load)).to(self.expert_bias.dtype)


class Experts(nn.Module):
    """`n` SwiGLU experts as stacked weights: w1 (gate) and w3 (up) [n, ffn, dim], w2
    (down) [n, dim, ffn]. The input is token copies sorted by expert, `counts[e]` of them
    for expert e, one contiguous group each."""

    def __init__(self, n: int, dim: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, ffn, dim))
        self.w3 = nn.Parameter(torch.empty(n, ffn, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, ffn))
        # one of the weights applied to its groups: `grouped_linear`, or what `use_matmul`
        # installed
        self.matmul: GroupedMatmul = grouped_linear

    def use_matmul(self, matmul: GroupedMatmul) -> None:
        """Apply each weight with `matmul` (what `matmul` computes): how parallel code
        changes when its weight gradient is computed (zero-bubble's W), not what it is."""
        self.matmul = matmul

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] grouped by expert, counts [n] -> [N, dim]."""
        gate, up = self.matmul(x, self.w1, counts), self.matmul(x, self.w3, counts)
        out = self.matmul(F.silu(gate) * up, self.w2, counts)
        if out.requires_grad:  # the grouped matmul's backward refuses an expanded gradient
            out.register_hook(torch.Tensor.contiguous)  # (a sum's): hand it a contiguous one
        return out

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The reference forward: one SwiGLU per group, a loop (tests and
        benchmarks/moe_grouped_mm compare the grouped forward with it)."""
        gate, up = loop_linear(x, self.w1, counts), loop_linear(x, self.w3, counts)
        return loop_linear(F.silu(gate) * up, self.w2, counts)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, in] grouped by expert (`counts[e]` rows for expert e, in order), weight [n,
    out, in] -> [N, out], each group times its expert's weight transposed: one grouped
    matmul (`torch._grouped_mm`) where `loop_reason` finds none, else `loop_linear`, a loop
    over the groups; on CUDA the loop is announced once per reason (docs/moe.md)."""
    if x.shape[0] == 0:  # no token: nothing to multiply (and no kernel launched)
        return x.new_zeros((0, weight.shape[1]))
    if loop_reason_of(x, weight) is None:
        return grouped_mm(x, weight, counts)
    return loop_linear(x, weight, counts)


def grouped_weight_grad(x: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The gradient [n, out, in] of `grouped_linear`'s weight, by itself (zero-bubble's W):
    per group e, `grad_eᵀ x_e` (zeros for an empty group). One grouped matmul where
    `loop_reason` finds none for these widths (the call autograd's backward of
    `grouped_mm` makes), else a loop, announced on CUDA as `grouped_linear`'s is."""
    out, width = grad.shape[1], x.shape[1]
    if x.shape[0] and loop_reason_of(x, grad, (out, width)) is None:
        return torch._grouped_mm(grad.t(), x, offs=counts.cumsum(0).to(torch.int32))
    rows = counts.tolist()
    grads = [g.t() @ xs for g, xs in zip(grad.split(rows), x.split(rows), strict=True)]
    return torch.stack(grads) if grads else x.new_zeros((0, out, width))


def loop_reason_of(
    x: torch.Tensor, weight: torch.Tensor, widths: tuple[int, ...] | None = None
) -> str | None:
    """`loop_reason` for these operands of `grouped_linear` (or, given the `widths` of its
    weight, of `grouped_weight_grad`: x and the output gradient), on their device; a
    loop on CUDA is announced, once per reason (on CPU only float64 loops, by design)."""
    cuda = x.device.type == "cuda"
    capability = torch.cuda.get_device_capability(x.device) if cuda else None
    aligned = not cuda or all(t.data_ptr() % 16 == 0 for t in (x, weight))
    widths = tuple(weight.shape[1:]) if widths is None else widths
    why = loop_reason(x.device.type, capability, x.dtype, weight.dtype, widths, aligned)
    if why is not None and cuda:
        _say_loop(why)
    return why


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as one `torch._grouped_mm` (the call CUDA and CPU run alike; its
    autograd backward makes two more: dx = grad · weight, dW = gradᵀ · x per group)."""
    offs = counts.cumsum(0).to(torch.int32)  # each group's end: the last is N
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)


def loop_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as a loop over the groups: one F.linear each, sliced by host
    integers (`counts.tolist()`: a host sync on a GPU)."""
    groups = enumerate(x.split(counts.tolist()))
    outs = [F.linear(group, weight[e]) for e, group in groups if group.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros((0, weight.shape[1]))


def loop_reason(
    device: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    widths: tuple[int, ...],
    aligned: bool = True,
) -> str | None:
    """Why `grouped_linear` loops over the groups for operands like these, or None where it
    takes torch's grouped matmul (pure). CUDA: bf16 on compute capability 9.x, torch's
    CUTLASS kernel (elsewhere torch runs a host-synchronising loop of its own, and 10.x's
    kernel has given empty groups nonzero weight gradients). CPU: any dtype but float64
    (measured fastest there; there is no float64 kernel: fp64 verifies with the loop).
    Both: rows (`widths`: the weight's out and in) of a multiple of 16 bytes and, on CUDA,
    operands at 16-byte addresses (`aligned`), as torch's kernel checks them."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype != weight_dtype:
        return f"tokens in {dtype}, weights in {weight_dtype}"
    if device == "cuda":
        if dtype != torch.bfloat16:
            return f"{dtype}: torch's grouped kernel on CUDA takes bf16"
        major, minor = capability or (0, 0)
        if major != 9:
            why = (
                "torch's kernel there gives empty groups nonzero weight gradients (pytorch#172439)"
                if major == 10
                else "torch's grouped kernel is built for 9.x and 10.x"
            )
            return f"compute capability {major}.{minor}: {why}"
    elif device != "cpu":
        return f"device {device}: the grouped kernel is used on cpu and cuda only"
    elif dtype == torch.float64:
        return "float64: the grouped kernel has none"
    if any(w * dtype.itemsize % 16 for w in widths):
        return f"rows of {'/'.join(map(str, widths))} {dtype} elements: not multiples of 16 bytes"
    if not aligned:
        return "an operand not at a 16-byte address (a view into a flat buffer)"
    return None


@functools.cache
def _say_loop(why: str) -> None:
    """Tell, once per process and reason, that a CUDA run's experts loop over the groups."""
    print(f"tetrad: MoE experts on cuda: a loop over the experts ({why})", flush=True)


class LocalDispatch:
    """Every expert on this rank: token copies sorted by expert (stable, so a token's
    copies keep their order), the experts run over the groups, each copy weighted, and
    the k copies of a token summed back in the order of its top-k list."""

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: Experts,
        shared: nn.Module | None = None,
    ) -> torch.Tensor:
        """The weighted sum of each token's k expert outputs [T, d], plus the shared
        expert's output on x when there is one."""
        t, k = ids.shape
        flat = ids.reshape(-1)  # [T·k]: copy j of token i at i·k + j
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=experts.w1.shape[0])
        y = experts(x[order // k], counts)  # [T·k, d], grouped by expert
        back = torch.empty_like(y)
        back[order] = y  # token-major again
        out = (back.view(t, k, -1) * weights[..., None]).sum(dim=1)
        return out if shared is None else out + shared(x)


class _WithAuxGrad(torch.autograd.Function):
    """Passes `out` through; in backward, also gives `aux` (a scalar already scaled as
    the loss counts it) the gradient 1, as if it had been added to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=wide(grad.dtype), device=grad.device)


class MoEFeedForward(nn.Module):
    """Router, routed experts, optional shared experts, and a swappable dispatcher."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg.experts, cfg.dim, cfg.expert_dim)
        # the shared experts: one SwiGLU (Llama's) of inner size shared_experts · expert_dim
        inner = cfg.shared_experts * cfg.expert_dim
        self.shared = FeedForward(dataclasses.replace(cfg, ffn_dim=inner)) if inner else None
        self.dispatch: Callable = LocalDispatch()
        self.balance, self.aux_coef = cfg.balance, cfg.aux_loss_coef
        # 1 / sequences in the global batch: the token loss's mean over the global batch,
        # applied to the auxiliary loss's gradient (set by the trainer, `set_aux_scale`)
        self.aux_scale = 1.0
        self.sequence_sum: SequenceSum = _identity
        # set under recomputation: a forward with gradients is then the rerun of one
        # already recorded
        self.recomputed = False
        self.stats: torch.Tensor | None = None

    def use_dispatch(self, dispatch: Callable) -> None:
        """Route token copies through `dispatch` (the same protocol as `LocalDispatch`)."""
        self.dispatch = dispatch

    def use_sequence_sum(self, sequence_sum: SequenceSum) -> None:
        """Sum per-sequence expert counts with `sequence_sum` (a sequence split over ranks:
        context parallelism, tp under sp)."""
        self.sequence_sum = sequence_sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)  # [T, d]
        probs, ids, weights = self.router(flat)
        # eager under torch.compile: the groups' sizes (and ep's all-to-all) follow the
        # routing, a shape a graph would recompile for at every step
        out = eager(self.dispatch, flat, ids, weights.to(x.dtype), self.experts, self.shared)
        out = out.view(b, s, d)
        aux = self._aux_per_sequence(probs.view(b, s, -1), ids.view(b, s, -1))  # [b]
        if not (self.recomputed and torch.is_grad_enabled()):
            eager(self._record, probs, ids, aux)  # bincount: a size from the values
        if self.balance == "aux" and self.aux_coef > 0 and torch.is_grad_enabled():
            out = _WithAuxGrad.apply(out, aux.sum() * (self.aux_coef * self.aux_scale))
        return out

    def _aux_per_sequence(self, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ_e f_e · P_e of each sequence [b] (DeepSeek-V3's sequence-wise loss, no coef):
        f_e = E / (k·T) · (tokens sent to e), P_e = mean over its T tokens of the
        normalised affinity. With a sequence split over ranks (`sequence_sum`), the
        counts are the whole sequence's and each rank adds its tokens' part of P."""
        b, s, n = probs.shape
        k = ids.shape[-1]
        counts = probs.new_zeros(b, n)
        counts.scatter_add_(1, ids.reshape(b, -1), probs.new_ones(b, s * k))
        lengths = probs.new_full((b, 1), float(s))
        whole = self.sequence_sum(torch.cat([counts, lengths], dim=1))
        counts, lengths = whole[:, :n], whole[:, n:]
        f = counts * (n / k) / lengths
        return (f * probs.sum(dim=1) / lengths).sum(dim=1)

    @torch.no_grad()
    def _record(self, probs: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor) -> None:
        """Add this forward's load, auxiliary loss and router entropy to `stats`."""
        n = probs.shape[-1]
        if self.stats is None:
            self.stats = torch.zeros(n + STAT_EXTRA, dtype=torch.float64, device=probs.device)
        load = torch.bincount(ids.reshape(-1), minlength=n).double()
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
        extra = torch.stack([aux.sum().double(), entropy.double(), load.new_tensor(probs.shape[0])])
        self.stats += torch.cat([load, extra])

    def reset_stats(self) -> None:
        self.stats = None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class MoEBlock(Block):
    """A pre-norm block whose feed-forward is a `MoEFeedForward` (layers >= dense_layers)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.feed_forward = MoEFeedForward(cfg)
        self.keep = keep_selective(cfg)


class MoE(Llama):
    """The decoder with MoE blocks from layer `dense_layers` on (dense `Block`s before)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, block=lambda c, i: MoEBlock(c) if i >= c.dense_layers else Block(c))


def moe_layers(model: nn.Module) -> dict[int, MoEFeedForward]:
    """The MoE feed-forwards of `model` (a pipeline stage holds some), by block index."""
    blocks = model.layers.items()
    return {int(i): b.feed_forward for i, b in blocks if isinstance(b.feed_forward, MoEFeedForward)}


def set_recompute(model: nn.Module, mode: str) -> None:
    """Recomputation for every block (see llama.set_recompute); the MoE feed-forwards are
    told, so that a rerun does not count their routing twice."""
    set_dense_recompute(model, mode)
    for ffn in moe_layers(model).values():
        ffn.recomputed = mode != "none"


def set_aux_scale(model: nn.Module, sequences: int) -> None:
    """The auxiliary loss is a mean over the `sequences` of the global batch."""
    for ffn in moe_layers(model).values():
        ffn.aux_scale = 1.0 / sequences


def meta_moe(cfg: ModelConfig) -> MoE:
    """The whole model on the meta device (see llama.meta_llama)."""
    if cfg.capacity_factor > 0:
        raise ValueError(
            f"model.capacity_factor={cfg.capacity_factor}: dropping tokens over an expert's "
            "capacity decides by which tokens share a microbatch and a rank, so every "
            "layout would train a different model; tetrad's MoE is dropless (set 0)"
        )
    with torch.device("meta"):
        return MoE(cfg)


def param_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of the logical parameter (or buffer) `name` of an MoE model with config `cfg`."""
    from tetrad.models.llama import param_shape as dense_shape

    parts = name.split(".")
    n, d, f = cfg.experts, cfg.dim, cfg.expert_dim
    if "router" in parts:
        return (n, d) if parts[-1] == "weight" else (n,)
    if "experts" in parts:
        return (n, d, f) if parts[-1] == "w2" else (n, f, d)
    if "shared" in parts:  # a dense SwiGLU of the shared experts' width (`MoEFeedForward`)
        return dense_shape(name, dataclasses.replace(cfg, ffn_dim=cfg.shared_experts * f))
    return dense_shape(name, cfg)
