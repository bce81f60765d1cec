"""Data parallelism, ours: bucketed gradient all-reduce overlapped with backward.

Each parameter's `.grad` is a view into a flat bucket buffer, so a bucket is all-reduced in
place with no copies. A post-accumulate-grad hook marks a parameter ready; when every
parameter of a bucket is ready the bucket's all-reduce is launched asynchronously, while
backward keeps computing the earlier layers. Buckets are launched strictly in index order,
so every rank issues the same collectives in the same order. On accumulation microbatches
(`sync=False`) the hooks do nothing: gradients accumulate locally (`no_sync`).

No averaging: the trainer divides every microbatch's summed token loss by the token count
of the *global* batch, so the sum over data ranks is already the single-process gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.comm import Comm, Work
from tetrad.mesh import Group


class Bucket:
    """A flat buffer holding the gradients of a few consecutive parameters."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.pending = len(params)
        self.work: Work | None = None
        offset = 0
        for p in params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


class LocalGrads:
    """No data axis: gradients stay where backward leaves them (a `GradSync`)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        self.named = named
        self.sync = True

    def params(self) -> list[tuple[str, nn.Parameter]]:
        return self.named

    def finish(self) -> None:
        pass

    def zero_grad(self) -> None:
        for _, p in self.named:
            if p.grad is not None:
                p.grad.zero_()

    def after_step(self) -> None:
        pass


class GradBuckets(LocalGrads):
    """All-reduces gradients over `group` in buckets of about `bucket_bytes`, during backward
    (a `GradSync`)."""

    def __init__(
        self, named: list[tuple[str, nn.Parameter]], group: Group, comm: Comm, bucket_bytes: int
    ):
        super().__init__(named)
        self.group, self.comm = group, comm
        params = [p for _, p in named if p.requires_grad]
        self.buckets = self._make_buckets(params, bucket_bytes)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.launched = 0  # buckets [0, launched) have their all-reduce in flight
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
        # Backward produces gradients roughly in reverse order of definition.
        buckets, current, size = [], [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        return [Bucket(b, b[0].dtype, b[0].device) for b in buckets]

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync or self.group.size == 1:
            return
        bucket = self.buckets[self.bucket_of[id(p)]]
        bucket.pending -= 1
        while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:
            self._launch(self.buckets[self.launched])

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = self.comm.all_reduce(bucket.buffer, self.group, async_op=True)
        self.launched += 1

    def finish(self) -> None:
        """Launch what backward did not (unused parameters), wait for all, reset."""
        if self.group.size > 1:
            while self.launched < len(self.buckets):
                self._launch(self.buckets[self.launched])
            for b in self.buckets:
                b.work.wait()
        for b in self.buckets:
            b.pending, b.work = len(b.params), None
        self.launched = 0

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()


class TiedGrads:
    """Another `GradSync` whose gradients of `tied` are then summed over `group`: a
    parameter two ranks hold (the embedding tied across the first and last pipeline
    stages), each with the gradient of its own uses."""

    def __init__(self, inner: LocalGrads, tied: nn.Parameter, group: Group, comm: Comm):
        self.inner, self.tied, self.group, self.comm = inner, tied, group, comm

    @property
    def sync(self) -> bool:
        return self.inner.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.inner.sync = value

    def params(self) -> list[tuple[str, nn.Parameter]]:
        return self.inner.params()

    def finish(self) -> None:
        self.inner.finish()
        self.comm.all_reduce(self.tied.grad, self.group)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def after_step(self) -> None:
        self.inner.after_step()
