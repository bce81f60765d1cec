"""Tensor parallelism (Megatron) with optional sequence parallelism, applied from a plan.

`apply_tp` walks the model on the meta device and swaps each planned module for its
tensor-parallel twin with this rank's smaller weight, keeping every parameter's name, so
`materialize` fills it with its slice of the layout-invariant full value. Per transformer
block, forward, the collectives are (b microbatch, s sequence, h hidden, t = tp):

    no SP:  x [b,s,h] -f-> q,k,v / gate,up (column) ... o / down (row) -g-> [b,s,h]
    SP:     x [b,s/t,h] -all-gather-> (column) ... (row) -reduce-scatter-> [b,s/t,h]

two all-reduces (or two all-gather + reduce-scatter pairs) forward and two backward:
8·b·s·h·(t-1)/t elements per layer per microbatch in bus terms, either way.

Attention splits query heads over tp. Key/value heads are split too when tp divides
kv_heads; when kv_heads < tp each kv head serves tp/kv_heads ranks: its weights are then
stored split by input features across all of tp and all-gathered for each forward, so
backward's reduce-scatter sums the gradient contributions of every rank that used a head
and leaves each element on exactly one rank (no double count in the gradient norm).

Latent attention (DeepSeek-V3's MLA) enters the region after its down projections, on the
narrow latents (the module's `use_entry`): the down projections and their norms stay
before it, replicated, or under SP on the rank's s/t with their weights' gradients
summed over tp (`SequenceParallelLinear`, `sequence_parallel_norm`); docs/models.md has
the bytes.

The output head is split over the vocabulary and its logits never leave their rank: the
vocabulary-parallel cross-entropy combines per-rank log-sum-exps. The vocabulary is cut
in blocks of ceil(V/tp), as if padded to a multiple of tp; the padding rows are never
allocated (the last block is just shorter), so padded logits cannot leak into the loss.

Tied embeddings work unchanged: the embedding and the head share the same vocab rows.

With --fp8 the column, row and SP linears run their matmul in FP8 (`Float8Split`), each
scale the max over tp along what tp splits: output features, input features, an SP
linear's tokens (a column linear's are gathered before it, a row one's scattered after).
A kv head shared by tp ranks (kv_heads < tp) gets partial gradients: refused with FP8.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.comm import Comm
from tetrad.comm.tp import (
    copy_to_tp,
    gather_along,
    gather_from_tp,
    once_in_tp,
    reduce_from_tp,
    reduce_scatter_along,
    scatter_to_tp,
)
from tetrad.config import ModelConfig
from tetrad.mesh import Group, Mesh
from tetrad.models.batch import IGNORE
from tetrad.models.families import spec_for
from tetrad.models.fp8 import Float8Matmul
from tetrad.models.init import Slicer, full_shape
from tetrad.models.loss import linear_cross_entropy
from tetrad.models.plans import assign
from tetrad.models.spec import module_at
from tetrad.parallel.compress import max_over
from tetrad.parallel.pipeline.weightgrad import Deferrable, SplitLinear, accumulate, split_matmul
from tetrad.precision import widen

SHARDED = ("dp", "fsdp", "cp")  # a tp-sharded parameter is still replicated over these


@dataclass
class TP:
    """What the tp layers need: the collectives, the tp group, whether SP is on, and the
    dtype a replicated weight's gradient is summed in (`parallel.reduce_dtype`)."""

    comm: Comm
    group: Group
    sp: bool
    reduce_dtype: torch.dtype = torch.float32

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Enter the tp region: replicate [b,s,h], or gather the sequence [b,s/t,h] -> [b,s,h]."""
        if self.sp:
            return gather_from_tp(x, self.comm, self.group, dim=1)
        return copy_to_tp(x, self.comm, self.group)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Leave the tp region: sum the partials [b,s,h], or sum and split the sequence."""
        if self.sp:
            return scatter_to_tp(partial, self.comm, self.group, dim=1)
        return reduce_from_tp(partial, self.comm, self.group)


# --- the layers -------------------------------------------------------------------------


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """Token ids [start, end) of `rank`: blocks of ceil(vocab/tp), the last one short."""
    block = -(-vocab // tp)
    return min(rank * block, vocab), min((rank + 1) * block, vocab)


class Float8Split(SplitLinear):
    """A tp linear whose matmul runs in FP8 once given a `Float8Matmul` (`use_fp8` calls
    `use_float8`), each scale along the dimension tp splits (`split`, models/fp8.py) the
    max over the tp group; the bias and the collectives around it stay as they are."""

    split = ""
    fp8: Float8Matmul | None = None

    def __init__(self, in_features: int, out_features: int, tp: TP, bias=False, device=None):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.tp = tp

    def use_float8(self, fp8: Float8Matmul) -> None:
        fp8.split_over(self.split, max_over(self.tp.comm, self.tp.group))
        self.fp8 = fp8

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # FP8 is refused with zero-bubble's deferred W (layout.py)
        return super().matmul(x) if self.fp8 is None else self.fp8.matmul(x, self.weight)


class ColumnParallelLinear(Float8Split):
    """Output features split over tp, and its bias if it has one (Qwen2's q, k, v); its
    input is already in the tp region, its tokens whole (gathered under SP). (Each tp
    linear is a `SplitLinear`: zero-bubble schedules defer its weight gradient to W, its
    collectives and bias staying in B.)"""

    split = "N"

    def __init__(self, in_features: int, out_features: int, tp: TP, device=None, bias=False):
        super().__init__(in_features, out_features // tp.group.size, tp, bias, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias


class RowParallelLinear(Float8Split):
    """Input features split over tp; the partial products are summed across tp."""

    split = "K"

    def __init__(self, in_features: int, out_features: int, tp: TP, device=None):
        super().__init__(in_features // tp.group.size, out_features, tp, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.leave(self.matmul(x))  # [b, s, h] or [b, s/t, h]


class ReplicatedKVLinear(nn.Module, Deferrable):
    """A k or v projection when kv_heads < tp: this rank computes the one kv head it needs.

    The weight [kv_heads·hd, h] is stored split by input features across tp ([.., h/t])
    and gathered for each use; the gather's backward is a reduce-scatter, which sums the
    gradients of the tp/kv_heads ranks sharing a head into each element's single owner.
    A bias (Qwen2) is replicated whole and enters the tp region (f), so the partial
    gradients of the ranks sharing a head are summed, as a sequence-parallel norm's.
    """

    def __init__(self, in_features: int, kv_heads: int, head_dim: int, tp: TP, device=None,
                 bias: bool = False):  # fmt: skip
        super().__init__()
        t = tp.group.size
        self.weight = nn.Parameter(
            torch.empty(kv_heads * head_dim, in_features // t, device=device)
        )
        self.bias = nn.Parameter(torch.empty(kv_heads * head_dim, device=device)) if bias else None
        self.tp = tp
        self.head = tp.group.rank * kv_heads // t  # the kv head of this rank's query heads
        self.rows = slice(self.head * head_dim, (self.head + 1) * head_dim)  # its weight rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp, weight = self.tp, self.weight  # the shard this forward uses (ZeRO re-points it)
        full = gather_from_tp(weight, tp.comm, tp.group, dim=1)  # [kv·hd, h]
        rows = full[self.rows]

        def sink(g: torch.Tensor) -> None:
            """W's destination (zero-bubble): the gradient of this rank's head rows [hd, h],
            placed in the full [kv·hd, h] and reduce-scattered over tp (what the gather's
            backward does in an ordinary backward), into the shard `weight`."""
            grad = g.new_zeros((weight.shape[0], g.shape[1]))
            grad[self.rows] = g
            accumulate(weight, reduce_scatter_along(grad, 1, tp.comm, tp.group))

        out = split_matmul(x, rows, self.store, sink)  # [b, s, hd]
        if self.bias is None:
            return out
        return out + copy_to_tp(self.bias, tp.comm, tp.group, tp.reduce_dtype)[self.rows]


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding table; other ids contribute zero before the sum."""

    def __init__(self, vocab: int, dim: int, tp: TP, device=None):
        super().__init__()
        self.start, end = vocab_range(vocab, tp.group.size, tp.group.rank)
        self.weight = nn.Parameter(torch.empty(end - self.start, dim, device=device))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.start
        inside = (local >= 0) & (local < rows)
        if rows == 0:  # a tiny vocabulary can leave the last ranks without rows
            partial = self.weight.new_zeros((*ids.shape, self.weight.shape[1]))
        else:
            partial = F.embedding(local.clamp(0, rows - 1), self.weight)
            partial = partial * inside.unsqueeze(-1).to(partial.dtype)
        return self.tp.leave(partial)  # [b, s, h] or [b, s/t, h]


class VocabParallelHead(SplitLinear):
    """The output head, split over the vocabulary: [b, s, h] -> local logits [b, s, V_r]."""

    def __init__(self, dim: int, vocab: int, tp: TP, device=None):
        start, end = vocab_range(vocab, tp.group.size, tp.group.rank)
        super().__init__(dim, end - start, bias=False, device=device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(self.tp.enter(x))


def sequence_parallel_norm(module: nn.Module, tp: TP) -> nn.Module:
    """The family's norm (`ModelSpec.norm_class`) on s/t of the sequence, its weight's gradient
    summed over tp: its gain enters the tp region (`use_gain`), its arithmetic its own.

    Each rank sees a different part of the sequence, so each holds a partial gradient of
    the (replicated) weight: forgetting this sum is the bug that shipped in Megatron and
    GPT-NeoX. It is done in the graph (f on the weight), so it is right with accumulation,
    and in `reduce_dtype`, as the data axis sums every other gradient (under bf16 compute,
    fp32 by default: one rounding to bf16 after the sum, not one per ring step).
    """
    module.use_gain(lambda weight: copy_to_tp(weight, tp.comm, tp.group, tp.reduce_dtype))
    return module


class SequenceParallelLogits(Deferrable):
    """An MoE layer's router logits under SP (the router's `logits` seam, `MoEParts`):
    each tp rank routes its own s/t of the tokens, so each holds a partial gradient of the
    (replicated) weight, summed over tp in the graph (f on the weight, in `reduce_dtype`),
    as `sequence_parallel_norm` sums its gain's. Deferred to W (zero-bubble), the sum is
    W's: it runs where the gradient is made."""

    def __init__(self, router: nn.Module, tp: TP):
        self.router, self.tp = router, tp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _summed_linear(widen(x), self.router.weight, self.tp, self.store, widen)  # [T/t, E]


class SequenceParallelLinear(Float8Split):
    """A replicated bias-free linear before a tp region under SP (latent attention's down
    projections): it runs on this rank's s/t of the sequence, so its weight's gradient is
    partial on each rank and summed over tp in the graph (f on the weight, in
    `reduce_dtype`), as `sequence_parallel_norm` sums its gain's; deferred to W
    (zero-bubble), the sum is W's. In FP8 its tokens are what tp splits."""

    split = "M"

    def __init__(self, linear: nn.Linear, tp: TP):
        super().__init__(linear.in_features, linear.out_features, tp, device=linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s/t, in] -> [b, s/t, out]
        matmul = F.linear if self.fp8 is None else self.fp8.matmul
        return _summed_linear(x, self.weight, self.tp, self.store, matmul=matmul)


def _summed_linear(x, weight, tp: TP, store, cast=lambda w: w, matmul=F.linear) -> torch.Tensor:
    """`matmul(x, cast(weight))` on this rank's own tokens, the weight's partial gradient
    summed over tp: in the graph (f on the weight, in `reduce_dtype`), or, deferred to W
    (`store`: zero-bubble), by W's destination (as f's backward sums it)."""
    if store is None:
        return matmul(x, cast(copy_to_tp(weight, tp.comm, tp.group, tp.reduce_dtype)))

    def sink(g: torch.Tensor) -> None:
        summed = g.to(tp.reduce_dtype)
        tp.comm.all_reduce(summed, tp.group)
        accumulate(weight, summed.to(g.dtype))

    return split_matmul(x, cast(weight), store, sink)


def _enters_inside(module: nn.Module) -> bool:
    """Whether a region module says where inside it the region starts (`use_entry`: latent
    attention, after its down projections)."""
    return callable(getattr(module, "use_entry", None))


def token_region(module: nn.Module, tp: TP) -> None:
    """Under SP, make `module` (an MoE layer's shared expert, fed this rank's flat tokens
    [T/t, h]) a tp region of its own: the tokens are all-gathered in (viewed as one
    sequence [1, T/t, h], so the region's gather and its row-wise linear's reduce-scatter
    work along the sequence dim as everywhere else) and its output is this rank's again
    (torch's forward hooks: the module's own way in and out)."""
    module.register_forward_pre_hook(lambda _, args: (tp.enter(args[0].unsqueeze(0)),))
    module.register_forward_hook(lambda _, args, out: out.squeeze(0))  # [T/t, h]


# --- the loss -----------------------------------------------------------------------------


class _VocabParallelCE(torch.autograd.Function):
    """Sum of token losses from vocab-split logits; one all-gather of two floats per token."""

    @staticmethod
    def forward(ctx, logits, targets, start, comm, group):
        z = widen(logits).flatten(0, -2)  # [N, V_r]: this rank's vocabulary only
        t = targets.flatten()
        valid = t != IGNORE
        local = t - start
        mine = valid & (local >= 0) & (local < z.shape[1])
        local = local.clamp(0, max(z.shape[1] - 1, 0))
        picked = z.gather(1, local[:, None])[:, 0] if z.shape[1] else z.new_zeros(t.shape)
        # per rank: log-sum-exp of its logits, and the target logit if it owns the target
        lse, target = _combine(
            torch.logsumexp(z, dim=1), torch.where(mine, picked, 0.0), comm, group
        )
        per_token = torch.where(valid, lse - target, 0.0)
        ctx.save_for_backward(z, lse, local, mine, valid)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return per_token.sum()

    @staticmethod
    def backward(ctx, grad):
        z, lse, local, mine, valid = ctx.saved_tensors
        # d loss / d z = softmax(z) - onehot(target), restricted to this rank's columns
        dz = torch.exp(z - lse[:, None]) * valid[:, None]
        rows = mine.nonzero()[:, 0]
        dz[rows, local[rows]] -= 1.0
        return (dz * grad).view(ctx.shape).to(ctx.dtype), None, None, None, None


def _combine(lse: torch.Tensor, picked: torch.Tensor, comm: Comm, group: Group):
    """The log-sum-exp over the whole vocabulary and the target logit, per token [N], from
    every rank's log-sum-exp and target logit (0 where another rank owns the target): one
    all-gather."""
    stats = torch.stack((lse, picked))  # [2, N]
    every = gather_along(stats, 0, comm, group).view(group.size, 2, -1)  # [t, 2, N]
    return torch.logsumexp(every[:, 0], dim=0), every[:, 1].sum(0)


class VocabParallelCrossEntropy:
    """The engine's loss_fn under tp: (local logits [b, s, V_r], targets [b, s]) -> loss sum.

    Equal to `cross_entropy_sum` over the full logits, which no rank ever holds.
    """

    def __init__(self, comm: Comm, group: Group, start: int):
        self.comm, self.group, self.start = comm, group, start

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _VocabParallelCE.apply(logits, targets, self.start, self.comm, self.group)


def vocab_parallel_chunked_loss(
    model: nn.Module, chunk: int, tp: TP, start: int, tied: bool
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The engine's loss_fn under tp with a chunked loss: (final-normed hidden, targets) ->
    loss sum, the vocabulary-parallel head applied chunk by chunk (`models/loss.py`)."""
    combine = functools.partial(_combine, comm=tp.comm, group=tp.group)

    def loss(h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not tied:  # what VocabParallelHead does first (a tied head's input
            h = tp.enter(h)  # entered the region at the final norm)
        # the head's weight [V_r, d] read at each call (ZeRO re-points it)
        return linear_cross_entropy(h, model.head_weight(), targets, chunk, start, combine)

    return loss


# --- applying a plan --------------------------------------------------------------------


@dataclass
class TPSharding:
    """What `parallelize` needs after `apply_tp`: slices to materialise, norm and loss rules."""

    slicer: Slicer
    replicated: dict[str, tuple[str, ...]]  # parameter -> axes it is replicated over
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    unshard: Callable[[str, torch.Tensor], torch.Tensor]
    # (model, chunk) -> the loss_fn of a model whose last stage stops before the head
    chunked_loss_fn: Callable[[nn.Module, int], Callable]


def shard_index(kind: str, shape: tuple[int, ...], tp: int, rank: int) -> tuple[slice, ...]:
    """Index of `rank`'s shard in a full tensor: split `rows`/`cols` evenly, or `vocab` rows
    (in blocks of ceil(V/tp), `vocab_range`'s: the even split where tp divides the size)."""
    dim = 1 if kind == "cols" else 0
    if kind != "vocab" and shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {shape[dim]} is not divisible by tp={tp}")
    index = [slice(None)] * len(shape)
    index[dim] = slice(*vocab_range(shape[dim], tp, rank))
    return tuple(index)


def _tp_module(module: nn.Module, style: str, tp: TP, m: ModelConfig, in_region: bool):
    """(replacement module, shard kind of its weight and bias) for one planned module (the
    same module, rewired in place, for a norm or router under SP). `in_region`: inside a
    region, where the column-wise linears leave each rank its own heads."""
    if style == "once" and tp.sp:  # the MoE layer's tokens stay split: see the plan
        module.use_logits(SequenceParallelLogits(module, tp))  # this rank's tokens routed
    if style in ("region", "replicated", "once", "tokens"):
        return module, None
    if style == "sequence" and isinstance(module, nn.Linear):  # before a region (MLA's)
        return (SequenceParallelLinear(module, tp) if tp.sp else module), None
    device, t = module.weight.device, tp.group.size
    bias = getattr(module, "bias", None) is not None
    if style == "kv" and m.kv_heads < t:
        kv = ReplicatedKVLinear(module.in_features, m.kv_heads, m.head_dim, tp, device, bias)
        return kv, "cols"
    if style in ("colwise", "kv"):  # kv: whole kv heads per rank, an ordinary column split
        args = (module.in_features, module.out_features, tp, device, bias)
        return ColumnParallelLinear(*args), "rows"
    if style == "rowwise":
        return RowParallelLinear(module.in_features, module.out_features, tp, device), "cols"
    if style == "vocab" and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(m.vocab, m.dim, tp, device), "vocab"
    if style == "vocab":
        return VocabParallelHead(m.dim, m.vocab, tp, device), "vocab"
    # a norm over each head's channels (QK-norm) sees only this rank's heads, SP or not
    if style == "sequence" and (tp.sp or in_region):
        return sequence_parallel_norm(module, tp), None
    return module, None  # a norm without SP: replicated


def _check_coverage(model: nn.Module, styles: dict[str, str], norm_class: type[nn.Module]) -> None:
    """Every weight-carrying layer (`norm_class`: the family's norms) must be planned: an
    unplanned one would be silently wrong."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, norm_class)) and name not in styles:
            raise ValueError(f"tensor-parallel plan has no entry for module {name!r}")
        style = styles.get(name)
        if style in ("colwise", "rowwise", "kv") and not isinstance(module, nn.Linear):
            raise ValueError(f"{name!r}: {style} needs an nn.Linear")
        if style in ("rowwise", "sequence") and getattr(module, "bias", None) is not None:
            raise ValueError(f"{name!r}: {style} needs a bias-free module")


def apply_tp(
    model: nn.Module,
    plan: dict[str, str],
    mesh: Mesh,
    comm: Comm,
    m: ModelConfig,
    sp: bool,
    reduce_dtype: torch.dtype = torch.float32,
) -> TPSharding:
    """Shrink `model` (on the meta device) to this rank's tp shards, following `plan`;
    `sp`: sequence parallelism in the norms and between the blocks; `reduce_dtype`: what
    the norm weights' gradients are summed over tp in, with SP."""
    spec = spec_for(m)
    tp = TP(comm, mesh["tp"], sp, reduce_dtype)
    styles = assign([n for n, _ in model.named_modules() if n], plan)
    _check_coverage(model, styles, spec.norm_class)
    # a region entered inside (MLA's, after its down projections) holds modules before it
    regions = tuple(
        name + "."
        for name, style in styles.items()
        if style == "region" and not _enters_inside(model.get_submodule(name))
    )
    kinds: dict[str, str] = {}  # parameter name -> shard kind
    for name, style in styles.items():
        module = model.get_submodule(name)
        new, kind = _tp_module(module, style, tp, m, name.startswith(regions))
        if new is not module:
            model.set_submodule(name, new)
        _enter_region(new, style, tp)
        if kind is not None:
            kinds[name + ".weight"] = kind
        if kind == "rows" and new.bias is not None:  # a column split splits its bias
            kinds[name + ".bias"] = kind
    final = module_at(model, spec.final_norm)
    if m.tie_embeddings and final is not None:
        # tied head: the final norm's output feeds F.linear with the embedding's vocab rows
        final.register_forward_hook(lambda _, __, out: tp.enter(out))
    return _layout(kinds, tp, m)


def _enter_region(module: nn.Module, style: str, tp: TP) -> None:
    """Where a region's input enters tp. Under SP an MoE layer is no region (its tokens
    stay split over tp; the router's weight gradient is summed instead), and its shared
    expert is a region of its own. A region that names its own entry (`use_entry`: latent
    attention) is entered there, its replicated modules before it (`sequence`) outside."""
    moe_tokens_split = tp.sp and callable(getattr(module, "use_dispatch", None))
    if style == "region" and _enters_inside(module):
        module.use_entry(tp.enter)  # the narrow latents enter, not the full-width input
    elif style == "region" and not moe_tokens_split:
        module.register_forward_pre_hook(lambda _, args: (tp.enter(args[0]),))
    if style == "once" and not tp.sp:
        module.register_forward_pre_hook(lambda _, args: (once_in_tp(args[0], tp.group),))
    if style == "tokens" and tp.sp:
        token_region(module, tp)


def _layout(kinds: dict[str, str], tp: TP, m: ModelConfig) -> TPSharding:
    t, rank = tp.group.size, tp.group.rank

    def slicer(name: str) -> tuple[slice, ...] | None:
        return shard_index(kinds[name], full_shape(name, m), t, rank) if name in kinds else None

    def unshard(name: str, local: torch.Tensor) -> torch.Tensor:
        if name not in kinds:
            return local
        return gather_full(local, kinds[name], full_shape(name, m), tp)

    start = vocab_range(m.vocab, t, rank)[0]
    return TPSharding(
        slicer=slicer,
        replicated={name: SHARDED for name in kinds},
        loss_fn=VocabParallelCrossEntropy(tp.comm, tp.group, start),
        unshard=unshard,
        chunked_loss_fn=functools.partial(
            vocab_parallel_chunked_loss, tp=tp, start=start, tied=m.tie_embeddings
        ),
    )


@torch.no_grad()
def gather_full(local: torch.Tensor, kind: str, shape: tuple[int, ...], tp: TP) -> torch.Tensor:
    """The full tensor from every tp rank's shard (`shard_index`'s blocks along one dim, in
    rank order): each shard padded to a whole block to gather, so the padding (only the
    last ranks' shards are short) all lies past the full size, which is kept."""
    dim = 1 if kind == "cols" else 0
    block = -(-shape[dim] // tp.group.size)
    pad = [0, 0] * (local.dim() - 1 - dim) + [0, block - local.shape[dim]]  # F.pad: last dim first
    return gather_along(F.pad(local, pad), dim, tp.comm, tp.group).narrow(dim, 0, shape[dim])
