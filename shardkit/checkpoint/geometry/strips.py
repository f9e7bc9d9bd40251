"""Column strips: a stored chunk cut along one of its later dims, so column cuts read only what they need.

A chunk is stored row-major.  A reader that wants all rows but some columns of
it (tensor parallelism cutting ``Shard(1)`` more finely than the saved layout
did) would have to fetch the whole chunk: every checksum block holds bytes of every column.  Stored as
strips -- the box cut along ``dim`` into runs of ``width`` indices, each run
row-major with its own checksum blocks -- the same reader fetches just the
strips its columns fall in, and a reader that wants rows reads the matching
rows of every strip, contiguous within each.  Each strip's checksum blocks
shrink with its width (:func:`strip_block`), so a block covers as many rows
as it would in the whole chunk and row cuts read no more than before.

Pure arithmetic, shared by the writer (which picks the width) and the manifest
(which turns a striped record into one record per strip).
"""

from __future__ import annotations

import math

from shardkit.checkpoint.geometry.boxes import Box

__all__ = ["strip_boxes", "strip_width", "strip_block"]


def strip_boxes(box: Box, dim: int, width: int) -> list[Box]:
    """Sub-boxes of ``box`` cut along ``dim`` at the *global* indices that are multiples of ``width``
    (so the first and last strips may be narrower), in storage order.

    The grid is the tensor's, not the chunk's: every chunk of a tensor cuts
    its columns at the same places, and a grid that divides the tensor's
    width evenly lines up with every even tensor-parallel cut of it.
    """
    offsets, shape = box
    lo, end = offsets[dim], offsets[dim] + shape[dim]
    out = []
    while lo < end:
        hi = min(end, (lo // width + 1) * width)
        out.append((offsets[:dim] + (lo,) + offsets[dim + 1:], shape[:dim] + (hi - lo,) + shape[dim + 1:]))
        lo = hi
    return out


def strip_width(columns: int, shape: tuple[int, ...], itemsize: int, block_bytes: int, max_strips: int,
                cut_only: bool = True) -> int | None:
    """The grid width of the column strips (along dim 1) a chunk of ``shape`` is stored as, or ``None``
    (``columns``: the tensor's global size along dim 1).

    Unless ``cut_only`` is false, only a chunk whose columns the saved layout
    already cut (narrower than the tensor: a ``Shard(1)`` of tensor
    parallelism) is striped: a later
    layout is likely to cut them differently, while a chunk of whole rows --
    every FSDP checkpoint -- stays one row-major run, so the common load
    copies straight into its target (a striped chunk costs its reader one
    copy through a scratch buffer).  About ``max_strips`` strips per chunk,
    and none where a chunk fits in two checksum blocks or is one column wide.  The grid is
    ``columns / 2**j`` when that divides evenly (so every power-of-two
    tensor-parallel cut up to ``2**j`` falls on a strip edge and reads
    exactly what it needs); otherwise a column cut reads at most two
    partial strips more than it needs.
    """
    if len(shape) < 2 or max_strips < 2 or shape[1] < 2 or (cut_only and shape[1] >= columns):
        return None
    nbytes = math.prod(shape) * itemsize
    count = min(max_strips, shape[1], nbytes // block_bytes)
    if count < 2:
        return None
    width = -(-shape[1] // count)
    even = columns
    while even % 2 == 0 and even > width:
        even //= 2
    return even if even <= width else width


def strip_block(block_bytes: int, width: int, columns: int, itemsize: int) -> int:
    """The checksum block of a strip ``width`` of ``columns`` wide: ``block_bytes`` scaled by that share,
    so it spans as many rows as a block of the whole chunk; a multiple of 8 and of the item size."""
    grain = math.lcm(8, itemsize)
    return max(grain, block_bytes * width // columns // grain * grain)
