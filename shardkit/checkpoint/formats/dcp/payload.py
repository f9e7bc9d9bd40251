"""Where the bytes of a DCP chunk are, so rows can be read without decoding the whole chunk.

DCP stores each tensor chunk as a ``torch.save`` blob (a small zip archive:
``data.pkl`` plus one stored, uncompressed record per storage).  To read a
block of rows we need three facts: the tensor's strides and storage offset
(in ``data.pkl``) and where the storage record's bytes start in the file.

Both come from the blob itself with a few small ranged reads: ``torch.load``
with ``map_location="meta"`` and ``weights_only=True`` parses ``data.pkl``
and skips the storage data, and :mod:`zipfile` reads the archive directory;
both see the blob through :class:`~shardkit.checkpoint.formats.torchsave.zip_records.RangeFile`, a read-only file
object whose reads are ranged reads of the storage.  A row-major contiguous
chunk then serves any row range with one ranged read.  Anything else (compressed
transforms, non-contiguous layouts) returns ``None`` and the caller decodes
the chunk whole.

The CRC-32 each record carries is checked by
:mod:`~shardkit.checkpoint.formats.torchsave.zip_records`, before any
of the rows located here is served (:meth:`~.reader.DcpReader.read`).
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.checkpoint.formats.base import contiguous_strides
from shardkit.checkpoint.formats.torchsave.zip_records import open_span
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import InvalidManifest

__all__ = ["RowLayout", "locate_rows", "payload_meta"]


@dataclass(frozen=True)
class RowLayout:
    """A row-major chunk whose row ``r`` starts at byte ``data_start + r * row_bytes`` of ``file``."""

    file: str
    data_start: int
    row_bytes: int


def payload_meta(storage: Storage, name: str, start: int, length: int, where: str) -> Any:
    """What a torch.save payload holds, with tensors on the meta device: only ``data.pkl`` and the zip
    directory are read (a few small ranged reads), never the storage bytes."""
    try:
        return torch.load(open_span(storage, name, start, length), map_location="meta", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds for bad bytes
        msg = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise InvalidManifest(f"{where}: not a readable torch.save payload ({msg})") from None


def locate_rows(storage: Storage, info: Any, shape: tuple[int, ...], dtype: torch.dtype) -> RowLayout | None:
    """The row layout of a DCP torch.save item, or ``None`` when rows cannot be addressed directly."""
    if getattr(info, "transform_descriptors", None) or not shape:
        return None
    name, start, length = str(info.relative_path), int(info.offset), int(info.length)
    try:
        meta = torch.load(open_span(storage, name, start, length), map_location="meta", weights_only=True)
        if (not isinstance(meta, torch.Tensor) or tuple(meta.shape) != tuple(shape) or meta.dtype != dtype
                or (meta.numel() > 1 and tuple(meta.stride()) != contiguous_strides(shape))):
            return None
        with zipfile.ZipFile(open_span(storage, name, start, length)) as zf:
            records = [i for i in zf.infolist() if "/data/" in i.filename and not i.filename.endswith("/")]
            if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
                return None
            header_at = records[0].header_offset
        head = storage.read_bytes(name, start + header_at, start + header_at + 30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        data_start = start + header_at + 30 + name_len + extra_len
        item = meta.element_size()
        row_bytes = item
        for n in shape[1:]:
            row_bytes *= n
        first = data_start + meta.storage_offset() * item
        if first < start or first + shape[0] * row_bytes > start + length:
            return None  # the blob does not hold what it claims; decoding it whole will say why
        return RowLayout(name, first, row_bytes)
    except Exception:  # noqa: BLE001 - any surprise means "decode the chunk whole", which validates fully
        return None
