"""The records of a zip archive (a torch.save file, a DCP payload) and the CRC-32 each one carries.

Every record of a zip archive stores the CRC-32 of its bytes, but
``torch.load`` never checks it (torch builds its zip reader with CRC checks
off, and ``mmap=True`` reads the mapped bytes directly), so a flipped bit in a
``.pt`` or ``.distcp`` payload loads without a word.  Here the CRC-32s are
checked: by ``verify`` (:func:`check_zip_records`, every record) and by the
readers that feed ``convert``/``reshard``/``load`` (:func:`check_record`,
each record once, before any of its bytes is handed out).

When a record is checked.  A reader checks a record whole, streaming it
through ranged reads into a reused per-thread scratch buffer
(:data:`SCRATCH_BYTES` locally), the first time any of its bytes is needed
(:class:`CheckedOnce`), and only then serves the bytes.  The CRC is not
folded into the reads that consume the record, because

* a CRC-32 covers the whole record, so a folded check speaks only after the
  last byte, when earlier rows are already written.  The sequential writers
  would then merely not commit, but native output is written file by file by
  several threads and each finished file is journaled for resume: a resumed
  run keeps it without reading its source records again, so damage found
  after the fact could still reach a committed checkpoint.
* consumers do not read records whole and in order: ``reshard`` reads each
  rank's box of rows, in parallel; ``--only`` skips records; DCP chunks are
  read by row ranges.  Folding would need per-record ordering state and a
  fallback for everything else.

The price is a second read of each record.  On a local disk the check leaves
the bytes in the page cache, so the consuming read is a memory-speed copy
(docs/cli.md gives the measured cost on a torch.save convert); a torch.save
file on an object store is spooled to local disk first anyway; a DCP payload
read by row ranges from an object store is fetched twice.

An archive whose every non-empty record carries CRC 0 was written without
checksums (torch's ``serialization.config.save.compute_crc32 = False``);
:func:`carries_checksums` says so, and there is nothing to check.
"""

from __future__ import annotations

import io
import struct
import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CorruptCheckpoint, ShardkitError

__all__ = ["RangeFile", "open_span", "ZipRecord", "list_records", "carries_checksums", "data_start", "check_record",
           "check_zip_records", "check_zip_bytes", "CheckedOnce", "SCRATCH_BYTES"]

READ_AHEAD = 1 << 16
SCRATCH_BYTES = 1 << 20            # per thread, local files: cache-sized, and small next to any budget
_REMOTE_SCRATCH_BYTES = 8 << 20    # object stores: fewer, larger ranged requests
_LOCAL_HEADER = 30
_ZIP_ERRORS = (zipfile.BadZipFile, EOFError, OSError, ValueError, struct.error)


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
            end = min(self._length, max(hi, lo + READ_AHEAD))
            self._cache = self._storage.read_bytes(self._name, self._start + lo, self._start + end)
            self._cache_at = lo
        got = self._cache[lo - self._cache_at:hi - self._cache_at]  # short when the file is truncated
        view[:len(got)] = got
        self._pos = lo + len(got)
        return len(got)


def open_span(storage: Storage, name: str, start: int, length: int,
              buffer_size: int = READ_AHEAD) -> io.BufferedReader:
    """Bytes ``[start, start + length)`` of ``name`` as a buffered, seekable file object."""
    return io.BufferedReader(RangeFile(storage, name, start, length), buffer_size=buffer_size)


@dataclass(frozen=True)
class ZipRecord:
    """One record of an archive; ``header_at`` is relative to the archive's first byte."""

    name: str
    header_at: int
    size: int
    crc: int
    stored: bool


def _records(fileobj: Any, where: str) -> list[ZipRecord]:
    try:
        with zipfile.ZipFile(fileobj) as zf:
            return [ZipRecord(i.filename, i.header_offset, i.file_size, i.CRC, i.compress_type == zipfile.ZIP_STORED)
                    for i in zf.infolist() if not i.is_dir()]
    except _ZIP_ERRORS as exc:
        raise CorruptCheckpoint(f"{where}: not a readable zip archive ({exc})") from None


def list_records(storage: Storage, name: str, start: int, length: int, where: str) -> list[ZipRecord]:
    """The records of the archive at ``[start, start + length)`` of ``name`` (its directory only is read)."""
    return _records(open_span(storage, name, start, length), where)


def carries_checksums(records: Sequence[ZipRecord]) -> bool:
    """False for an archive written without CRC-32s (every non-empty record says 0)."""
    return any(r.crc != 0 for r in records if r.size)


class _Span:
    """Ranged access to the archive's bytes: ``head`` for small reads, ``crc`` streams a range."""

    def __init__(self, storage: Storage | None, name: str, start: int, data: Any = None) -> None:
        self.storage, self.name, self.start = storage, name, start
        self.view = memoryview(data).cast("B") if data is not None else None
        self.nbytes = len(self.view) if self.view is not None else 0

    def head(self, lo: int, n: int) -> bytes:
        if self.view is not None:
            return bytes(self.view[lo:lo + n])
        assert self.storage is not None
        return self.storage.read_bytes(self.name, self.start + lo, self.start + lo + n)

    def crc(self, lo: int, n: int, where: str) -> int:
        if self.view is not None:
            if lo + n > len(self.view):
                raise CorruptCheckpoint(f"{where}: the archive ends before byte {lo + n}; it is truncated")
            return zlib.crc32(self.view[lo:lo + n])
        assert self.storage is not None
        scratch = _scratch(SCRATCH_BYTES if self.storage.small_reads_cheap else _REMOTE_SCRATCH_BYTES)
        crc, pos, end = 0, lo, lo + n
        while pos < end:
            part = scratch[:min(len(scratch), end - pos)]
            self.storage.read_into(self.name, self.start + pos, part)  # raises CorruptCheckpoint when truncated
            crc = zlib.crc32(part.numpy(), crc)
            pos += part.numel()
        return crc

    def fileobj(self, length: int) -> Any:
        if self.view is not None:
            return io.BytesIO(self.view)
        assert self.storage is not None
        return open_span(self.storage, self.name, self.start, length)


_LOCAL = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """This thread's reused scratch buffer (fresh memory per read would run at page-fault speed)."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=torch.uint8)
        _LOCAL.buf = buf
    return buf[:n]


def _data_start(span: _Span, rec: ZipRecord, where: str) -> int:
    """Where ``rec``'s bytes start, relative to the archive (from its local header)."""
    head = span.head(rec.header_at, _LOCAL_HEADER)
    if len(head) != _LOCAL_HEADER or head[:4] != b"PK\x03\x04":
        raise CorruptCheckpoint(f"{where}: record {rec.name}: no local header at byte {rec.header_at} (damaged)")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return rec.header_at + _LOCAL_HEADER + name_len + extra_len


def data_start(storage: Storage, name: str, start: int, rec: ZipRecord, where: str) -> int:
    """Where record ``rec``'s bytes start, relative to the archive at ``start`` of ``name``."""
    return _data_start(_Span(storage, name, start), rec, where)


def _check(span: _Span, rec: ZipRecord, where: str, length: int, data_at: int | None = None) -> int:
    if rec.stored:
        at = _data_start(span, rec, where)
        if data_at is not None and at != data_at:
            raise CorruptCheckpoint(f"{where}: record {rec.name} starts at byte {at}, but its tensor was read "
                                    f"from byte {data_at}: the archive is damaged")
        got = span.crc(at, rec.size, f"{where}: record {rec.name}")
        if got != rec.crc:
            raise CorruptCheckpoint(f"{where}: record {rec.name} fails its CRC-32 (the archive records "
                                    f"{rec.crc:08x}, its bytes give {got:08x}): the file is damaged; restore it "
                                    "from a good copy")
        return rec.size
    try:  # a compressed record (not what torch writes): zipfile inflates and checks the CRC as it streams
        with zipfile.ZipFile(span.fileobj(length)) as zf, zf.open(rec.name) as f:
            while f.read(SCRATCH_BYTES):
                pass
    except _ZIP_ERRORS as exc:
        raise CorruptCheckpoint(f"{where}: record {rec.name}: {exc}") from None
    return rec.size


def check_record(storage: Storage, name: str, start: int, length: int, rec: ZipRecord, where: str, *,
                 data_at: int | None = None) -> int:
    """Stream record ``rec`` of the archive at ``[start, start + length)`` of ``name`` and check its
    CRC-32; return its size.  ``data_at`` (relative to the archive): where the caller expects the
    record's bytes to start, checked against its local header.

    Memory is one scratch buffer per thread.  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` naming ``where`` and the record.
    """
    return _check(_Span(storage, name, start), rec, where, length, data_at)


def check_zip_records(storage: Storage, name: str, start: int, length: int, where: str) -> int:
    """Check the CRC-32 of every record of the archive at ``[start, start + length)`` of ``name``;
    return the record bytes checked (0 for an archive written without checksums)."""
    records = list_records(storage, name, start, length, where)
    if not carries_checksums(records):
        return 0
    span = _Span(storage, name, start)
    return sum(_check(span, rec, where, length) for rec in records)


def check_zip_bytes(data: Any, where: str) -> None:
    """Check every record of an archive held in memory (a DCP payload decoded whole); no copy is made."""
    span = _Span(None, "", 0, data)
    records = _records(span.fileobj(0), where)
    if carries_checksums(records):
        for rec in records:
            _check(span, rec, where, span.nbytes)


class CheckedOnce:
    """Run each key's check at most once, across threads; a failure is kept and raised to every caller.

    A thread asking for a key another thread is checking waits for that check
    instead of reading the record a second time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[Hashable, threading.Lock] = {}
        self._done: dict[Hashable, ShardkitError | None] = {}

    def ensure(self, key: Hashable, check: Callable[[], Any]) -> None:
        with self._lock:
            if key in self._done:
                failed = self._done[key]
                if failed is None:
                    return
                raise failed
            lock = self._keys.setdefault(key, threading.Lock())
        with lock:
            if key not in self._done:
                try:
                    check()
                except ShardkitError as exc:
                    self._done[key] = exc
                    raise
                self._done[key] = None
        failed = self._done[key]
        if failed is not None:
            raise failed
