"""Writing torch.distributed.checkpoint (DCP) directories that ``dcp.load`` reads.

Every payload is streamed as its own torch.save archive by
:func:`~shardkit.checkpoint.formats.torchsave.writer.write_archive` (a tensor
larger than the block size becomes several dim-0 chunks, which DCP supports),
then ``.metadata`` is committed atomically.  Like the reader, this does not
import ``torch.distributed.checkpoint`` (see :mod:`.metadata` for why).
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Collection, Mapping

import torch

from shardkit.checkpoint.formats.base import Fetch
from shardkit.checkpoint.formats.dcp.metadata import encode_dcp_metadata
from shardkit.checkpoint.formats.dcp.reader import METADATA_NAME
from shardkit.checkpoint.formats.torchsave.reader import value_path
from shardkit.checkpoint.formats.torchsave.writer import TensorRef, check_tensors, write_archive
from shardkit.checkpoint.geometry.rows import iter_row_blocks, rows_per_block
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import from_json_value, object_path, walk

__all__ = ["write_dcp", "check_tensors"]


def _walked_by_dcp(_path: str, value: Any) -> bool:
    """DCP's ``flatten_state_dict`` rule: every dict is walked, a list only when it holds dicts or lists."""
    return isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value))


def _flatten_values(values: dict[str, Any]) -> dict[str, Any]:
    """Flatten list-of-dict values the way DCP's ``flatten_state_dict`` does (``a.0.lr``)."""
    return {path: value for path, _, _, value in walk(values, _walked_by_dcp)}


def write_dcp(dst: Storage, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], values: Mapping[str, Any],
              fetch: Fetch, *, block_bytes: int, on_bytes: Callable[[int], None] = lambda n: None,
              avoid: Collection[str] = ()) -> list[str]:
    """Write a DCP directory that ``torch.distributed.checkpoint.load`` reads.

    ``fetch(fqn, offsets, shape)`` returns that box of the tensor; each tensor is
    cut into dim-0 chunks of at most ``block_bytes`` (DCP supports any chunking)
    and each chunk is streamed straight into ``__0_0.distcp`` as its own
    torch.save archive, so memory holds one block.  ``values`` are JSON-encoded
    (flatten's form) and are decoded before they are written.  ``.metadata``
    commits the checkpoint: it is written last, atomically, after the payload
    is durable on local disks.  Returns the names written.  The payload never
    takes a name in ``avoid`` (a DCP checkpoint being replaced still uses it
    until the new ``.metadata`` commits): it is then ``__0_0.<suffix>.distcp``,
    which ``.metadata`` names, as DCP readers follow.
    """
    check_tensors(tensors)
    data_name = "__0_0.distcp" if "__0_0.distcp" not in avoid else f"__0_0.{uuid.uuid4().hex[:8]}.distcp"
    chunk_md: dict[str, tuple[torch.dtype, tuple[int, ...], list, list]] = {}
    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    planner_data: dict[str, tuple[Any, ...]] = {}
    flat_values = _flatten_values({k: from_json_value(v) for k, v in values.items()})

    def produce(out: Any) -> None:
        pos = 0

        def put(key: tuple[str, tuple[int, ...] | None], root: Any, refs: list[TensorRef]) -> None:
            nonlocal pos
            length = write_archive(out, root, refs, fetch, block_bytes=block_bytes, on_bytes=on_bytes)
            where[key] = (data_name, pos, length)
            pos += length

        for key, value in flat_values.items():
            put((key, None), value, [])
            planner_data[key] = value_path(key)
        for fqn, dtype, shape in tensors:
            offsets_list, sizes_list = [], []
            if not shape or shape[0] == 0:  # a scalar, or no rows: one (empty) chunk
                blocks: Any = [(0, shape[0] if shape else 0)]
            else:
                blocks = iter_row_blocks(shape[0], rows_per_block(dtype, shape, block_bytes))
            for r0, r1 in blocks:
                offsets = (r0,) + (0,) * (len(shape) - 1) if shape else ()
                box = (r1 - r0,) + tuple(shape[1:]) if shape else ()
                ref = TensorRef("0", fqn, dtype, box, first_row=r0)
                put((fqn, offsets), ref, [ref])
                offsets_list.append(offsets)
                sizes_list.append(box)
            chunk_md[fqn] = (dtype, tuple(shape), offsets_list, sizes_list)
            planner_data[fqn] = object_path(fqn)

    dst.write_stream(data_name, produce, fsync=dst.fsync_worthwhile)
    dst.put_atomic(METADATA_NAME, encode_dcp_metadata(chunk_md, list(flat_values), where, planner_data))
    return [data_name, METADATA_NAME]
