"""The output projection and cross-entropy fused, in chunks of tokens: full logits never exist.

`cross_entropy_sum(head(h))` holds the fp32 logits of every token of a microbatch (and
backward their gradient): b·s·V·4 bytes, 12 GiB of the last stage's memory for Llama 3 8B
at sequence 8192. `LinearCrossEntropy` keeps only the head's input h and one fp32
log-sum-exp per token. Forward projects `chunk` tokens at a time and keeps their
log-sum-exp; backward projects each chunk again and turns it into its logit gradient
(softmax - one-hot, times the incoming gradient), then into the chunk's input gradient and
its share of the weight gradient. The peak is one chunk of logits: chunk·V·(4 + 4 + c)
bytes. The price is the head's forward matmul done twice (2·N·V·h more FLOPs per
microbatch; MFU still counts model FLOPs).

The arithmetic is the unfused one's (the same log-sum-exp, the same logit gradient cast to
the compute dtype before the two matmuls), so results equal it up to the order of the
weight gradient's sum over chunks. Vocabulary-parallel tensor parallelism passes
`combine`, which turns every rank's per-token (log-sum-exp, target logit) into the global
ones (one all-gather of two floats per token, as the unfused vocab-parallel loss does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tetrad.models.batch import IGNORE
from tetrad.precision import wide, widen


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token losses (targets == -100 are padding); callers divide by the global count."""
    return F.cross_entropy(
        widen(logits).flatten(0, -2), targets.flatten(), reduction="sum", ignore_index=IGNORE
    )


# (local log-sum-exp [N], local target logit [N], 0 where not owned) -> global (lse, logit)
Combine = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    step = chunk if chunk > 0 else max(n, 1)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk, start, combine):
        x = h.flatten(0, -2)  # [N, h]
        t = targets.flatten()
        valid = t != IGNORE
        local = t - start  # the target's column in this rank's vocabulary block
        rows = weight.shape[0]
        mine = valid & (local >= 0) & (local < rows)
        local = local.clamp(0, max(rows - 1, 0))
        lse = x.new_empty(t.shape, dtype=wide(x.dtype))
        picked = x.new_zeros(t.shape, dtype=wide(x.dtype))
        for lo, hi in _chunks(t.numel(), chunk):
            z = widen(F.linear(x[lo:hi], weight))  # [c, V_r]: the only logits alive
            lse[lo:hi] = torch.logsumexp(z, dim=1) if rows else float("-inf")
            if rows:
                picked[lo:hi] = z.gather(1, local[lo:hi, None])[:, 0]
        picked = torch.where(mine, picked, 0.0)
        if combine is not None:
            lse, picked = combine(lse, picked)
        ctx.save_for_backward(h, weight, lse, local, mine, valid)
        ctx.chunk = chunk
        return torch.where(valid, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        h, weight, lse, local, mine, valid = ctx.saved_tensors
        x = h.flatten(0, -2)
        grad_x = torch.zeros_like(x)
        grad_w = torch.zeros(weight.shape, dtype=wide(weight.dtype), device=weight.device)
        if weight.shape[0]:
            for lo, hi in _chunks(x.shape[0], ctx.chunk):
                # in place, one chunk of logits alive: the softmax, minus the one-hot target
                dz = widen(F.linear(x[lo:hi], weight))
                dz.sub_(lse[lo:hi, None]).exp_().mul_(valid[lo:hi, None])
                # minus one at each owned target: a scatter, not an index (no host sync)
                dz.scatter_add_(1, local[lo:hi, None], -mine[lo:hi, None].to(dz.dtype))
                dz = dz.mul_(grad).to(x.dtype)
                grad_x[lo:hi] = dz @ weight
                grad_w += widen(dz.t() @ x[lo:hi])
        return grad_x.view_as(h), grad_w.to(weight.dtype), None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    start: int = 0,
    combine: Combine | None = None,
) -> torch.Tensor:
    """Sum over tokens of cross_entropy(h @ weight.T, targets), `chunk` tokens at a time.

    h [b, s, d], weight [V_r, d] (the vocabulary rows start..start+V_r), targets [b, s]
    (-100: padding). `combine` (vocabulary parallelism) makes the per-token statistics
    global; without it the rows are the whole vocabulary."""
    return _LinearCrossEntropy.apply(h, weight, targets, chunk, start, combine)


class ChunkedCrossEntropy:
    """The engine's loss function when the model stops before its head (`logits=False`):
    (final-normed hidden [b, s, d], targets [b, s]) -> sum of token losses."""

    def __init__(self, model, chunk: int):
        self.model, self.chunk = model, chunk
        self.loss = linear_cross_entropy

    def __call__(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # read at each call: ZeRO re-points the attribute at every pass
        return self.loss(h, self.model.head_weight(), targets, self.chunk)

    def compile(self, *args, **kwargs) -> None:
        """torch.compile (`args`, `kwargs` its own) of the head and loss, the autograd
        function's forward and backward whole (`fullgraph`: a break would leave it eager
        unnoticed). The weight is an input, read eagerly at each call (ZeRO's view)."""
        self.loss = torch.compile(linear_cross_entropy, *args, fullgraph=True, **kwargs)
