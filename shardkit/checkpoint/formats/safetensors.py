"""The safetensors container: header parse and build, and a front-to-back stream writer.

The writer takes tensors or bytes-like pieces and hands their bytes to ``write`` as is,
checksumming each block on the way (:mod:`~shardkit.checkpoint.formats.crc32c`),
so nothing is copied or read twice.  The helpers follow the published format
exactly (8-byte little-endian header length, JSON header, header padded with
spaces to 8 bytes, data buffer fully indexed with no holes) and bound
everything they parse, so a hostile header costs at most ``MAX_HEADER_BYTES``
and raises :class:`~shardkit.errors.InvalidManifest` naming the file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Mapping, Sequence

from shardkit.checkpoint.formats.crc32c import BlockCrc
from shardkit.checkpoint.formats.dtypes import as_bytes, code_itemsize, is_tensor
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import InvalidManifest

if TYPE_CHECKING:
    import torch

__all__ = ["SafetensorsEntry", "SafetensorsHeader", "build_safetensors_header", "parse_safetensors_header",
           "read_safetensors_header",
           "SafetensorsStreamWriter", "MAX_HEADER_BYTES"]

MAX_HEADER_BYTES = 100_000_000  # the safetensors reference implementation's cap


@dataclass(frozen=True)
class SafetensorsEntry:
    key: str
    dtype: str              # safetensors dtype code
    shape: tuple[int, ...]
    start: int              # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    entries: dict[str, SafetensorsEntry]
    metadata: dict[str, str]
    data_start: int          # absolute offset of the data buffer (8 + header length)
    file_size: int           # data_start + data buffer length


def build_safetensors_header(entries: Sequence[tuple[str, str, Sequence[int], int]],
                             metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[SafetensorsEntry]]:
    """Header bytes (length prefix included) for ``(key, dtype, shape, nbytes)`` in file order.

    Returns the header and the entries with absolute ``start``/``end`` offsets,
    so a writer can stream the data afterwards with no seek.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos, rel = 0, []
    for key, dtype, shape, nbytes in entries:
        if key in header:
            raise ValueError(f"duplicate safetensors key {key!r}")
        header[key] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [pos, pos + nbytes]}
        rel.append((key, dtype, tuple(int(s) for s in shape), pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    placed = [SafetensorsEntry(k, d, s, base + a, base + b) for k, d, s, a, b in rel]
    return struct.pack("<Q", len(text)) + text, placed


def parse_safetensors_header(prefix: bytes, file_size: int, where: str,
                             read_more: Any = None) -> SafetensorsHeader:
    """Parse and validate a safetensors header.

    ``prefix`` holds the file's first bytes; when it is too short,
    ``read_more(n)`` must return the first ``n`` bytes.  Every field is checked:
    bounded header, known dtypes, non-negative shapes, byte lengths that match
    ``numel * itemsize``, entries inside the file, no overlaps and no holes.
    """
    if file_size < 8 or len(prefix) < 8:
        raise InvalidManifest(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise InvalidManifest(f"{where}: safetensors header length {n} is out of bounds (file has {file_size} bytes)")
    if len(prefix) < 8 + n:
        if read_more is None:
            raise InvalidManifest(f"{where}: header truncated")
        prefix = read_more(8 + n)
        if len(prefix) < 8 + n:
            raise InvalidManifest(f"{where}: header truncated")
    try:
        header = json.loads(prefix[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidManifest(f"{where}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InvalidManifest(f"{where}: safetensors header is not an object")
    data_start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise InvalidManifest(f"{where}: __metadata__ must map strings to strings")
    entries: dict[str, SafetensorsEntry] = {}
    spans = []
    for key, info in header.items():
        if not isinstance(info, dict):
            raise InvalidManifest(f"{where}: entry {key!r} is not an object")
        size = code_itemsize(info.get("dtype"), f"{where} entry {key!r}")  # the code checked without torch
        shape, offs = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or len(shape) > 64
                or not all(type(s) is int and 0 <= s < 2**62 for s in shape)):
            raise InvalidManifest(f"{where}: entry {key!r} has an invalid shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1] <= file_size - data_start):
            raise InvalidManifest(f"{where}: entry {key!r} has data_offsets {offs!r} outside the file")
        if math.prod(shape) * size != offs[1] - offs[0]:
            raise InvalidManifest(f"{where}: entry {key!r} holds {offs[1] - offs[0]} bytes, "
                                  f"its shape {shape} and dtype {info['dtype']} need another size")
        entries[key] = SafetensorsEntry(key, info["dtype"], tuple(shape), data_start + offs[0], data_start + offs[1])
        spans.append((offs[0], offs[1], key))
    spans.sort()
    pos = 0
    for a, b, key in spans:
        if a != pos:
            raise InvalidManifest(f"{where}: entry {key!r} leaves a hole or overlaps at byte {a}")
        pos = b
    if pos != file_size - data_start:
        raise InvalidManifest(f"{where}: data buffer holds {file_size - data_start} bytes, entries cover {pos}")
    return SafetensorsHeader(entries, dict(metadata), data_start, file_size)


class SafetensorsStreamWriter:
    """Write a safetensors file front to back: header first, then each entry's bytes.

    ``entries`` are planned up front as ``(key, dtype_code, shape, nbytes)``;
    :meth:`write` is then called with the bytes of each entry, in order, in as
    many pieces as convenient (tensors or bytes-like buffers).  crc32c per ``block_size``
    (or ``block_sizes[key]``) block of every entry is computed on the way, so nothing is read twice and
    memory stays at one piece -- unlike ``safetensors.save_file``, which builds
    the whole file in memory.  ``out`` is any binary file object (local file,
    fsspec file); the writer never seeks.
    """

    def __init__(self, out: BinaryIO, entries: Sequence[tuple[str, str, Sequence[int], int]],
                 metadata: Mapping[str, str] | None = None, block_size: int = 1 << 20,
                 block_sizes: Mapping[str, int] | None = None) -> None:
        self._out = out
        self.header, self.entries = build_safetensors_header(entries, metadata)
        self.block_size = block_size
        self.block_sizes = dict(block_sizes or {})  # per-key exceptions to ``block_size``
        self.size = self.entries[-1].end if self.entries else len(self.header)
        self.checksums: dict[str, list[int]] = {}
        self._index = 0
        self._written = 0
        self._crc: BlockCrc | None = None
        out.write(self.header)

    def _skip_empty(self, key: str | None) -> None:
        while (self._index < len(self.entries) and self.entries[self._index].key != key
               and self.entries[self._index].start == self.entries[self._index].end and self._crc is None):
            self.checksums[self.entries[self._index].key] = [0]
            self._index += 1

    def write(self, key: str, piece: torch.Tensor | Any) -> None:
        """The next bytes of entry ``key``: a tensor (its bytes, flat) or any bytes-like buffer."""
        self._skip_empty(key)
        if self._index >= len(self.entries) or self.entries[self._index].key != key:
            expected = self.entries[self._index].key if self._index < len(self.entries) else None
            raise ValueError(f"safetensors stream: got bytes for {key!r}, expected {expected!r}")
        entry = self.entries[self._index]
        if is_tensor(piece):
            piece = as_bytes(piece.reshape(-1).contiguous())
            data, n = piece.numpy(), piece.numel()
        else:
            data = as_bytes(piece)
            n = data.nbytes
        need = entry.end - entry.start
        if self._written + n > need:
            raise ValueError(f"safetensors stream: too many bytes for {key!r}")
        if self._crc is None:
            self._crc = BlockCrc(self.block_sizes.get(key, self.block_size))
        self._crc.update(data)
        if n:
            self._out.write(data)
        self._written += n
        if self._written == need:  # an empty entry written explicitly lands here too
            self.checksums[key] = self._crc.finish()
            self._crc, self._written = None, 0
            self._index += 1

    def finish(self) -> dict[str, list[int]]:
        """Check every entry was written in full; return block checksums per key."""
        self._skip_empty(None)
        if self._index != len(self.entries):
            raise ValueError(f"safetensors stream: {self.entries[self._index].key!r} was not written in full")
        return self.checksums


HEAD_GUESS = 64 << 10  # a header's first read: most headers fit; a longer one is read again, whole


def read_safetensors_header(storage: Storage, name: str, *, base: int = 0, size: int | None = None,
                where: str | None = None) -> SafetensorsHeader:
    """Parse and strictly validate the safetensors header of the blob at byte ``base`` of ``name`` (0 for a
    safetensors file; DCP's safetensors payloads start later), ``size`` bytes long (the rest of the file when
    not given), with ranged reads: :data:`HEAD_GUESS` bytes first, then exactly what the header says."""
    size = storage.size(name) - base if size is None else size
    prefix = storage.read_bytes(name, base, base + min(size, HEAD_GUESS))
    return parse_safetensors_header(prefix, size, where or storage.where(name),
                                    lambda n: storage.read_bytes(name, base, base + n))
