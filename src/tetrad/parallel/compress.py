"""Compressed gradient reduction: block-scaled int8 or fp8, each value quantized once per
hop, with error feedback.

A gradient is cut into blocks of `BLOCK` values, each sent as one byte per value and one
fp32 scale (its largest magnitude over the format's largest value): 1 + 4/BLOCK bytes a
value against fp32's 4. The all-reduce is the two halves of a ring's, each moving
quantized bytes (ZeRO++'s quantized reduce-scatter, by all-to-all):
  1. reduce-scatter: every rank quantizes its gradient and sends piece j to rank j
     (one all-to-all); rank j dequantizes the pieces it received and sums them in fp32, in
     rank order, the same on every rank of any size;
  2. all-gather (data parallelism only; ZeRO keeps its shard): each rank quantizes its
     summed piece and the pieces are gathered and dequantized.
A rank sends (n-1)/n of the quantized buffer in each half: the ring all-reduce's 2(n-1)/n
factor, over about a quarter of fp32's bytes.

Error feedback: what quantization dropped at each hop (`Residual`: the sender's over its
whole gradient, the summing rank's over its piece) is added to the next step's values
before they are quantized, so the error does not accumulate over steps (1-bit Adam's
compensation; without it, a component below a block's step is never sent at all). The
residuals are each rank's own state: checkpoints save and restore them (train/checkpoint.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tetrad.comm import Comm, Work
from tetrad.comm.tp import gather_along
from tetrad.config import BLOCK  # values per scale
from tetrad.mesh import Group
from tetrad.models.fp8 import E4M3
from tetrad.models.fp8 import quantize as to_float8

# format -> (its storage dtype, the largest magnitude it represents)
FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
SCALE_BYTES = 4  # an fp32 scale per block


def wire_bytes(numel: int) -> int:
    """Bytes of `numel` values quantized (a multiple of BLOCK): one each, and the scales."""
    return numel + SCALE_BYTES * numel // BLOCK


def piece_sizes(numel: int, ranks: int) -> tuple[int, int]:
    """Each rank's piece of `numel` values (the last one short), and that piece rounded up
    to whole blocks: what each rank sums, and what it sends each rank."""
    piece = -(-numel // ranks)
    return piece, -(-piece // BLOCK) * BLOCK


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [m·BLOCK] fp32 -> its wire form, uint8 [m, BLOCK + 4]: each block's values, then
    its scale's four bytes (one buffer, so one collective carries both)."""
    dtype, top = FORMATS[fmt]
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(1, keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block
    q = blocks / scale
    q = (q.round() if dtype == torch.int8 else q).clamp(-top, top).to(dtype)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def dequantize(wire: torch.Tensor, fmt: str) -> torch.Tensor:
    """The inverse of `quantize`: uint8 [m, BLOCK + 4] -> fp32 [m·BLOCK]."""
    dtype, _ = FORMATS[fmt]
    values = wire[:, :BLOCK].contiguous().view(dtype).float()
    scale = wire[:, BLOCK:].contiguous().view(torch.float32)
    return (values * scale).reshape(-1)


class Residual:
    """Error feedback for one hop: `send(x)` quantizes x plus what the last call dropped,
    and keeps what this one drops. Off (`feedback=False`): x quantized as it is. `size`:
    the values each call sends (what a checkpoint's copy must match; 0: unknown)."""

    def __init__(self, fmt: str, feedback: bool, size: int = 0):
        self.fmt, self.feedback, self.size = fmt, feedback, size
        self.error: torch.Tensor | None = None  # fp32, x's size

    def send(self, x: torch.Tensor) -> torch.Tensor:
        if not self.feedback:
            return quantize(x, self.fmt)
        if self.error is None:
            self.error = torch.zeros_like(x)
        x = x + self.error
        wire = quantize(x, self.fmt)
        self.error = x - dequantize(wire, self.fmt)
        return wire


class QuantizedReduce:
    """One flat fp32 gradient's compressed sum over `group` (see the module docstring):
    `start(x)` quantizes x and launches the all-to-all; `finish()` sums this rank's piece
    (rank r's: values r·piece to (r+1)·piece, ZeRO's shard when n divides the size) and,
    given `gather`, all-gathers every piece (the whole sum), else returns the piece."""

    def __init__(self, numel: int, group: Group, comm: Comm, fmt: str, feedback: bool):
        self.group, self.comm, self.fmt, self.numel = group, comm, fmt, numel
        self.piece, self.width = piece_sizes(numel, group.size)
        self.sent = Residual(fmt, feedback, group.size * self.width)
        self.summed = Residual(fmt, feedback, self.width)
        self.work: Work | None = None
        self.arrived: torch.Tensor | None = None

    def residuals(self, name: str, gather: bool = True) -> dict[str, Residual]:
        """Its error feedback by name: the sender's, and (`gather`: data parallelism) the
        summing rank's; none without feedback."""
        hops = {f"{name}.sent": self.sent} | ({f"{name}.summed": self.summed} if gather else {})
        return {k: r for k, r in hops.items() if r.feedback}

    def start(self, x: torch.Tensor) -> None:
        n = self.group.size
        flat = F.pad(x.reshape(-1).float(), (0, n * self.piece - self.numel))
        rows = F.pad(flat.view(n, self.piece), (0, self.width - self.piece))  # whole blocks
        wire = self.sent.send(rows.view(-1))  # [blocks, BLOCK + 4]: piece j, then j + 1
        self.arrived = torch.empty_like(wire)
        split = [wire.shape[0] // n] * n
        self.work = self.comm.all_to_all(
            self.arrived, wire, split, split, self.group, "quantized_reduce_scatter", True
        )

    def finish(self, gather: bool = True) -> torch.Tensor:
        """This rank's summed piece [piece] (gather=False), or the whole sum [numel]."""
        self.work.wait()
        n = self.group.size
        piece = dequantize(self.arrived, self.fmt).view(n, -1).sum(0)  # in rank order
        self.work = self.arrived = None
        if not gather:
            return piece[: self.piece]
        everything = gather_along(self.summed.send(piece), 0, self.comm, self.group)
        whole = dequantize(everything, self.fmt).view(n, self.width)[:, : self.piece]
        return whole.reshape(-1)[: self.numel]


class PieceWork:
    """A started reduction as a collective's work, for ZeRO: waiting for it writes this
    rank's summed piece (its shard) into `out`."""

    def __init__(self, reduce: QuantizedReduce, out: torch.Tensor):
        self.reduce, self.out = reduce, out

    def is_completed(self) -> bool:
        return self.reduce.work.done()

    def wait(self) -> None:
        self.out.copy_(self.reduce.finish(gather=False))


def max_over(comm: Comm, group: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    """An FP8 scale's reduction over the ranks of `group` that hold the rest of its values
    (`Float8Linear.split_over`; the FP8 gather's scales): the amax, made their max in place
    by one all-reduce, returned."""

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(amax, group, op="max")
        return amax

    return reduce


class Float8Gather:
    """ZeRO-3's all-gather of one unit whose FP8 linears' weights travel in FP8
    (`--fp8-all-gather`, tensorwise). Rank r sends its shard's values of the other
    parameters (norms, routed experts) in the compute dtype, then its FP8 weights' values
    as one byte each (e4m3, each weight's values over that weight's scale), padded to the
    most any rank sends (`width` bytes, a multiple of the dtype's size). The gathered
    bytes hold every FP8 weight whole (`w8`, which the linears take as it is) and the rest,
    written into the compute buffer.

    The scales (`bind`, the owner's): a weight's amax is the largest of its shards'
    (`amax`, every unit's reduced in one all-reduce with max), so each rank divides by the
    scale `models.fp8.scaled` takes of the whole weight, and the gathered weight is the
    whole one quantized, value for value."""

    def __init__(self, linears: list[tuple[int, tuple[int, ...], Any]], numel: int,
                 padded: int, rank: int, n: int, dtype: torch.dtype, device):  # fmt: skip
        """`linears`: (offset in the unit's flat buffer, shape, module) of each FP8 weight,
        its module a `models.fp8.Float8Linear`."""
        self.n, self.dtype, self.groups, self.linears = n, dtype, len(linears), linears
        # each value's FP8 weight, -1: another parameter's (the padding is neither: never sent)
        weight = torch.full((numel,), -1, dtype=torch.long)
        for i, (off, shape, _) in enumerate(linears):
            weight[off : off + math.prod(shape)] = i
        shard, e = padded // n, dtype.itemsize
        rank_of = torch.arange(numel) // shard
        fp8, other = weight >= 0, weight < 0
        counts8 = torch.bincount(rank_of[fp8], minlength=n)
        counts = torch.bincount(rank_of[other], minlength=n)
        self.others = int(counts.max())  # the most other values a rank holds
        width = int((counts8 + e * counts).max())
        self.width = -(-width // e) * e
        mine = rank_of == rank
        self.fp8_at = (fp8 & mine).nonzero().squeeze(1).to(device) - rank * shard
        self.which = weight[fp8 & mine].to(device)
        self.other_at = (other & mine).nonzero().squeeze(1).to(device) - rank * shard
        # where each received value lands: rank j's k-th other value (at j·others + k of
        # the gathered others), and its k-th FP8 byte (at j·width + e·counts[j] + k)
        firsts8, firsts = counts8.cumsum(0) - counts8, counts.cumsum(0) - counts
        j8, jo = rank_of[fp8], rank_of[other]
        k8, ko = torch.arange(len(j8)) - firsts8[j8], torch.arange(len(jo)) - firsts[jo]
        self.src8 = (j8 * self.width + e * counts[j8] + k8).to(device)
        self.dst8 = fp8.nonzero().squeeze(1).to(device)
        self.src = (jo * self.others + ko).to(device)
        self.dst = other.nonzero().squeeze(1).to(device)
        self.w8 = torch.zeros(padded, dtype=torch.uint8, device=device)
        self.recv = torch.zeros(n * self.width, dtype=torch.uint8, device=device)
        self.scales: torch.Tensor | None = None  # [groups] fp32, a view of the owner's

    def bind(self, scales: torch.Tensor) -> None:
        """Take `scales` [groups] as the weights' (refreshed by the owner), and make each
        linear take its weight from the gathered FP8 values and its scale."""
        self.scales = scales
        for (off, shape, linear), scale in zip(self.linears, scales):
            linear.cast_from(self.w8[off : off + math.prod(shape)].view(E4M3).view(shape), scale)

    def amax(self, master: torch.Tensor) -> torch.Tensor:
        """Each weight's largest magnitude over this rank's shard (0: none of it here)."""
        values = master.to(self.dtype)[self.fp8_at].abs().float()
        out = torch.zeros(self.groups, device=master.device)
        return out.scatter_reduce_(0, self.which, values, "amax")

    def start(self, master: torch.Tensor, comm: Comm, group: Group) -> tuple[Work, torch.Tensor]:
        """Quantize this rank's shard and launch the gather; (work, the buffer sent)."""
        for t in (self.w8, self.recv):
            t.untyped_storage().resize_(t.numel())
        values = master.to(self.dtype)
        q = to_float8(values[self.fp8_at], self.scales[self.which], E4M3)
        mine = torch.cat([values[self.other_at].view(torch.uint8), q.view(torch.uint8)])
        send = F.pad(mine, (0, self.width - mine.numel()))  # the other values, then FP8
        return comm.all_gather(self.recv, send, group, async_op=True), send

    def land(self, data: torch.Tensor) -> None:
        """After the gather: the FP8 weights into `w8`, the other values into `data`."""
        self.w8[self.dst8] = self.recv[self.src8]
        rows = self.recv.view(self.n, self.width)[:, : self.others * self.dtype.itemsize]
        data[self.dst] = rows.contiguous().view(self.dtype).reshape(-1)[self.src]
        self.recv.untyped_storage().resize_(0)

    def free(self) -> None:
        self.w8.untyped_storage().resize_(0)
