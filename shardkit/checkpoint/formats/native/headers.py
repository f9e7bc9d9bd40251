"""The safetensors header of a native data file: its checksum record, and the check that it is intact.

A reader of the native format never needs a data file's header: the manifest
says where every chunk's bytes start.  But docs/format.md promises that every
data file is a valid safetensors file whose entries are the manifest's chunks,
and a tool other than shardkit (``safetensors.safe_open``) reads the file
through its header alone.  A flipped bit there leaves every chunk checksum
intact while the file no longer opens, or opens with other tensors.  So a
header is checked wherever data files are checked (``load``'s size check,
``verify``, resume): read with one bounded ranged read, compared with the
crc32c the manifest records for it (:class:`HeaderRecord`, written since
header checksums exist; older checkpoints have none), parsed strictly
(:func:`~shardkit.checkpoint.formats.safetensors.parse_safetensors_header`: valid
JSON, known dtypes, sizes that match shapes, entries that tile the data buffer
to the end of the file), and every chunk the manifest names must be an entry
with exactly its key, dtype, shape and byte range (:func:`header_problem`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Iterable

from shardkit.checkpoint.formats.crc32c import crc32c, pack_crcs, unpack_crcs
from shardkit.checkpoint.formats.native.fields import expect_object, int_field
from shardkit.checkpoint.formats.safetensors import (
    MAX_HEADER_BYTES,
    SafetensorsEntry,
    SafetensorsHeader,
    parse_safetensors_header,
    read_safetensors_header,
)
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CorruptCheckpoint, InvalidManifest

__all__ = ["DATA_FILE_METADATA", "HeaderRecord", "parse_header_record", "header_record_json", "header_record_of",
           "read_header", "header_problem", "check_header"]

DATA_FILE_METADATA = {"format": "shardkit-data", "version": "1"}  # every data file's ``__metadata__``
_DAMAGED = "the data file is damaged -- restore it or use another checkpoint"


@dataclass(frozen=True)
class HeaderRecord:
    """A data file's header as written: its first ``size`` bytes (the 8-byte length, the JSON, its
    padding) and their crc32c."""

    size: int
    crc32c: int


def header_record_of(header: bytes) -> HeaderRecord:
    """The record of header bytes a writer is about to write (length prefix included)."""
    return HeaderRecord(len(header), crc32c(header))


def header_record_json(record: HeaderRecord) -> dict[str, Any]:
    return {"size": record.size, "crc32c": pack_crcs([record.crc32c])}


def parse_header_record(value: Any, file_size: int, where: str) -> HeaderRecord | None:
    """A file record's optional ``header`` field (``None`` when absent: written before header checksums)."""
    if value is None:
        return None
    at = f"{where} header"
    info = expect_object(value, at)
    size = int_field(info.get("size"), f"{at} size", 8, min(file_size, 8 + MAX_HEADER_BYTES))
    return HeaderRecord(size, unpack_crcs(info.get("crc32c"), 1, at)[0])


def read_header(storage: Storage, name: str, size: int, record: HeaderRecord | None) -> SafetensorsHeader:
    """The parsed header of data file ``name`` (``size`` bytes, checked already), its bytes checked
    against ``record`` first when there is one; :class:`~shardkit.errors.CorruptCheckpoint` naming
    the file otherwise."""
    where = storage.where(name)
    if record is not None:
        data = storage.read_bytes(name, 0, record.size)
        if len(data) != record.size or crc32c(data) != record.crc32c:
            raise CorruptCheckpoint(f"{where}: its safetensors header (the first {record.size} bytes) fails the "
                                    f"crc32c the manifest records; {_DAMAGED}")
        (length,) = struct.unpack("<Q", data[:8])
        if 8 + length != record.size:
            raise CorruptCheckpoint(f"{where}: its safetensors header says {8 + length} bytes, the manifest "
                                    f"records {record.size}; {_DAMAGED}")
    try:
        header = parse_safetensors_header(data, size, where, None) if record is not None else \
            read_safetensors_header(storage, name, size=size, where=where)
    except InvalidManifest as exc:
        raise CorruptCheckpoint(f"{exc}: not the valid safetensors file the manifest names; {_DAMAGED}") from None
    for key, want in DATA_FILE_METADATA.items():
        if header.metadata.get(key) != want:
            raise CorruptCheckpoint(f"{where}: its safetensors __metadata__ has {key} "
                                    f"{header.metadata.get(key)!r:.100}, a shardkit data file has {want!r}; {_DAMAGED}")
    return header


def header_problem(header: SafetensorsHeader, expected: Iterable[SafetensorsEntry]) -> str | None:
    """What is wrong with ``header`` for the entries the manifest names in its file (``None``: nothing).

    Each must be an entry of the header with the same key, dtype, shape and byte range: a reader
    that opens the file by its header then reads exactly the manifest's chunks.  A header may hold
    more entries (a file a later step references holds chunks that step does not name)."""
    for want in expected:
        got = header.entries.get(want.key)
        if got is None:
            return f"its safetensors header has no entry {want.key!r:.200}, which the manifest names"
        if got != want:
            return (f"its safetensors header has entry {want.key!r:.200} as {got.dtype} {list(got.shape)} at bytes "
                    f"[{got.start}, {got.end}), the manifest as {want.dtype} {list(want.shape)} at "
                    f"[{want.start}, {want.end})")
    return None


def check_header(storage: Storage, name: str, size: int, record: HeaderRecord | None,
                 expected: Iterable[SafetensorsEntry]) -> None:
    """Raise :class:`~shardkit.errors.CorruptCheckpoint` naming data file ``name`` unless its header is
    intact (:func:`read_header`) and holds the ``expected`` entries (:func:`header_problem`)."""
    problem = header_problem(read_header(storage, name, size, record), expected)
    if problem is not None:
        raise CorruptCheckpoint(f"{storage.where(name)}: {problem}; {_DAMAGED}")
