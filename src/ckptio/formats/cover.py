"""Whether stored chunks overlap: a sweep in ``O(n log n)`` for the layouts sharding produces, along any dimension.

:func:`ckptio.formats.common.check_exact_cover` refuses a tensor's chunks unless each lies inside the tensor, no
two share an element and their volumes add up to the tensor's; this module finds an overlapping pair.

The boxes are swept along the dimension where their offsets take the most distinct values (a tensor split in
``N`` pieces along dim 1 is swept along dim 1, so at most one piece is open at a time). Dimensions that every
box spans whole cannot separate two boxes and are left out. The boxes open at the sweep's position (the
*active* ones, which all contain it) are kept in order of their start in a second dimension:

* with two split dimensions, the active boxes are pairwise disjoint in that second dimension (they share the
  sweep's position), so a new box overlaps one of them exactly when it overlaps its neighbour on either side
  in that order: at most two tests per box;
* with more, every active box whose interval in the second dimension meets the new box's starts less than the
  longest such interval before it: only those are tested (for a grid of pieces, the pieces in one column).

Each box is tested against at most the boxes it could meet; the number of tests is returned so that a test can
bound the work without timing it.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

__all__ = ["find_overlap"]

Box = Sequence[int]


def _meet(o1: Box, s1: Box, o2: Box, s2: Box, dims: Sequence[int]) -> bool:
    return all(o1[d] < o2[d] + s2[d] and o2[d] < o1[d] + s1[d] for d in dims)


def find_overlap(offsets: Sequence[Box], sizes: Sequence[Box],
                 shape: Sequence[int]) -> tuple[tuple[int, int] | None, int]:
    """An overlapping pair ``(i, j)`` of the boxes (``offsets[i]``, ``sizes[i]``), or ``None``, and the number of
    pairwise tests made. Every box must have a positive volume and lie inside ``shape``."""
    n = len(offsets)
    if n < 2:
        return None, 0
    split = [d for d in range(len(shape)) if any(o[d] != 0 or s[d] != shape[d] for o, s in zip(offsets, sizes))]
    if not split:  # two boxes that each hold the whole tensor
        return (0, 1), 1
    split.sort(key=lambda d: -len({o[d] for o in offsets}))
    if len(split) == 1:
        return _sweep_line(offsets, sizes, split[0])
    return _sweep(offsets, sizes, split)


def _sweep_line(offsets: Sequence[Box], sizes: Sequence[Box], a: int) -> tuple[tuple[int, int] | None, int]:
    """Boxes that differ along dimension ``a`` only: sorted by start, each must begin where the furthest end so far
    is, or later."""
    order = sorted(range(len(offsets)), key=lambda i: offsets[i][a])
    reach, holder = -1, -1
    for i in order:
        if offsets[i][a] < reach:
            return (holder, i), len(order) - 1
        end = offsets[i][a] + sizes[i][a]
        if end > reach:
            reach, holder = end, i
    return None, len(order) - 1


def _sweep(offsets: Sequence[Box], sizes: Sequence[Box], split: Sequence[int]) -> tuple[tuple[int, int] | None, int]:
    """The sweep along ``split[0]`` with the active boxes in order of their start along ``split[1]``."""
    a, b = split[0], split[1]
    planar = len(split) == 2
    longest = max(s[b] for s in sizes)
    order = sorted(range(len(offsets)), key=lambda i: offsets[i][a])
    closing: list[tuple[int, int]] = []  # (end along a, box)
    active: list[tuple[int, int]] = []  # (start along b, box), sorted
    tests = 0
    for i in order:
        here = offsets[i][a]
        while closing and closing[0][0] <= here:
            _, j = heapq.heappop(closing)
            del active[bisect.bisect_left(active, (offsets[j][b], j))]
        start, end = offsets[i][b], offsets[i][b] + sizes[i][b]
        at = bisect.bisect_left(active, (start, -1))
        if planar:
            candidates = [active[k][1] for k in (at - 1, at) if 0 <= k < len(active)]
        else:
            candidates = []
            k = at - 1
            while k >= 0 and active[k][0] > start - longest:
                candidates.append(active[k][1])
                k -= 1
            k = at
            while k < len(active) and active[k][0] < end:
                candidates.append(active[k][1])
                k += 1
        for j in candidates:
            tests += 1
            if _meet(offsets[i], sizes[i], offsets[j], sizes[j], split):
                return (j, i), tests
        bisect.insort(active, (start, i))
        heapq.heappush(closing, (here + sizes[i][a], i))
    return None, tests
