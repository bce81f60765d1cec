"""Context parallelism: every sequence split over the cp ranks, attention across them.

Layout. A sequence of S tokens is cut into 2·cp chunks of c = S/(2·cp); cp rank r holds
chunks r and 2·cp-1-r, end to end (`chunk_positions`). Under the causal mask an early
chunk has little to attend to and a late one much, so pairing the r-th from the start
with the r-th from the end gives every rank the same attention work. The loader hands
each rank its two chunks of every sequence's tokens and targets (`split_sequence`), so
everything per token (embedding, norms, MLP, head, loss) runs on the local tokens
unchanged: only attention's core needs the other ranks' keys and values, and this module
swaps it (`apply_cp`, on the meta device, like tensor parallelism's layers). Rotary
embeddings use the global positions of the two chunks.

Two cores, `parallel.cp_attention` picks:
- "allgather" (the default): keys and values of every rank all-gathered (one collective
  per layer, kv heads only), then the local queries against each rank's block in turn,
  merged like the ring's (below) but with no communication inside. The gather's backward
  reduce-scatters dk and dv. It saves the whole sequence's keys and values (unrepeated).
- "ring": the kv blocks travel around the ring of cp ranks; each step posts the next
  send/receive, computes the local queries against the block in hand (whole blocks above
  the diagonal skipped, so each off-diagonal step is half a block of work) and merges it
  with an online softmax in fp32 (log-sum-exp merging). The backward recomputes each
  block from the saved log-sum-exp, and the blocks' dk and dv (fp32) travel around the
  ring with them, arriving home summed. Memory: one kv block in flight, never all of S.

Keys and values travel side by side in one tensor [b, s, kv heads, hd + v_hd]: values
may have a head size of their own and rotary may turn only the last channels of each
head (latent attention: the core's `rope_dim`, `v_head_dim`; `CPCore`).

Each block (this rank's queries against one rank's keys and values) runs through a
kernel that returns its output and log-sum-exp, and whose backward, given the merged
output and log-sum-exp, returns the block's share of the gradients: torch's fused
attention op for the device and dtype, or plain matmuls (`parallel.cp_kernel`, the table
in context_kernels.py).

Both are exact: the same sums as one process, up to fp32 round-off. docs/cp.md gives the
bytes each moves per layer, which tests/test_cp.py checks against `Comm`'s counts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tetrad.comm import Comm
from tetrad.comm.cp import gather_from_cp, ring_pass
from tetrad.mesh import Group, Mesh
from tetrad.models.plans import matches
from tetrad.models.spec import ModelSpec, Rotary
from tetrad.parallel.context_kernels import BlockKernel, pick_kernel
from tetrad.precision import wide, widen


def chunk_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions cp rank `rank` holds, in its local order: chunk r, then chunk
    2·cp-1-r, of 2·cp chunks of a `seq_len` sequence (int64)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} does not split into 2*cp={2 * cp} chunks")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat((first, last))


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's two chunks of the full sequence `x` along `dim` ([b, S] -> [b, S/cp])."""
    if cp == 1:
        return x
    return x.index_select(dim, chunk_positions(x.shape[dim], cp, rank, x.device))


class CPCore(nn.Module):
    """A context-parallel attention core (`attention`: "allgather" or "ring", see the module
    doc) in place of `core`, with its `theta` and per-head widths: q and k (`head_dim`), the
    channels of them rotary turns (`rope_dim`: all, or the last ones: latent attention)
    and v's (`v_head_dim`), the last two where it has them. It rotates with the family's
    `rotary` at this rank's global positions, each block through the kernel of kind
    `kernel` (parallel.cp_kernel: fused or unfused)."""

    def __init__(
        self, attention: str, core: nn.Module, rotary: Rotary, comm: Comm, group: Group,
        kernel: str,
    ):  # fmt: skip
        super().__init__()
        self.ring, self.theta, self.comm, self.group = attention == "ring", core.theta, comm, group
        self.head_dim = hd = core.head_dim
        self.rope_dim = getattr(core, "rope_dim", hd)
        self.v_head_dim = getattr(core, "v_head_dim", hd)
        self.rotary, self.kernel = rotary, kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[b, s/cp, heads·hd] (v: heads·v_hd) -> [b, s/cp, heads·v_hd]."""
        b, s = q.shape[:2]
        q, k = (t.view(b, s, -1, self.head_dim) for t in (q, k))
        v = v.view(b, s, -1, self.v_head_dim)  # [b, s/cp, kvh, v_hd]
        n, rank = self.group.size, self.group.rank
        pos = chunk_positions(s * n, n, rank, q.device)  # this rank's, global
        rope = self.rotary.tables(pos, self.rope_dim, self.theta)
        q, k = self.rotary.apply(q, rope), self.rotary.apply(k, rope)
        if self.ring:
            out = _RingAttention.apply(q, k, v, self.comm, self.group, self.kernel)
        else:  # every rank's keys and values, all-gathered (kv heads only): [b, S, kvh, ·]
            kv = gather_from_cp(torch.cat((k, v), -1), self.comm, self.group, dim=1)
            out = _GatheredAttention.apply(q, kv, rank, self.kernel)
        return out.reshape(b, s, -1)


# --- blockwise attention: what both cores compute, one kv block (one rank's) at a time -----


def _block(rank: int, src: int, c: int):
    """Which of this rank's query rows meet which of rank `src`'s key columns, and whether
    a causal mask is needed inside: (rows, cols, diagonal). With chunks (r, 2cp-1-r) and
    (j, 2cp-1-j): j < r: both query chunks see all of chunk j and none of 2cp-1-j; j > r:
    only query chunk 2cp-1-r sees anything, and it sees both of j's chunks."""
    if src == rank:
        return slice(0, 2 * c), slice(0, 2 * c), True
    if src < rank:
        return slice(0, 2 * c), slice(0, c), False
    return slice(c, 2 * c), slice(0, 2 * c), False


def _heads(kv: torch.Tensor, rep: int, k_dim: int, cols: slice) -> tuple[torch.Tensor, ...]:
    """One rank's block [b, s, kvh, k_dim + v_dim] (k and v side by side: v may be narrower,
    latent attention's) -> k, v [b, H, s, ·] of the positions `cols`, repeated to the query
    heads (only for the kernel: what travels and what is saved stays unrepeated)."""
    kv = kv.transpose(1, 2)[:, :, cols]  # [b, kvh, m, ·]
    k, v = kv.split([k_dim, kv.shape[-1] - k_dim], dim=-1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return k.contiguous(), v.contiguous()


class _Online:
    """The running softmax(qkᵀ/√d)v of this rank's queries over the blocks seen so far:
    output and log-sum-exp in fp32, each block merged by log-sum-exp."""

    def __init__(self, q: torch.Tensor, kv_heads: int, v_dim: int, kernel: BlockKernel):
        self.q = q.transpose(1, 2).contiguous()  # [b, H, s, hd]
        self.kernel = kernel
        self.rep, self.scale = q.shape[2] // kv_heads, q.shape[-1] ** -0.5
        # laid out [b, s, H, v_hd] (seen as [b, H, s, v_hd]): in fp32 the result handed on
        # is this very tensor, so the next matmul's saved input and ours are one
        shape = (*q.shape[:-1], v_dim)
        self.out = torch.zeros(shape, dtype=wide(q.dtype), device=q.device).transpose(1, 2)
        self.lse = self.out.new_full(self.q.shape[:-1], float("-inf"))  # [b, H, s], as out

    def add(self, kv: torch.Tensor, where: tuple[int, int, int]) -> None:
        """Merge the block of rank `src`'s keys and values; `where` = (rank, src, chunk)."""
        rows, cols, diag = _block(*where)
        k, v = _heads(kv, self.rep, self.q.shape[-1], cols)
        q = self.q[:, :, rows].contiguous()
        block_out, block_lse = self.kernel.forward(q, k, v, diag, self.scale)
        lse = self.lse[..., rows]
        merged = torch.logaddexp(lse, block_lse)
        self.out[:, :, rows] = (
            self.out[:, :, rows] * torch.exp(lse - merged)[..., None]
            + widen(block_out) * torch.exp(block_lse - merged)[..., None]
        )
        self.lse[..., rows] = merged

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self.out.transpose(1, 2).to(dtype)  # [b, s, H, v_hd]: itself in fp32


class _Grads:
    """The backward of `_Online`, block by block, from the saved output and log-sum-exp."""

    def __init__(self, q, grad, out, lse, kv_heads: int, kernel: BlockKernel):
        self.q = q.transpose(1, 2).contiguous()
        self.rep, self.scale = q.shape[2] // kv_heads, q.shape[-1] ** -0.5
        self.dq = torch.zeros(self.q.shape, dtype=wide(q.dtype), device=q.device)
        # what the rows slice: dout, q, out [b, H, s, ·] and lse [b, H, s]
        self._mine = (grad.transpose(1, 2).contiguous(), self.q, out.to(q.dtype), lse)
        self.kernel = kernel

    def block(self, kv: torch.Tensor, where: tuple[int, int, int]) -> torch.Tensor:
        """Add one block's dq; return its (dk | dv) [b, s, kvh, k_dim + v_dim] in fp32."""
        rows, cols, diag = _block(*where)
        k_dim = self.q.shape[-1]
        k, v = _heads(kv, self.rep, k_dim, cols)
        dout, q, out, lse = (t[:, :, rows].contiguous() for t in self._mine)
        dq, dk, dv = self.kernel.backward(dout, q, k, v, out, lse, diag, self.scale)
        self.dq[:, :, rows] += widen(dq)
        grads = torch.zeros(kv.shape, dtype=wide(kv.dtype), device=kv.device)
        for part, g in zip((slice(0, k_dim), slice(k_dim, None)), (dk, dv)):
            b, _, m, hd = g.shape  # [b, H, m, ·] -> summed per kv head [b, m, kvh, ·]
            per_kv = widen(g).view(b, -1, self.rep, m, hd).sum(2).transpose(1, 2)
            grads[:, cols, :, part] = per_kv
        return grads

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dq.transpose(1, 2).to(dtype)  # [b, s, H, hd]


class _GatheredAttention(torch.autograd.Function):
    """This rank's queries q [b, s, h, hd] against the gathered kv [b, cp·s, kvh, hd + v_hd]
    (rank-major), block by block; saves only q, kv, the fp32 output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, kv, rank: int, kind: str):
        v_dim = kv.shape[-1] - q.shape[-1]
        ctx.kernel = pick_kernel(kind, q, v_dim)
        run = _Online(q, kv.shape[2], v_dim, ctx.kernel)
        for src, block in enumerate(kv.split(q.shape[1], dim=1)):  # rank src's
            run.add(block, (rank, src, q.shape[1] // 2))
        ctx.rank = rank
        ctx.save_for_backward(q, kv, run.out, run.lse)
        return run.result(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, kv, out, lse = ctx.saved_tensors
        s = q.shape[1]
        grads = _Grads(q, grad, out, lse, kv.shape[2], ctx.kernel)
        blocks = enumerate(kv.split(s, dim=1))
        dkv = torch.cat([grads.block(kv_j, (ctx.rank, j, s // 2)) for j, kv_j in blocks], dim=1)
        return grads.result(q.dtype), dkv.to(kv.dtype), None, None


def _around(kv: torch.Tensor, comm: Comm, group: Group) -> Iterator[torch.Tensor]:
    """The kv blocks in the order the ring brings them, this rank's own first: each next
    one's transfer is posted before the one in hand is yielded, and waited for when the
    caller asks for it (so what the caller launches meanwhile goes first)."""
    for i in range(group.size):
        works, nxt = [], None
        if i < group.size - 1:
            nxt = torch.empty_like(kv)
            works = ring_pass(kv, nxt, comm, group)
        yield kv
        for w in works:
            w.wait()
        kv = nxt


class _RingAttention(torch.autograd.Function):
    """The same from this rank's own k [b, s, kvh, hd], v [b, s, kvh, v_hd]: the kv blocks
    (k and v side by side) pass around the
    ring, the next in flight while the one in hand is computed; in backward their dk, dv
    (fp32) travel with them and arrive home, after cp hops, summed over every user."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, group: Group, kind: str):
        n, r, c = group.size, group.rank, q.shape[1] // 2
        ctx.kernel = pick_kernel(kind, q, v.shape[-1])
        run = _Online(q, k.shape[2], v.shape[-1], ctx.kernel)
        kv = torch.cat((k, v), -1).contiguous()  # [b, s, kvh, hd + v_hd]: what travels
        for i, block in enumerate(_around(kv, comm, group)):
            run.add(block, (r, (r - i) % n, c))
        ctx.comm, ctx.group = comm, group
        ctx.save_for_backward(q, k, v, run.out, run.lse)
        return run.result(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        comm, group = ctx.comm, ctx.group
        n, r, c = group.size, group.rank, q.shape[1] // 2
        grads = _Grads(q, grad, out, lse, k.shape[2], ctx.kernel)
        kv = torch.cat((k, v), -1).contiguous()
        dkv = torch.zeros(kv.shape, dtype=wide(k.dtype), device=q.device)  # travels
        incoming: list = []  # the dkv of the block now in hand, still arriving
        for i, block in enumerate(_around(kv, comm, group)):
            local = grads.block(block, (r, (r - i) % n, c))
            for w in incoming:
                w.wait()
            dkv = dkv + local  # the sum of every rank that used this block so far
            arriving = torch.empty_like(dkv)
            incoming = ring_pass(dkv, arriving, comm, group)  # on to the block's next user
            dkv = arriving
        for w in incoming:  # after n hops: this rank's own block's dk, dv, summed
            w.wait()
        dq = grads.result(q.dtype)
        dk, dv = dkv.split([k.shape[-1], v.shape[-1]], dim=-1)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def apply_cp(
    model: nn.Module,
    mesh: Mesh,
    comm: Comm,
    attention: str,
    spec: ModelSpec,
    kernel: str = "fused",
) -> None:
    """Swap every attention core of `model` (the modules its family's `spec` names, with
    their `theta` and widths) for the cp core `attention` (allgather or
    ring), rotating with the spec's rotary and attending block by block with the `kernel`
    kind (fused or unfused): no parameters, nothing to shard or materialise."""
    cores = [(n, m) for n, m in model.named_modules() if matches(spec.attention_core, n)]
    for name, core in cores:
        model.set_submodule(name, CPCore(attention, core, spec.rotary, comm, mesh["cp"], kernel))
