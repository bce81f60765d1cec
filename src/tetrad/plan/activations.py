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
    return peak_in_order(events, act, pending_w, sent, shared)


def peak_in_order(
    computes: Sequence[Any],
    act: Sequence[float],
    pending_w: Sequence[float] = (),
    sent: Sequence[float] = (),
    shared: Sequence[float] = (),
) -> float:
    """`peak_in_flight` of one rank's computes (events or actions: their kind and stage)
    in the order it runs them."""
    live = peak = 0.0
    sending = 0.0  # the output of the previous compute, if an F, still being sent
    flying = [0] * len(act)  # microbatches of each stage between their F and their B (BW)

    def adds(stage: int) -> float:  # act[stage], less what one already in flight holds
        return act[stage] - (shared[stage] if shared and flying[stage] else 0.0)

    for e in computes:
        w = pending_w[e.stage] if pending_w else 0.0
        out = sent[e.stage] if sent and e.kind == "F" else 0.0
        if e.kind == "F":
            live += adds(e.stage)
            flying[e.stage] += 1
        elif e.kind == "B":
            flying[e.stage] -= 1
            live += w - adds(e.stage)
        peak = max(peak, live + sending + out)
        if e.kind == "W":
            live -= w
        elif e.kind == "BW":
            flying[e.stage] -= 1
            live -= adds(e.stage)
        sending = out
    return peak
