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
  per layer, kv heads only), then ordinary attention of the local queries against the
  whole sequence, masked by global position. Its backward reduce-scatters dk and dv.
- "ring": the kv blocks travel around the ring of cp ranks; each step posts the next
  send/receive, computes the local queries against the block in hand (whole blocks above
  the diagonal skipped, so each off-diagonal step is half a block of work) and merges it
  with an online softmax in fp32 (log-sum-exp merging). The backward recomputes each
  block from the saved log-sum-exp, and the blocks' dk and dv (fp32) travel around the
  ring with them, arriving home summed. Memory: one kv block in flight, never all of S.

Both are exact: the same sums as one process, up to fp32 round-off. docs/cp.md gives the
bytes each moves per layer, which tests/test_cp.py checks against `Comm`'s counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.comm import Comm
from tetrad.comm.cp import gather_from_cp, ring_pass
from tetrad.config import CP_ATTENTION, Config
from tetrad.mesh import Group, Mesh
from tetrad.models.llama import Attention, apply_rotary, rotary_at


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


class _CPCore(nn.Module):
    """What both cores share: the cp group, and the rotary of this rank's global positions."""

    def __init__(self, head_dim: int, theta: float, comm: Comm, group: Group):
        super().__init__()
        self.head_dim, self.theta, self.comm, self.group = head_dim, theta, comm, group

    def positions(self, local: int, device) -> torch.Tensor:
        return chunk_positions(local * self.group.size, self.group.size, self.group.rank, device)

    def rotated(self, q, k, v):
        """[b, s/cp, heads·hd] each -> q [b, s/cp, h, hd], k, v [b, s/cp, kvh, hd], rotary
        applied at the global positions; and those positions."""
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        pos = self.positions(s, q.device)
        rope = rotary_at(pos, self.head_dim, self.theta)
        return apply_rotary(q, rope), apply_rotary(k, rope), v, pos


class AllGatherCore(_CPCore):
    """Local queries against every rank's keys and values, all-gathered (kv heads only)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[:2]
        q, k, v, pos = self.rotated(q, k, v)
        kv = gather_from_cp(torch.stack((k, v)), self.comm, self.group, dim=2)  # [2,b,S,kvh,hd]
        n = self.group.size
        every = torch.cat([chunk_positions(s * n, n, r, q.device) for r in range(n)])
        mask = pos[:, None] >= every[None, :]  # [s/cp, S]: causal by global position
        k, v = kv[0], kv[1]
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return out.transpose(1, 2).reshape(b, s, -1)


class RingCore(_CPCore):
    """Ring attention: kv blocks around the cp ranks, online softmax (see the module doc)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[:2]
        q, k, v, _ = self.rotated(q, k, v)
        out = _RingAttention.apply(q, k, v, self.comm, self.group)
        return out.reshape(b, s, -1)


# --- ring attention ----------------------------------------------------------------------


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


def _scores(q, k, rows, cols, diagonal, scale):
    """fp32 scores [b, kvh, rep, rows, cols] of a block; masked causally on the diagonal."""
    s = torch.matmul(q[..., rows, :], k[..., cols, :].transpose(-1, -2)) * scale
    if diagonal:
        n = s.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
    return s


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, s, h, hd] -> fp32 [b, kvh, h/kvh, s, hd]: query heads grouped by their kv head."""
    b, s, h, hd = x.shape
    return x.float().view(b, s, kv_heads, h // kv_heads, hd).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `_grouped` (still fp32): [b, kvh, rep, s, hd] -> [b, s, h, hd]."""
    b, g, rep, s, hd = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, g * rep, hd)


def _kv_block(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A travelling block [2, b, s, kvh, hd] -> fp32 k, v [b, kvh, 1, s, hd]."""
    k, v = kv.float().permute(0, 1, 3, 2, 4).unsqueeze(3).unbind(0)
    return k, v


class _RingAttention(torch.autograd.Function):
    """softmax(qkᵀ/√d)v over the whole sequence from this rank's queries and the kv blocks
    passed around the ring. q [b, s, h, hd], k and v [b, s, kvh, hd] (rotated, local)."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, group: Group):
        n, r, c = group.size, group.rank, q.shape[1] // 2
        scale = q.shape[-1] ** -0.5
        qg = _grouped(q, k.shape[2])  # [b, kvh, rep, s, hd]
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), device=q.device)  # [b, kvh, rep, s]
        kv = torch.stack((k, v)).contiguous()  # [2, b, s, kvh, hd]: what travels
        for i in range(n):
            works, nxt = [], None
            if i < n - 1:  # the next block travels while this one is computed
                nxt = torch.empty_like(kv)
                works = ring_pass(kv, nxt, comm, group)
            rows, cols, diag = _block(r, (r - i) % n, c)
            kb, vb = _kv_block(kv)
            s = _scores(qg, kb, rows, cols, diag, scale)
            block_lse = torch.logsumexp(s, dim=-1)
            block_out = torch.matmul(torch.exp(s - block_lse[..., None]), vb[..., cols, :])
            merged = torch.logaddexp(lse[..., rows], block_lse)
            out[..., rows, :] = (
                out[..., rows, :] * torch.exp(lse[..., rows] - merged)[..., None]
                + block_out * torch.exp(block_lse - merged)[..., None]
            )
            lse[..., rows] = merged
            for w in works:
                w.wait()
            kv = nxt
        ctx.comm, ctx.group = comm, group
        ctx.save_for_backward(q, k, v, out, lse)
        return _ungrouped(out).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        comm, group = ctx.comm, ctx.group
        n, r, c = group.size, group.rank, q.shape[1] // 2
        scale = q.shape[-1] ** -0.5
        qg, dout = _grouped(q, k.shape[2]), _grouped(grad, k.shape[2])
        delta = (dout * out).sum(-1)  # [b, kvh, rep, s]: rowsum(dO ∘ O)
        dq = torch.zeros_like(qg)
        kv = torch.stack((k, v)).contiguous()
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)  # travels
        incoming: list = []  # the dkv of the block now in hand, still arriving
        for i in range(n):
            works, nxt = [], None
            if i < n - 1:
                nxt = torch.empty_like(kv)
                works = ring_pass(kv, nxt, comm, group)
            local = _block_grads(qg, dout, delta, lse, kv, dq, (r, (r - i) % n, c), scale)
            for w in incoming:
                w.wait()
            dkv = dkv + local  # the sum of every rank that used this block so far
            arriving = torch.empty_like(dkv)
            incoming = ring_pass(dkv, arriving, comm, group)  # on to the block's next user
            for w in works:
                w.wait()
            kv, dkv = nxt, arriving
        for w in incoming:  # after n hops, this rank's own block's dk, dv, summed
            w.wait()
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return _ungrouped(dq).to(q.dtype), dk, dv, None, None


def _block_grads(qg, dout, delta, lse, kv, dq, where, scale) -> torch.Tensor:
    """Add one block's dq to `dq`; return its (dk, dv) contribution [2, b, s, kvh, hd]."""
    rank, src, c = where
    rows, cols, diag = _block(rank, src, c)
    kb, vb = _kv_block(kv)
    p = torch.exp(_scores(qg, kb, rows, cols, diag, scale) - lse[..., rows, None])
    d_rows = dout[..., rows, :]
    dv = torch.matmul(p.transpose(-1, -2), d_rows).sum(2)  # [b, kvh, cols, hd]
    ds = p * (torch.matmul(d_rows, vb[..., cols, :].transpose(-1, -2)) - delta[..., rows, None])
    dq[..., rows, :] += torch.matmul(ds, kb[..., cols, :]) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg[..., rows, :]).sum(2) * scale
    grads = torch.zeros((2, *kv.shape[1:]), dtype=torch.float32, device=kv.device)
    grads[0][:, cols] = dk.permute(0, 2, 1, 3)  # [b, cols, kvh, hd]
    grads[1][:, cols] = dv.permute(0, 2, 1, 3)
    return grads


CORES = dict(zip(CP_ATTENTION, (AllGatherCore, RingCore)))


def apply_cp(model: nn.Module, mesh: Mesh, comm: Comm, cfg: Config) -> None:
    """Swap every attention core of `model` for the configured cp core (no parameters:
    nothing to shard or materialise)."""
    kind = CORES[cfg.parallel.cp_attention]
    for module in model.modules():
        if isinstance(module, Attention):
            core = module.core
            module.core = kind(core.head_dim, core.theta, comm, mesh["cp"])
