"""Activation memory per rank, Korthikanti-style: what each layer saves for its backward.

A layer is a list of `Saved` tensors, each with its bytes per token (or per sequence
position, or per microbatch) and how tensor parallelism divides it:

- "tp": inside the tp region (a head's q/k/v, the MLP's inner activations): 1/t always;
- "seq": on the residual stream (norm inputs, dropout masks): 1/t with sequence
  parallelism, whole without;
- "rank": already what one tp rank holds, never divided again (tetrad saves the
  all-gathered input of a column-parallel linear, the whole sequence even under SP, where
  Megatron keeps the SP shard and re-gathers it; a rank's repeated k and v heads).

`gpt_layer` is Korthikanti et al.'s GPT layer (LayerNorm, 4h GeLU MLP, dropout), so the
sums reproduce their formulas (34 + 5as/h, 10 + 24/t + 5as/(ht), ...; tests check it).
A model family declares its own layers beside the family (`ModelSpec.activations`,
checked against a live count of saved tensors); this module holds what every family
shares: the sums and the reference GPT layer.

How many microbatches a rank holds comes from the pipeline simulator's timeline
(`peak_in_flight`), so every schedule (GPipe m, 1F1B p - r, interleaved, zero bubble with
deferred weight gradients) is covered by the same walk over its events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tetrad.models.spec import RECOMPUTE as RECOMPUTE  # the planner's modes, re-exported
from tetrad.models.spec import Saved, check_recompute
from tetrad.parallel.pipeline.timeline import Timeline


def total_bytes(items: Sequence[Saved], b: int, s: int, t: int = 1, sp: bool = False) -> float:
    """Bytes `items` hold for one microbatch of `b` sequences of length `s` on one tp rank."""
    total = 0.0
    for it in items:
        if it.split not in ("tp", "seq", "rank"):
            raise ValueError(f"{it.name}: split must be tp, seq or rank, got {it.split!r}")
        div = t if it.split == "tp" or (it.split == "seq" and sp) else 1
        total += (b * s * it.per_token + s * it.per_position + it.fixed) / div
    return total


# --- Korthikanti's GPT layer --------------------------------------------------------------


def gpt_layer(h: int, a: int, s: int, recompute: str = "none") -> list[Saved]:
    """The GPT layer of Korthikanti et al. (2022), 16-bit activations, 1-byte dropout masks.

    selective recompute drops the attention core (softmax, its dropout mask and output);
    full recompute keeps only the layer input.
    """
    check_recompute(recompute)
    if recompute == "full":
        return [Saved("layer input", 2 * h, "seq")]
    items = [
        Saved("ln1 input", 2 * h, "seq"),
        Saved("qkv input", 2 * h, "seq"),
        Saved("q, k", 4 * h, "tp"),
        Saved("v", 2 * h, "tp"),
        Saved("proj input", 2 * h, "tp"),
        Saved("attn dropout mask", 1 * h, "seq"),
        Saved("ln2 input", 2 * h, "seq"),
        Saved("fc1 input", 2 * h, "seq"),
        Saved("gelu input", 8 * h, "tp"),
        Saved("fc2 input", 8 * h, "tp"),
        Saved("mlp dropout mask", 1 * h, "seq"),
    ]
    if recompute in ("none", "op"):
        items += [
            Saved("softmax output", 2 * a * s, "tp"),
            Saved("softmax dropout mask", a * s, "tp"),
            Saved("dropout output", 2 * a * s, "tp"),
        ]
    return items


# --- microbatches in flight ---------------------------------------------------------------


def peak_in_flight(
    timeline: Timeline,
    rank: int,
    act: Sequence[float],
    pending_w: Sequence[float] = (),
    sent: Sequence[float] = (),
    shared: Sequence[float] = (),
) -> float:
    """Peak bytes of stashed activations on `rank` over a simulated (or measured) step.

    act[stage]: bytes one microbatch leaves on `stage` after its forward; pending_w[stage]:
    bytes it keeps between B and W (zero-bubble); sent[stage]: the output an F sends,
    alive until the send is done: the runtime waits for a send (and frees it) one compute
    after posting it (`p2p.program`'s slack), so it lives through the F that made it and
    the rank's next compute; shared[stage]: the part of act[stage] that the stage's
    microbatches in flight share, held once however many they are (a layer's kept rotary
    tables). F adds act; B releases act and adds pending_w; W releases pending_w; BW
    releases act.
    """
    events = sorted(timeline.ranks[rank], key=lambda e: e.start)
    return InFlight(events).peak(act, pending_w, sent, shared)


class InFlight:
    """What one rank holds at each of its computes (events or actions: their kind and
    stage, in the order it runs them), as counts per stage: microbatches between their F
    and their B (BW), B's awaiting their W, and F outputs being sent. `peak` prices them
    with a microbatch's bytes per stage (`peak_in_flight`'s), so one order is walked once
    for any number of layouts: the counts are kept only where no other moment's are at
    least as large on every term (its bytes are never less: every price is >= 0, and the
    shared part of a stage's activations never exceeds them), a handful per rank."""

    def __init__(self, computes: Sequence[Any]):
        stages = sorted({e.stage for e in computes})
        local = {s: i for i, s in enumerate(stages)}
        v = len(stages)
        counts = [0] * (3 * v)  # per stage: microbatches between F and B (BW), B's awaiting
        moments = set()  # their W, F outputs being sent (the previous compute's and its own)
        sending = None
        for e in computes:
            i = local[e.stage]
            if e.kind == "F":
                counts[i] += 1
                counts[2 * v + i] += 1
            elif e.kind == "B":
                counts[i] -= 1
                counts[v + i] += 1
            moments.add(tuple(counts))
            if sending is not None:
                counts[2 * v + sending] -= 1
            sending = i if e.kind == "F" else None
            if e.kind == "W":
                counts[v + i] -= 1
            elif e.kind == "BW":
                counts[i] -= 1
        self.moments = [
            tuple(
                (s, c[i], c[v + i], c[2 * v + i])
                for i, s in enumerate(stages)
                if c[i::v] != (0, 0, 0)
            )
            for c in _maximal(moments)
        ]

    def peak(
        self,
        act: Sequence[float],
        pending_w: Sequence[float] = (),
        sent: Sequence[float] = (),
        shared: Sequence[float] = (),
    ) -> float:
        """Peak bytes held: act[stage] a microbatch's activations after its F, of which
        shared[stage] is kept once however many are in flight (a layer's rotary tables);
        pending_w[stage] what a B keeps for its W; sent[stage] an F's output, alive through
        the F that made it and the rank's next compute (the runtime waits for a send one
        compute after posting it: `p2p.program`'s slack)."""
        peak = 0.0
        for moment in self.moments:
            total = 0.0
            for s, n, p, o in moment:
                if n:
                    total += n * act[s] - (n - 1) * (shared[s] if shared else 0.0)
                if p and pending_w:
                    total += p * pending_w[s]
                if o and sent:
                    total += o * sent[s]
            peak = max(peak, total)
        return peak


def _maximal(moments: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The moments (counts, one term each) no other moment covers (at least as large on
    every term). Taken largest first, a moment is kept unless a kept one covers it:
    whatever covers it is covered by a kept one, or kept itself."""
    kept: list[tuple[int, ...]] = []
    for m in sorted(moments, key=lambda m: (-sum(m), m)):
        if not any(all(x >= y for x, y in zip(k, m)) for k in kept):
            kept.append(m)
    return kept
