"""What every offline reader hands the conversion engine: tensors as chunk boxes.

A *source* is any checkpoint shardkit can read (native, DCP, Hugging Face
safetensors, torch.save).  Whatever its on-disk shape, it is described the
same way: each tensor has a global shape, a dtype and a list of saved chunks
(boxes given by global offsets and shape), and a chunk can be read a block of
rows at a time.  Reading rows, not whole chunks, is what keeps memory bounded
when a single saved chunk is larger than the memory budget.

Non-tensor state (``optim.param_groups``, a step counter) travels as JSON
values, so nothing here ever needs pickle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch

__all__ = ["SavedChunk", "TensorEntry", "Source", "rows_per_block", "nbytes_of"]


@dataclass(frozen=True)
class SavedChunk:
    """One saved box of a tensor; ``ref`` is the format's own locator (file, offset...)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    ref: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as stored: global shape, dtype, and the chunks that cover it."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[SavedChunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


class Source(Protocol):
    """The read side every offline format implements."""

    format: str
    url: str

    def tensors(self) -> dict[str, TensorEntry]: ...

    def values(self) -> dict[str, Any]: ...

    def meta(self) -> dict[str, Any]: ...

    def read_rows(self, entry: TensorEntry, chunk: SavedChunk, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (chunk-local, dim 0) of ``chunk``, shaped like the chunk."""
        ...

    def close(self) -> None: ...


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * _itemsize(dtype)


def rows_per_block(dtype: torch.dtype, shape: tuple[int, ...], budget: int) -> int:
    """How many dim-0 rows of a tensor of ``shape`` fit in ``budget`` bytes (at least one)."""
    if not shape:
        return 1
    row = math.prod(shape[1:]) * _itemsize(dtype)
    if row == 0:
        return max(shape[0], 1)
    return max(1, budget // row)


def iter_row_blocks(n_rows: int, block: int) -> Iterator[tuple[int, int]]:
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
    if len(parts) > 1 and parts[0] in ("optim",):
        return (parts[0], ".".join(parts[1:]))
    return (fqn,)
