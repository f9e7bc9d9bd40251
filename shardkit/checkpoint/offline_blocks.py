"""Small helpers the offline readers and writers share: row blocks, names, single files.

* Row blocks: writers move a tensor a block of dim-0 rows at a time, sized from
  the memory budget, so a tensor larger than the budget never sits in memory.
* Names: flattened keys (``model.<param>``, ``optim.state.<param>.<name>``)
  and the nested path they stand for (:func:`object_path`), shared by the
  torch.save and DCP writers.
* Single files: a torch.save file or a lone ``.safetensors`` is opened as the
  :class:`~shardkit.checkpoint.storage.Storage` of its directory plus a name.
* Rows of a stored chunk into a request: :func:`copy_rows_into` serves a
  :class:`~shardkit.checkpoint.formats.base.ReadRequest` from a row range of a
  chunk held in memory (formats that cannot read byte ranges).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from shardkit.checkpoint.codec import itemsize
from shardkit.checkpoint.storage import Storage

__all__ = ["rows_per_block", "iter_row_blocks", "object_path", "split_file",
           "row_range", "copy_rows_into"]


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


def object_path(fqn: str) -> tuple[str | int, ...]:
    """The nested path of a flattened key: ``model.<param>``, ``optim.state.<param>.<name>``.

    Flattened keys are unambiguous only with this rule, because parameter names
    themselves contain dots.  torch.save and DCP outputs nest by it.
    """
    parts = fqn.split(".")
    if parts[0] == "model" and len(parts) > 1:
        return ("model", ".".join(parts[1:]))
    if parts[:2] == ["optim", "state"] and len(parts) > 3:
        return ("optim", "state", ".".join(parts[2:-1]), parts[-1])
    if parts[:2] == ["optim", "param_groups"] and len(parts) > 3:
        return ("optim", "param_groups", int(parts[2]) if parts[2].isdigit() else parts[2], ".".join(parts[3:]))
    if len(parts) > 1 and parts[0] == "optim":
        return ("optim", ".".join(parts[1:]))
    return (fqn,)


def split_file(storage: Storage) -> tuple[Storage, str]:
    """(storage of the parent directory, file name) for a storage that points at one file."""
    url = storage.url
    parent, _, name = url.rpartition("/")
    if not parent:
        parent = "."
    elif parent.endswith(":/") or parent.endswith("://"):
        parent = url[: len(parent) + 1]
    return Storage(parent, storage.storage_options), name


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
