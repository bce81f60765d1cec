"""Boxes, the unit of sharded checkpoints: ZeRO's flat ranges cut into contiguous boxes."""

from __future__ import annotations

import math
import random

import torch

from tetrad.parallel.boxes import flat_boxes, index_box, intersect, relative


def test_flat_ranges_become_contiguous_boxes_in_order():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        full = tuple((0, s) for s in shape)
        values = torch.arange(n).view(shape)
        boxes = flat_boxes(shape, a, b)
        got = [x for box in boxes for x in values[relative(box, full)].reshape(-1).tolist()]
        assert got == list(range(a, b)), (shape, a, b, boxes)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_index_box_and_intersection():
    assert index_box((slice(4, 8), slice(None)), (16, 3)) == ((4, 8), (0, 3))
    assert index_box(None, (2, 5)) == ((0, 2), (0, 5))
    assert intersect(((0, 4), (0, 3)), ((2, 6), (1, 3))) == ((2, 4), (1, 3))
    assert intersect(((0, 4),), ((4, 6),)) is None
