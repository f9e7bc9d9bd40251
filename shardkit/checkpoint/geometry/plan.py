"""Which stored bytes does a wanted box need?  Overlaps of boxes, then byte ranges.

Two steps, kept apart so every format can use the first and the native format
(or any format with ranged reads) the second:

1. :class:`ChunkIndex` answers "which stored chunks overlap this box?" in
   ``O(log C + k)``: chunks are sorted by their dim-0 start, and since stored
   chunks never overlap, only chunks starting within one maximal chunk height
   before the box can reach into it.  DCP compares every wanted chunk with every
   stored chunk (pytorch#169113); this does not.  :func:`plan_box` turns the
   overlaps into :class:`Piece` s and proves the box is fully covered.

2. :func:`byte_runs` turns a piece (a sub-box of one row-major stored chunk)
   into byte ranges of that chunk: one range when the sub-box is contiguous in
   the chunk (every dim-0 reshard), otherwise one run per leading index; the
   native reader widens them to whole checksum blocks, so it fetches little
   more than it needs and can still verify it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shardkit.checkpoint.geometry.boxes import Box, box_numel, intersect
from shardkit.errors import CorruptCheckpoint

__all__ = ["ChunkIndex", "Piece", "plan_box", "byte_runs"]


@dataclass(frozen=True)
class Piece:
    """The part ``box`` (global coordinates) of stored chunk number ``chunk`` that a target needs."""

    chunk: int
    box: Box


class ChunkIndex:
    """Stored chunk boxes of one tensor, indexed for overlap queries."""

    def __init__(self, boxes: Sequence[Box]) -> None:
        self.boxes = list(boxes)
        ndim = len(self.boxes[0][0]) if self.boxes else 0
        self._scalar = ndim == 0
        order = sorted(range(len(self.boxes)), key=lambda i: self.boxes[i][0][0] if ndim else 0)
        self._order = order
        self._starts = [self.boxes[i][0][0] if ndim else 0 for i in order]
        self._max_height = max((b[1][0] for b in self.boxes), default=0) if ndim else 1

    def overlapping(self, box: Box) -> list[int]:
        if self._scalar:
            return list(range(len(self.boxes)))
        lo_row, hi_row = box[0][0], box[0][0] + box[1][0]
        lo = bisect.bisect_right(self._starts, lo_row - self._max_height)
        hi = bisect.bisect_left(self._starts, hi_row)
        return [i for i in self._order[lo:hi] if intersect(self.boxes[i], box) is not None]


def plan_box(index: ChunkIndex, box: Box, what: str) -> list[Piece]:
    """Pieces of stored chunks that together fill ``box`` exactly.

    Raises :class:`~shardkit.errors.CorruptCheckpoint` when the stored chunks
    leave part of the box uncovered (a checkpoint with holes must not load).
    """
    if box_numel(box) == 0:
        return []
    pieces = []
    covered = 0
    for i in index.overlapping(box):
        common = intersect(index.boxes[i], box)
        if common is not None:
            pieces.append(Piece(i, common))
            covered += box_numel(common)
    if covered != box_numel(box):
        raise CorruptCheckpoint(f"{what}: stored chunks cover {covered} of the {box_numel(box)} elements "
                                f"needed for offsets {list(box[0])} shape {list(box[1])}")
    return pieces


def byte_runs(chunk_box: Box, sub: Box, itemsize: int) -> np.ndarray:
    """Byte ranges ``[[start, end), ...]`` of the chunk that hold ``sub`` (both global boxes).

    One run when ``sub`` is contiguous inside the chunk; otherwise one run per
    index of the leading dims (vectorised, so tall sub-boxes stay cheap).
    """
    c_off, c_shape = chunk_box
    s_off, s_shape = sub
    ndim = len(c_shape)
    if ndim == 0:
        return np.array([[0, itemsize]], dtype=np.int64)
    local = [s - c for s, c in zip(s_off, c_off)]
    strides = [itemsize] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * c_shape[d + 1]
    k = ndim - 1
    while k > 0 and s_shape[k] == c_shape[k]:
        k -= 1
    # dims > k are full: a run is s_shape[k] slabs starting at the index of dim k
    run_len = s_shape[k] * strides[k]
    starts = np.zeros(1, dtype=np.int64)
    for d in range(k):
        idx = (np.arange(s_shape[d], dtype=np.int64) + local[d]) * strides[d]
        starts = (starts[:, None] + idx[None, :]).reshape(-1)
    starts = starts + local[k] * strides[k]
    return np.stack([starts, starts + run_len], axis=1)
