"""Bytes on the wire: dtypes, crc32c, zstd frames and the safetensors container.

Everything here works on flat ``torch.uint8`` tensors (or anything exposing the
buffer protocol) so that the hot paths never copy: a contiguous tensor is viewed
as bytes, checksummed through a raw pointer and handed to ``write`` as is.

Why crc32c through ``ctypes``: the ``google_crc32c`` extension only accepts
``bytes`` (and keeps the GIL for blocks under 1 MiB), which would force a copy
of every block of a tensor.  The library it ships, ``libcrc32c``, takes a
pointer; a ``ctypes`` call releases the GIL, so two threads checksum in
parallel at memory speed.  When the shared library cannot be found we fall back
to the extension with a copy -- same values, slower.

The safetensors helpers follow the published format exactly (8-byte
little-endian header length, JSON header, header padded with spaces to 8 bytes,
data buffer fully indexed with no holes) and bound everything they parse, so a
hostile header costs at most ``MAX_HEADER_BYTES`` and raises
:class:`~shardkit.errors.InvalidManifest` naming the file.
"""

from __future__ import annotations

import base64
import ctypes
import glob
import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO, Mapping, Sequence

import numpy as np
import torch

from shardkit.checkpoint.geometry.boxes import (
    itemsize,  # re-exported: dtype codes and sizes go together
)
from shardkit.errors import (
    CorruptCheckpoint,
    InvalidManifest,
    UnsupportedFormat,
)

__all__ = ["DTYPE_CODES", "dtype_to_code", "code_to_dtype", "itemsize", "as_bytes", "crc32c", "block_crcs",
           "BlockCrc", "pack_crcs", "unpack_crcs", "zstd_compress", "zstd_decompress_into", "Compression",
           "parse_compression", "SafetensorsEntry", "SafetensorsHeader", "build_safetensors_header",
           "parse_safetensors_header", "SafetensorsStreamWriter", "MAX_HEADER_BYTES"]

# --------------------------------------------------------------------------
# dtypes: the safetensors codes are the format's vocabulary (docs/format.md)

DTYPE_CODES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    **{code: getattr(torch, f"float8_{name}") for code, name in (("F8_E8M0", "e8m0fnu"), ("F8_E4M3FNUZ", "e4m3fnuz"),
                                                                  ("F8_E5M2FNUZ", "e5m2fnuz"))
       if hasattr(torch, f"float8_{name}")}}
_CODE_OF = {v: k for k, v in DTYPE_CODES.items()}


def dtype_to_code(dtype: torch.dtype) -> str:
    try:
        return _CODE_OF[dtype]
    except KeyError:
        raise UnsupportedFormat(f"dtype {dtype} cannot be stored (supported: {sorted(DTYPE_CODES)}); "
                                f"convert the tensor first") from None


def code_to_dtype(code: Any, where: str = "") -> torch.dtype:
    if not isinstance(code, str) or code not in DTYPE_CODES:
        raise InvalidManifest(f"unknown dtype {code!r}{' in ' + where if where else ''}; "
                              f"known: {sorted(DTYPE_CODES)}")
    return DTYPE_CODES[code]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------
# crc32c


def _load_libcrc32c():
    try:
        import google_crc32c
    except ImportError:  # pragma: no cover - a declared dependency
        return None
    base = os.path.dirname(os.path.dirname(google_crc32c.__file__))
    for path in sorted(glob.glob(os.path.join(base, "google_crc32c.libs", "libcrc32c*"))):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


_crc_extend_ptr = _load_libcrc32c()


def _address_and_length(data: Any) -> tuple[int, int, Any]:
    """(pointer, nbytes, keep-alive object) for a tensor, array or bytes-like."""
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError("checksum of a non-contiguous tensor")
        return data.data_ptr(), data.numel() * data.element_size(), data
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes, arr


def crc32c(data: Any, crc: int = 0) -> int:
    """crc32c of ``data`` (tensor, array or bytes-like), continuing from ``crc``."""
    ptr, n, keep = _address_and_length(data)
    if n == 0:
        return crc
    if _crc_extend_ptr is not None:
        value = _crc_extend_ptr(crc, ptr, n)
        del keep
        return int(value)
    import google_crc32c  # pragma: no cover - fallback path

    buf = bytes(np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(ptr)))
    return int(google_crc32c.extend(crc, buf))


class BlockCrc:
    """crc32c per fixed-size block of one chunk, fed in pieces of any size.

    Blocks start at the chunk's first stored byte; the last block may be short.
    Used while writing (so checksums cost no second pass) and while reading.
    """

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.crcs: list[int] = []
        self._crc = 0
        self._filled = 0

    def update(self, data: torch.Tensor) -> None:
        data = data.reshape(-1)
        if _crc_extend_ptr is None:  # pragma: no cover - the library ships with google-crc32c
            self._update_slices(data)
            return
        base, n, keep = _address_and_length(data)
        pos, block, crc, filled, extend = 0, self.block_size, self._crc, self._filled, _crc_extend_ptr
        while pos < n:  # pointer arithmetic, no tensor per block: small blocks stay cheap
            take = min(block - filled, n - pos)
            crc = extend(crc, base + pos, take)
            filled += take
            pos += take
            if filled == block:
                self.crcs.append(crc)
                crc, filled = 0, 0
        self._crc, self._filled = crc, filled
        del keep

    def _update_slices(self, data: torch.Tensor) -> None:
        pos, n = 0, data.numel()
        while pos < n:
            take = min(self.block_size - self._filled, n - pos)
            self._crc = crc32c(data[pos:pos + take], self._crc)
            self._filled += take
            pos += take
            if self._filled == self.block_size:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> list[int]:
        if self._filled or not self.crcs:
            self.crcs.append(self._crc)
            self._crc, self._filled = 0, 0
        return self.crcs


def block_crcs(data: torch.Tensor, block_size: int) -> list[int]:
    acc = BlockCrc(block_size)
    acc.update(data)
    return acc.finish()


def pack_crcs(crcs: Sequence[int]) -> str:
    """Block checksums as base64 of little-endian uint32 (compact in JSON)."""
    return base64.b64encode(np.asarray(crcs, dtype="<u4").tobytes()).decode("ascii")


def unpack_crcs(text: Any, count: int, where: str) -> list[int]:
    if not isinstance(text, str) or len(text) > 8 * count + 16:
        raise InvalidManifest(f"block checksums of {where} are malformed")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise InvalidManifest(f"block checksums of {where} are not base64") from None
    if len(raw) != 4 * count:
        raise InvalidManifest(f"{where} records {len(raw) // 4} block checksums, expected {count}")
    return np.frombuffer(raw, dtype="<u4").tolist()



# --------------------------------------------------------------------------
# zstd


@dataclass(frozen=True)
class Compression:
    """Per-chunk compression policy: ``codec`` is ``"zstd"``; ``level`` its level."""

    codec: str = "zstd"
    level: int = 1


def parse_compression(value: Any) -> Compression | None:
    """Accept ``None``, ``"zstd"``, ``"zstd:3"`` or a :class:`Compression`."""
    from shardkit.errors import ConfigurationError

    if value is None or value is False or value == "none":
        return None
    if isinstance(value, Compression):
        comp = value
    elif isinstance(value, str):
        name, _, level = value.partition(":")
        try:
            comp = Compression(name, int(level) if level else 1)
        except ValueError:
            raise ConfigurationError(f"compression {value!r}: level must be an integer, e.g. 'zstd:3'") from None
    else:
        raise ConfigurationError(f"compression must be None, 'zstd' or 'zstd:LEVEL', got {value!r}")
    if comp.codec != "zstd" or not -7 <= comp.level <= 22:
        raise ConfigurationError(f"compression {value!r} is not supported; use 'zstd' or 'zstd:LEVEL' (LEVEL -7..22)")
    return comp


_local = threading.local()


def zstd_compress(data: torch.Tensor, level: int) -> bytes:
    import zstandard

    key = f"c{level}"
    comp = getattr(_local, key, None)
    if comp is None:
        comp = zstandard.ZstdCompressor(level=level, write_content_size=True)
        setattr(_local, key, comp)
    return comp.compress(data.reshape(-1).numpy())


def zstd_decompress_into(frame: Any, out: torch.Tensor, where: str) -> None:
    """Decompress one frame into ``out`` (flat uint8) exactly; raise if sizes disagree."""
    import zstandard

    view = memoryview(out.numpy()).cast("B")
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False)
        filled = 0
        while filled < len(view):
            got = reader.readinto(view[filled:])
            if got == 0:
                break
            filled += got
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpoint(f"{where}: zstd frame does not decode ({exc}); the chunk is damaged") from None
    if filled != len(view) or extra:
        raise CorruptCheckpoint(f"{where}: zstd frame holds a different number of bytes than the manifest says")


# --------------------------------------------------------------------------
# safetensors container

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
        dtype = code_to_dtype(info.get("dtype"), f"{where} entry {key!r}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or len(shape) > 64
                or not all(type(s) is int and 0 <= s < 2**62 for s in shape)):
            raise InvalidManifest(f"{where}: entry {key!r} has an invalid shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1] <= file_size - data_start):
            raise InvalidManifest(f"{where}: entry {key!r} has data_offsets {offs!r} outside the file")
        if math.prod(shape) * itemsize(dtype) != offs[1] - offs[0]:
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
    many pieces as convenient (flat uint8 tensors).  crc32c per ``block_size``
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

    def write(self, key: str, piece: torch.Tensor) -> None:
        self._skip_empty(key)
        if self._index >= len(self.entries) or self.entries[self._index].key != key:
            expected = self.entries[self._index].key if self._index < len(self.entries) else None
            raise ValueError(f"safetensors stream: got bytes for {key!r}, expected {expected!r}")
        entry = self.entries[self._index]
        piece = piece.reshape(-1)
        if piece.dtype != torch.uint8:
            piece = as_bytes(piece)
        need = entry.end - entry.start
        if self._written + piece.numel() > need:
            raise ValueError(f"safetensors stream: too many bytes for {key!r}")
        if self._crc is None:
            self._crc = BlockCrc(self.block_sizes.get(key, self.block_size))
        self._crc.update(piece)
        if piece.numel():
            self._out.write(piece.numpy())
        self._written += piece.numel()
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
