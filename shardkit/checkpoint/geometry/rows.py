"""Rows of dim 0: how a tensor larger than the memory budget moves a block of rows at a time.

Writers move a tensor a block of dim-0 rows at a time, sized from the memory
budget, so a tensor larger than the budget never sits in memory; formats that
cannot read byte ranges serve a request from a row range of a chunk held in
memory (:func:`copy_rows_into`).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from shardkit.checkpoint.geometry.boxes import itemsize

__all__ = ["rows_per_block", "iter_row_blocks", "row_range", "copy_rows_into", "copy_box"]


def rows_per_block(dtype: torch.dtype, shape: tuple[int, ...], budget: int) -> int:
    """How many dim-0 rows of a tensor of ``shape`` fit in ``budget`` bytes (at least one)."""
    if not shape:
        return 1
    row = math.prod(shape[1:]) * itemsize(dtype)
    if row == 0:
        return max(shape[0], 1)
    return max(1, budget // row)


def iter_row_blocks(n_rows: int, block: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` dim-0 ranges of at most ``block`` rows covering ``n_rows`` (a writer's loop)."""
    start = 0
    while start < n_rows:
        stop = min(n_rows, start + block)
        yield start, stop
        start = stop


def row_range(chunk_offsets: tuple[int, ...], box: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[int, int]:
    """Chunk-local dim-0 rows ``[start, stop)`` a request's box covers (``(0, 1)`` for a scalar)."""
    if not chunk_offsets:
        return 0, 1
    start = box[0][0] - chunk_offsets[0]
    return start, start + box[1][0]


def copy_rows_into(rows: torch.Tensor, chunk_offsets: tuple[int, ...], box: Any, out: torch.Tensor) -> None:
    """Copy the request box out of ``rows`` (the box's dim-0 rows of the chunk, full width) into ``out``."""
    if not chunk_offsets:
        out.copy_(rows.reshape(()))
        return
    index = (slice(None),) + tuple(slice(o - c, o - c + s) for o, c, s in
                                   zip(box[0][1:], chunk_offsets[1:], box[1][1:]))
    out.copy_(rows[index])


def copy_box(chunk: torch.Tensor, chunk_offsets: tuple[int, ...], box: Any, out: torch.Tensor) -> torch.Tensor:
    """Copy the request box out of a whole stored ``chunk`` into ``out``; return the rows copied from
    (a reader of a memory-mapped file releases their pages after)."""
    r0, r1 = row_range(chunk_offsets, box)
    rows = chunk if chunk.dim() == 0 else chunk[r0:r1]
    copy_rows_into(rows, chunk_offsets, box, out)
    return rows
