"""Boxes: rectangular pieces of a logical tensor, the unit of a sharded checkpoint (pure).

A box is one (start, stop) pair per dimension of the full logical tensor. Every layout's
local state is a set of boxes: a tp shard is one box; a ZeRO shard is a contiguous range of
a (tp-shard) tensor's row-major elements, which `flat_boxes` cuts into at most 2·ndim − 1
boxes, each itself contiguous in that order. Saving writes each rank's boxes; loading
fills each box a rank needs from the saved boxes that intersect it.
"""

from __future__ import annotations

import math

Box = tuple[tuple[int, int], ...]


def index_box(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Box:
    """The box a basic index (slices with step 1, or None: everything) selects."""
    index = tuple(index or ())  # None: the empty index, every dimension whole
    index += (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"a box needs unit steps, got {s}")
        out.append((start, stop))
    return tuple(out)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def shift(box: Box, origin: Box) -> Box:
    """`box` (coordinates inside `origin`'s region) in the coordinates `origin` is in."""
    return tuple((a + o, b + o) for (a, b), (o, _) in zip(box, origin))


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def relative(box: Box, origin: Box) -> tuple[slice, ...]:
    """The index of `box` inside the region `origin` (both in the same coordinates)."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes covering elements [start, stop) of a row-major `shape`, in order."""
    if start >= stop:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # inside one row: recurse into it
        base = first * inner
        return [((first, first + 1), *b) for b in flat_boxes(shape[1:], start - base, stop - base)]
    lo, hi = -(-start // inner), stop // inner  # the whole rows, between two partial ones
    whole = [((lo, hi), *((0, n) for n in shape[1:]))] if lo < hi else []
    return flat_boxes(shape, start, lo * inner) + whole + flat_boxes(shape, hi * inner, stop)
