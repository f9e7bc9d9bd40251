"""Where the bytes of a DCP chunk are, so rows can be read without decoding the whole chunk.

DCP stores each tensor chunk as a ``torch.save`` blob (a small zip archive:
``data.pkl`` plus one stored, uncompressed record per storage).  To read a
block of rows we need three facts: the tensor's strides and storage offset
(in ``data.pkl``) and where the storage record's bytes start in the file.

Both come from the blob itself with a few small ranged reads: ``torch.load``
with ``map_location="meta"`` and ``weights_only=True`` parses ``data.pkl``
and skips the storage data, and :mod:`zipfile` reads the archive directory;
both see the blob through :class:`RangeFile`, a read-only file object whose
reads are ranged reads of the storage.  A row-major contiguous chunk then
serves any row range with one ranged read.  Anything else (compressed
transforms, non-contiguous layouts) returns ``None`` and the caller decodes
the chunk whole.

The same view serves ``verify``: every record of a zip archive carries a
CRC-32, so :func:`check_zip_records` streams the records through ranged reads
and lets :mod:`zipfile` check them, in memory of one read step.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.checkpoint.formats.base import contiguous_strides
from shardkit.checkpoint.storage import Storage
from shardkit.errors import CorruptCheckpoint, InvalidManifest, ShardkitError

__all__ = ["RangeFile", "RowLayout", "locate_rows", "payload_meta", "check_zip_records"]

_READ_AHEAD = 1 << 16
_CHECK_STEP = 4 << 20


class RangeFile(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a stored file, read lazily by ranges (with read-ahead)."""

    def __init__(self, storage: Storage, name: str, start: int, length: int) -> None:
        super().__init__()
        self._storage, self._name, self._start, self._length = storage, name, start, length
        self._pos = 0
        self._cache_at, self._cache = -1, b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        lo, hi = self._pos, self._pos + n
        if not (self._cache_at <= lo and hi <= self._cache_at + len(self._cache)):
            end = min(self._length, max(hi, lo + _READ_AHEAD))
            self._cache = self._storage.read_bytes(self._name, self._start + lo, self._start + end)
            self._cache_at = lo
        got = self._cache[lo - self._cache_at:hi - self._cache_at]  # short when the file is truncated
        view[:len(got)] = got
        self._pos = lo + len(got)
        return len(got)


@dataclass(frozen=True)
class RowLayout:
    """A row-major chunk whose row ``r`` starts at byte ``data_start + r * row_bytes`` of ``file``."""

    file: str
    data_start: int
    row_bytes: int


def _reader(storage: Storage, name: str, start: int, length: int, buffer_size: int = _READ_AHEAD) -> io.BufferedReader:
    return io.BufferedReader(RangeFile(storage, name, start, length), buffer_size=buffer_size)


def payload_meta(storage: Storage, name: str, start: int, length: int, where: str) -> Any:
    """What a torch.save payload holds, with tensors on the meta device: only ``data.pkl`` and the zip
    directory are read (a few small ranged reads), never the storage bytes."""
    try:
        return torch.load(_reader(storage, name, start, length), map_location="meta", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds for bad bytes
        msg = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise InvalidManifest(f"{where}: not a readable torch.save payload ({msg})") from None


def check_zip_records(storage: Storage, name: str, start: int, length: int, where: str) -> int:
    """Stream every record of the zip archive at ``[start, start + length)`` of ``name`` and check its
    CRC-32 (what torch.save files and DCP payloads carry); return the record bytes checked.

    Memory is one read step, whatever the record sizes.  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` naming the record.
    """
    checked = 0
    try:
        with zipfile.ZipFile(_reader(storage, name, start, length)) as zf:
            for info in zf.infolist():
                try:
                    with zf.open(info) as rec:
                        while rec.read(_CHECK_STEP):
                            pass
                except ShardkitError:
                    raise
                except (zipfile.BadZipFile, EOFError, OSError, ValueError, struct.error) as exc:
                    raise CorruptCheckpoint(f"{where}: record {info.filename}: {exc}") from None
                checked += info.file_size
    except ShardkitError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, struct.error) as exc:
        raise CorruptCheckpoint(f"{where}: not a readable zip archive ({exc})") from None
    return checked


def locate_rows(storage: Storage, info: Any, shape: tuple[int, ...], dtype: torch.dtype) -> RowLayout | None:
    """The row layout of a DCP torch.save item, or ``None`` when rows cannot be addressed directly."""
    if getattr(info, "transform_descriptors", None) or not shape:
        return None
    name, start, length = str(info.relative_path), int(info.offset), int(info.length)
    try:
        meta = torch.load(_reader(storage, name, start, length), map_location="meta", weights_only=True)
        if (not isinstance(meta, torch.Tensor) or tuple(meta.shape) != tuple(shape) or meta.dtype != dtype
                or (meta.numel() > 1 and tuple(meta.stride()) != contiguous_strides(shape))):
            return None
        with zipfile.ZipFile(_reader(storage, name, start, length)) as zf:
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
