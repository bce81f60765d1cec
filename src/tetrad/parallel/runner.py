"""The parts an engine is assembled from: a runner, a gradient sync, and what they share.

A *runner* runs forward and backward over this rank's microbatches of a step (the plain
loop below, or the pipeline runtime); a *gradient sync* turns the accumulated gradients
into the global batch's and owns the optimizer's tensors (none: `data.LocalGrads`; DP:
`data.GradBuckets`; ZeRO: `zero.ZeroShards`). The runner tells the sync, through `sync`,
which backward may launch reductions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from tetrad.comm import Work
from tetrad.models.batch import Microbatch
from tetrad.models.loss import ChunkedCrossEntropy, cross_entropy_sum
from tetrad.parallel.activation_meter import ActivationMeter

if TYPE_CHECKING:
    from tetrad.parallel.compress import Residual

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def loss_for(model: nn.Module, chunk: int, tp: Any = None) -> LossFn:
    """Cross-entropy over the head's logits, or (`chunk` > 0 tokens) the head and the loss
    fused in chunks of tokens, the model stopping at the final norm; vocabulary-parallel
    under tp (`tp`: its `tensor.TPSharding`, not imported here, since tensor.py imports
    the pipeline package, whose split timing calls this) either way."""
    if chunk == 0:
        return tp.loss_fn if tp else cross_entropy_sum
    model.end_at_norm()
    return tp.chunked_loss_fn(model, chunk) if tp else ChunkedCrossEntropy(model, chunk)


class Denominator:
    """The loss's divisor: the token count of the global batch, summed over the data ranks
    by a collective launched as the step starts (`work`) and waited for at its first use,
    when the first microbatch's forward is done: the forward overlaps the collective
    instead of waiting for it. The value is the count, at least 1, in fp32 like the loss
    it divides (the same quotient as dividing by a Python number)."""

    def __init__(self, count: torch.Tensor, work: Work | None = None):
        self.count, self.work = count, work
        self._value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self._value is None:
            if self.work is not None:
                self.work.wait()
            self._value = self.count.clamp(min=1).float()
        return self._value


@dataclass
class RunResult:
    """What one step's forward and backward did on this rank."""

    loss: torch.Tensor  # this rank's share of the step's loss (float64, on the device)
    peak_activation_bytes: int = 0  # the most bytes autograd held saved for backward at once

    @property
    def events(self) -> list:
        """Timed computes (a pipeline's timeline); none here."""
        return []

    @property
    def comm_events(self) -> list:
        """The async collectives of a pipeline's step (its communication lane); none here."""
        return []


@dataclass
class Held:
    """The live tensors of a gradient sync's model state, by category (what the memory
    measurement counts; shared storage is counted once, in the first category)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    masters: list[torch.Tensor]  # fp32 copies the optimizer steps (mixed precision)


class GradSync(Protocol):
    """Makes this rank's gradients those of the global batch, and owns the tensors the
    optimizer updates (the parameters, or ZeRO's shard views of them)."""

    def reduce_in_backward(self, on: bool) -> None:
        """Whether the next backward's hooks launch the reductions (the last microbatch's);
        off: it only accumulates (no_sync), and only `final` launches."""

    def params(self) -> list[tuple[str, nn.Parameter]]: ...

    def final(self, names: Collection[str]) -> AbstractContextManager[None]:
        """A context for backward work that is the step's last for the parameters
        `names`: their reductions launch during it or as it ends (a pipeline's runtime)."""

    def launch_rest(self) -> None:
        """Launch every reduction of the step backward did not (the rest of `finish`)."""

    def finish(self) -> None:
        """Launch what backward did not, and wait for every reduction of the step."""

    def zero_grad(self) -> None: ...

    def after_step(self) -> None:
        """After the optimizer (ZeRO-1/2 gather the updated shards)."""

    def held(self) -> Held:
        """The tensors of the model state it owns (parameters, gradients, masters)."""

    def residuals(self) -> dict[str, Residual]:
        """Its compressed reductions' error feedback by name: rank state checkpoints keep."""


class Runner(Protocol):
    """Runs forward and backward over this rank's microbatches of one step."""

    holds_loss: bool  # whether this rank computes the loss (holds the head)
    meter: ActivationMeter  # counts the activations its forwards save

    def run(self, micro: list[Microbatch], denom: Denominator, grads: GradSync) -> RunResult:
        """Accumulate gradients of sum(token losses)/denom into the parameters."""


class MicrobatchLoop:
    """The runner without a pipeline: each microbatch forward then backward, in turn."""

    holds_loss = True  # every rank runs the whole model

    def __init__(self, model: nn.Module, loss_fn: LossFn, meter_every: int = 0):
        self.model, self.loss_fn = model, loss_fn
        self.meter = ActivationMeter()  # what autograd saves: the step's activations
        self.meter_every = meter_every

    def run(self, micro: list[Microbatch], denom: Denominator, grads: GradSync) -> RunResult:
        device = denom.count.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        self.meter.measure(self.meter_every)
        self.meter.reset([*self.model.parameters(), *grads.held().params])
        for i, mb in enumerate(micro):
            # no_sync: only the last microbatch's backward launches the reductions
            grads.reduce_in_backward(i == len(micro) - 1)
            with self.meter.saving():
                # copies: on CPU `.to` would keep views of the step's whole batch, whose
                # storage autograd's saved ids would hold (a GPU copies anyway)
                logits = self.model(mb.inputs.to(device, copy=True))
                loss = self.loss_fn(logits, mb.targets.to(device, copy=True)) / denom.value()
            del logits  # the graph keeps what backward needs; the logits may go (b·s·V)
            loss.backward()
            total += loss.detach().double()
        return RunResult(total, peak_activation_bytes=self.meter.finish())
