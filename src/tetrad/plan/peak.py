"""The allocator's peak on one rank: what is alive, beyond the model state and the saved
activations, at the step's fullest moment.

The steady figures (model state, activations in flight) are exact; the peak adds the
transients of one moment, and which moment wins depends on the layout, so each candidate
is stated with its terms and the largest is the peak:

- *loss forward* (last stage): one chunk of logits in fp32 and log-sum-exp's exponentials
  of them (tetrad's chunked head); an unchunked head keeps its logits among the
  activations and is charged at its backward.
- *loss backward* (last stage): one chunk's logit gradient (and its cast), the head
  input's gradient, the head weight's fp32 gradient and one chunk's share of it; unchunked,
  the fp32 logit gradient and its cast. An engine whose loss is eager `F.cross_entropy` on
  the logits cast to fp32 (torchtitan's) holds one fp32 tensor more under tp, where
  DTensor's loss_parallel fuses the two backwards, and leaves the compute-dtype logits'
  space reserved but unusable (`eager_loss_backward`, `eager_loss_hole`).
- *block backward* (every stage): SwiGLU's backward holds the gradient of its product and
  of both inputs at once (two f-wide tensors beyond the saved ones) and the residual
  stream's gradient; under recomputation, what the policy recomputes; without a flash
  kernel, one layer's attention scores.
- *optimizer step*: the activations are gone; fused AdamW updates in place, so nothing
  beyond the model state.

Terms every moment of the forward and backward shares: ZeRO-3's gathered parameters
(the root, from its first use to the end of backward, and the blocks gathered at once),
ZeRO-2/3's unsharded gradients awaiting their reduce-scatter (at a block's backward;
where they are accumulated whole over microbatches, at every moment: a later
microbatch's loss runs beside the earlier ones' gradients); and, as a negative term,
the gradients the model state counts that exist only from the reduction to the optimizer
step (ZeRO's fp32 shards, mixed precision's fp32 gradients): the forward and backward do
not hold them yet. A pipeline stage other than
the first keeps a receive pool of two buffers (the next input and the gradient coming
back); the outputs it sends are already counted with the activations (`peak_in_flight`).

Measured against the CPU allocator on tetrad's own runs (tests/test_plan_peak.py) and
against torchtitan's published peaks (docs/plan.md, "Peak memory").
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.config import ModelConfig
from tetrad.layout import Layout
from tetrad.models.families import spec_for
from tetrad.plan import activations as act
from tetrad.plan.candidates import held_stages
from tetrad.plan.engines import Implementation


@dataclass(frozen=True)
class Peak:
    """The moment of a rank's allocator peak and the bytes alive then beyond the model
    state and the activations in flight, term by term (a negative term: part of the model
    state or the activations not alive at that moment)."""

    moment: str
    terms: tuple[tuple[str, float], ...]
    # bytes the caching allocator holds at that moment beyond the live tensors, for a
    # stated reason (a freed tensor's space no allocation of the moment fits): counted in
    # the device's peak (`Memory.total`), not in the allocated peak
    reserved: tuple[tuple[str, float], ...] = ()

    @property
    def transient(self) -> float:
        return sum(v for _, v in self.terms)

    @property
    def reserved_bytes(self) -> float:
        return sum(v for _, v in self.reserved)


@dataclass(frozen=True)
class PeakSettings:
    """The engine and recompute policy whose transients these are, and the ZeRO and
    gradient terms `Footprint` counts for the rank."""

    engine: Implementation
    recompute: str
    zero_gathered: float  # ZeRO-3's gathered parameters, bytes
    zero_grads: float  # ZeRO-2/3's unsharded gradients alive in backward, bytes
    late_grads: float  # model-state gradients alive only from the reduction on, bytes
    # of zero_grads: the whole gradients accumulated over microbatches, alive through every
    # moment of the later microbatches (their loss too), not at a block's backward only
    accumulated_grads: float


def with_optimizer_step(moment: Peak, acts: float) -> Peak:
    """The larger of `moment` (`busiest_moment`) and the optimizer step's, whose
    transients are the `acts` bytes of activations freed by then: the only moment that
    reads the activations, so a pipeline's ranks share the others."""
    step = Peak("optimizer step", _nonzero([("activations (freed by then)", -acts)]))
    return max([moment, step], key=lambda pk: pk.transient + pk.reserved_bytes)


def busiest_moment(lay: Layout, m: ModelConfig, pp_rank: int, s: PeakSettings) -> Peak:
    """The largest of the rank's moments in the forward and backward (the first of
    equals, as `with_optimizer_step` takes them)."""
    stages = held_stages(lay, pp_rank)
    # terms alive through the forward and backward (module docstring)
    shared = [("ZeRO-3 gathered parameters", s.zero_gathered),
              ("ZeRO gradients accumulated over microbatches", s.accumulated_grads),
              ("gradients not yet reduced (in the state)", -s.late_grads)]  # fmt: skip
    if 0 not in stages:
        shared.append(("pipeline receive pool", 2 * stage_input_bytes(lay, m)))
    block = [("block backward", block_backward(lay, m, s)),
             ("ZeRO unsharded gradients", s.zero_grads - s.accumulated_grads)]  # fmt: skip
    moments = [("block backward", block + shared, [])]
    if lay.stages - 1 in stages:  # the last stage: the head and the loss
        chunked = s.engine.chunked_loss and lay.loss_chunk > 0  # a chunk of tokens at a time
        fwd, bwd = loss_forward(lay, m, chunked), loss_backward(lay, m, chunked)
        hole = []
        if s.engine.eager_loss and not chunked:
            bwd = eager_loss_backward(lay, m)
            hole = [("freed logits' space", eager_loss_hole(lay, m))]
        moments.append(("loss forward", [("loss chunk, forward", fwd)] + shared, []))
        moments.append(("loss backward", [("loss chunk, backward", bwd)] + shared, hole))
    peaks = [Peak(name, _nonzero(terms), _nonzero(reserved)) for name, terms, reserved in moments]
    return max(peaks, key=lambda pk: pk.transient + pk.reserved_bytes)


def _nonzero(terms: list[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    return tuple((k, float(v)) for k, v in terms if v)


def stage_input_bytes(lay: Layout, m: ModelConfig) -> float:
    """Bytes of one microbatch's hidden states between stages: b·s·h·c (s/tp under SP)."""
    tokens = lay.microbatch_size * lay.local_seq / (lay.tp if lay.sp else 1)
    return tokens * m.dim * lay.element_bytes


def loss_forward(lay: Layout, m: ModelConfig, chunked: bool) -> float:
    """One chunk of logits (c bytes, and their fp32 copy where c < 4) and log-sum-exp's
    fp32 exponentials of them. Unchunked: 0 here (the logits are saved activations and
    their fp32 work is charged to the loss backward). `chunked`: whether the head and the
    loss run `lay.loss_chunk` tokens at a time."""
    if not chunked:
        return 0.0
    c = lay.element_bytes
    n, v = min(lay.loss_chunk, lay.microbatch_tokens), m.vocab / lay.tp
    return n * v * (4 + 4 + (c if c < 4 else 0))


def loss_backward(lay: Layout, m: ModelConfig, chunked: bool) -> float:
    """Chunked: a chunk's fp32 logit gradient (and its cast), the input gradient, the
    fp32 weight gradient and a chunk's share of it. Unchunked: log-softmax's backward
    holds its fp32 output gradient and its input gradient at once (its saved output is
    among the activations)."""
    c, n_all = lay.element_bytes, lay.microbatch_tokens
    if not chunked:  # log-softmax's backward: in and out
        return n_all * m.vocab / lay.tp * 8
    n, v = min(lay.loss_chunk, n_all), m.vocab / lay.tp
    cast = c if c < 4 else 0
    return n * v * (4 + cast) + n_all * m.dim * c + v * m.dim * (4 + 4 + cast)


def eager_loss_backward(lay: Layout, m: ModelConfig) -> float:
    """Eager `F.cross_entropy(logits.float(), ...)` (torchtitan's loss_fn): the backward of
    nll_loss and log_softmax holds the fp32 one-hot gradient and the fp32 input gradient
    beside the saved log-probabilities, 8·N·V/t; under tp DTensor's loss_parallel fuses the
    two into (one-hot + exp(log-probs)) · scale, which holds the zero-filled one-hot,
    exp, their sum and the product at once (torch.distributed.tensor.parallel.loss): three
    fp32 tensors beside the saved one, 12·N·V/t."""
    tensors = 3 if lay.tp > 1 else 2
    return tensors * 4 * lay.microbatch_tokens * m.vocab / lay.tp


def eager_loss_hole(lay: Layout, m: ModelConfig) -> float:
    """Reserved, not allocated, at an eager loss's backward: the head's logits in the
    compute dtype (c·N·V/t), freed before the backward (torchtitan's `del pred`), leave a
    hole that none of the backward's fp32 N·V/t tensors fits: the caching allocator
    places them past it, so the device's peak keeps it. Nothing where the logits are
    fp32 already."""
    c = lay.element_bytes
    return c * lay.microbatch_tokens * m.vocab / lay.tp if c < 4 else 0.0


def block_backward(lay: Layout, m: ModelConfig, s: PeakSettings) -> float:
    """SwiGLU's backward (two f-wide gradients beyond the saved tensors) and the residual
    gradient; plus what recomputation rebuilds, and the scores without a flash kernel."""
    dt, c = lay.dtype_name, lay.element_bytes
    b, seq = lay.microbatch_size, lay.local_seq
    tokens = b * seq
    out = 2 * tokens * m.hidden_dim * c / lay.tp + tokens * m.dim * c / (lay.tp if lay.sp else 1)
    family = spec_for(m).activations
    if s.recompute != "none":  # what the policy rebuilds for this block's backward
        layers = [family.layer(m, lay.tp, dt, mode, fused=s.engine.kernels.fused)
                  for mode in ("none", s.recompute)]  # fmt: skip
        whole, kept = (act.total_bytes(saved, b, seq, lay.tp, lay.sp) for saved in layers)
        out += whole - kept
    if s.engine.kernels.attention == "unfused":  # no flash kernel
        out += act.total_bytes(family.attention_scores(m, lay.seq_len), b, seq, lay.tp)
    return out
