"""Data parallelism, ours: bucketed gradient all-reduce overlapped with backward.

Each parameter's `.grad` is a view into a flat bucket buffer, so a bucket is all-reduced in
place with no copies. A post-accumulate-grad hook marks a parameter ready; when every
parameter of a bucket is ready the bucket's all-reduce is launched asynchronously, while
backward keeps computing the layers before them. Buckets are launched strictly in index order,
so every rank issues the same collectives in the same order. The first bucket (the last
layers, whose gradients backward produces first) closes at `first_bucket_bytes` (by
default, on a GPU, `FIRST_BUCKET_BYTES`: with one big bucket nothing could launch before
backward ends, and a small first one starts the reduction a few layers into it; on CPU
one bucket like the others, see `first_bucket_bytes`). On accumulation
microbatches (`sync=False`) the hooks do nothing: gradients accumulate locally (`no_sync`).

No averaging: the trainer divides every microbatch's summed token loss by the token count
of the *global* batch, so the sum over data ranks is already the single-process gradient.

Mixed precision (`train.dtype` bf16), as ZeRO does it on its shards: the model computes in
bf16 parameters; the optimizer steps fp32 master copies (`Masters`), which are what
`params()` returns. Gradients accumulate in bf16 (in the buckets), are all-reduced in
`parallel.reduce_dtype` (a bucket is cast to it when launched) and become the masters'
fp32 gradients, which live from `finish` to `zero_grad`; `after_step` copies the updated
masters into the bf16 parameters.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from tetrad.comm import Comm, Work
from tetrad.mesh import Group
from tetrad.parallel.compress import QuantizedReduce, Residual
from tetrad.parallel.runner import Held
from tetrad.precision import mixed, widen

Named = list[tuple[str, nn.Parameter]]

# DDP's first bucket too: small enough to fill early in backward, big enough that one
# all-reduce's fixed cost stays small beside its bytes
FIRST_BUCKET_BYTES = 2**20


def first_bucket_bytes(device: torch.device, bucket_bytes: int) -> int:
    """The first bucket's size by default: `FIRST_BUCKET_BYTES` on a GPU, whose collectives
    run on their own streams while backward computes, so an early first bucket hides its
    reduction; on CPU `bucket_bytes`, one bucket like the others. gloo reduces there on
    the cores backward computes on, so an early all-reduce moves work rather than hiding
    it, and each extra all-reduce costs its fixed part (docs/dp.md: measured)."""
    return bucket_bytes if device.type == "cpu" else FIRST_BUCKET_BYTES


def bucket_spans(nbytes: list[int], first: int, rest: int) -> list[list[int]]:
    """The buckets of parameters of these byte sizes, as indices, taken in reverse order:
    the first bucket closes once it reaches `first` bytes (`rest` at most), the others
    `rest` (pure: the runtime's buckets, and the planner's)."""
    spans: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(nbytes))):
        spans[-1].append(i)
        size += nbytes[i]
        if size >= (rest if len(spans) > 1 else min(first, rest)):
            spans.append([])
            size = 0
    return [s for s in spans if s]


class Masters:
    """fp32 master copies of parameters that compute in a lower precision.

    Built from the materialised fp32 parameters, which it then casts to `dtype` in place
    (the modules keep their Parameter objects, so hooks and names stay)."""

    def __init__(self, named: Named, dtype: torch.dtype):
        self.model = named
        self.named: Named = []
        for name, p in named:
            master = nn.Parameter(widen(p.detach()).clone(), requires_grad=p.requires_grad)
            p.data = p.data.to(dtype)
            self.named.append((name, master))
        self.of = {id(p): m for (_, p), (_, m) in zip(named, self.named)}

    def take_grads(self) -> None:
        """The masters' fp32 gradients from the parameters' (no data axis)."""
        for (_, p), (_, m) in zip(self.model, self.named):
            m.grad = None if p.grad is None else p.grad.to(m.dtype)

    def drop_grads(self) -> None:
        for _, m in self.named:
            m.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After the optimizer: the compute parameters are the rounded masters."""
        for (_, p), (_, m) in zip(self.model, self.named):
            p.copy_(m)


class Bucket:
    """A flat buffer holding the gradients of a few consecutive parameters."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = params[0].new_zeros(sum(p.numel() for p in params))  # their dtype
        self.pending = len(params)
        self.work: Work | None = None
        self.sent: torch.Tensor | None = None  # what is all-reduced: the buffer, or its cast
        self.quantized: QuantizedReduce | None = None  # a compressed reduction's state
        for p, grad in zip(params, self.views(self.buffer)):
            p.grad = grad

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` (a buffer's size) as its parameters' views, each in its shape."""
        pieces = flat.split([p.numel() for p in self.params])
        return [piece.view_as(p) for piece, p in zip(pieces, self.params)]


class LocalGrads:
    """No data axis: gradients stay where backward leaves them (a `GradSync`). With a
    compute `dtype` below fp32, the optimizer steps fp32 masters of them."""

    def __init__(self, named: Named, dtype: torch.dtype = torch.float32):
        self.named = named
        self.masters = Masters(named, dtype) if mixed(dtype) else None
        self.sync = True

    def reduce_in_backward(self, on: bool) -> None:
        self.sync = on

    def params(self) -> Named:
        """The optimizer's tensors: the parameters, or their fp32 masters."""
        return self.masters.named if self.masters else self.named

    def final(self, names: Collection[str]) -> AbstractContextManager[None]:
        """Nothing to reduce: the backward inside simply runs."""
        return nullcontext()

    def launch_rest(self) -> None:
        """Nothing to reduce."""

    def finish(self) -> None:
        if self.masters:
            self.masters.take_grads()

    def zero_grad(self) -> None:
        for _, p in self.named:
            if p.grad is not None:
                p.grad.zero_()
        if self.masters:
            self.masters.drop_grads()

    def after_step(self) -> None:
        if self.masters:
            self.masters.copy_to_model()

    def residuals(self) -> dict[str, Residual]:
        """A compressed reduction's error feedback by name (checkpoints): none here."""
        return {}

    def held(self) -> Held:
        params = [p for _, p in self.named]
        masters = [m for _, m in self.masters.named] if self.masters else []
        return Held(params, [t.grad for t in params + masters], masters)


class GradBuckets(LocalGrads):
    """All-reduces gradients over `group` (of two ranks or more: alone, `LocalGrads`) in
    buckets of about `bucket_bytes`, during backward (a `GradSync`)."""

    def __init__(
        self,
        named: Named,
        group: Group,
        comm: Comm,
        bucket_bytes: int,
        dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        compress: str = "",
        feedback: bool = True,
    ):
        """`compress` ("int8", "fp8"; "": none): each bucket's sum quantized by blocks
        (parallel/compress.py), with error feedback unless `feedback` is off."""
        super().__init__(named, dtype)  # casts the parameters first: buckets take their dtype
        self.group, self.comm, self.reduce_dtype = group, comm, reduce_dtype
        # consecutive parameters in reverse order of definition (roughly the order backward
        # produces their gradients), as `bucket_spans` groups them
        params = [p for _, p in named if p.requires_grad]
        sizes = [p.numel() * p.element_size() for p in params]
        spans = bucket_spans(sizes, first_bucket_bytes, bucket_bytes)
        self.buckets = [Bucket([params[i] for i in span]) for span in spans]
        if compress:
            for b in self.buckets:
                b.quantized = QuantizedReduce(b.buffer.numel(), group, comm, compress, feedback)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.launched = 0  # buckets [0, launched) have their all-reduce in flight
        self.by_name = dict(named)
        self.armed: set[int] = set()  # parameters whose next accumulation is their last
        self.counted: set[int] = set()  # parameters marked ready this step
        for p in params:  # (every bucket's)
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextmanager
    def final(self, names: Collection[str]) -> Iterator[None]:
        """The backward work inside is the last of the step for the parameters `names`
        (a pipeline stage's last B, BW or W): a bucket launches as soon as autograd has
        accumulated its last parameter, or, for what autograd did not touch (W's
        weight gradients, unused parameters), when the work is done."""
        params = [self.by_name[n] for n in names if n in self.by_name]
        self.armed.update(id(p) for p in params)
        try:
            yield
        finally:
            self.armed.difference_update(id(p) for p in params)
        for p in params:
            self._count(p)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self.sync or id(p) in self.armed:
            self._count(p)

    def _count(self, p: nn.Parameter) -> None:
        """`p`'s gradient is final: launch the buckets now complete, in index order."""
        if id(p) in self.counted or id(p) not in self.bucket_of:
            return
        self.counted.add(id(p))
        bucket = self.buckets[self.bucket_of[id(p)]]
        bucket.pending -= 1
        while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:
            self._launch(self.buckets[self.launched])

    def _launch(self, bucket: Bucket) -> None:
        buf = bucket.buffer
        if bucket.quantized is not None:  # the all-to-all half now, the gather in `finish`
            bucket.quantized.start(buf.float())
        else:
            bucket.sent = buf.to(self.reduce_dtype)
            bucket.work = self.comm.all_reduce(bucket.sent, self.group, async_op=True)
        self.launched += 1

    def launch_rest(self) -> None:
        """Launch what backward did not (unused parameters)."""
        while self.launched < len(self.buckets):
            self._launch(self.buckets[self.launched])

    def finish(self) -> None:
        """Launch what backward did not, wait for all, reset."""
        self.launch_rest()
        for b in self.buckets:
            if b.quantized is not None:
                b.sent = b.quantized.finish()
            else:
                b.work.wait()
            self._land(b)
            b.pending, b.work = len(b.params), None
        self.launched = 0
        self.counted.clear()

    def _land(self, bucket: Bucket) -> None:
        """Put a reduced bucket where the optimizer reads it: the masters' fp32 gradients
        (views of the reduced buffer when it is fp32), or back into the buffer."""
        sent, bucket.sent = bucket.sent, None
        if self.masters is None:
            if sent is not bucket.buffer:
                bucket.buffer.copy_(sent)
            return
        for p, grad in zip(bucket.params, bucket.views(widen(sent))):
            self.masters.of[id(p)].grad = grad

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
        if self.masters:
            self.masters.drop_grads()

    def residuals(self) -> dict[str, Residual]:
        """Each compressed bucket's residuals, as "bucket<i>.sent" and "bucket<i>.summed"."""
        out: dict[str, Residual] = {}
        for i, b in enumerate(self.buckets):
            if b.quantized is not None:
                out |= b.quantized.residuals(f"bucket{i}")
        return out

    def held(self) -> Held:
        """`LocalGrads.held`, and a compressed reduction's residuals among the gradients."""
        held = super().held()
        quantized = [b.quantized for b in self.buckets if b.quantized is not None]
        held.grads += [r.error for q in quantized for r in (q.sent, q.summed)]
        return held


class TiedGrads:
    """Another `GradSync` whose gradients of the optimizer tensor `tied` (a name) are then
    summed over `group`: a parameter two ranks hold (the embedding tied across the first
    and last pipeline stages), each with the gradient of its own uses. Everything but
    `finish` is the inner sync's (its `final` too: the sum over `group` waits for
    `finish`)."""

    def __init__(self, inner: LocalGrads, tied: str, group: Group, comm: Comm):
        self.inner, self.group, self.comm = inner, group, comm
        self.tied = dict(inner.params())[tied]  # the parameter, or its fp32 master

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def finish(self) -> None:
        self.inner.finish()
        self.comm.all_reduce(self.tied.grad, self.group)
