"""crc32c of tensors and buffers, whole or per fixed-size block, with no copy.

Everything here works on flat ``torch.uint8`` tensors (or anything exposing the
buffer protocol) so that the hot paths never copy: a contiguous tensor is
checksummed through a raw pointer.

Why ``awscrt``: every load checks every byte it reads, so the checksum's speed
is a floor under every load.  ``awscrt.checksums.crc32c`` folds with carry-less
multiplication (27 GB/s on one core of the benchmark machine with awscrt 0.38,
against 5 GB/s for the library ``google_crc32c`` ships), takes any buffer (a
``ctypes`` view of a tensor's memory, no copy) and releases the GIL for buffers
over 5 KiB, so two threads checksum in parallel.  Its price is at import: 25-55
ms to load its extension, once per process.  When it is missing, ``libcrc32c`` from ``google_crc32c`` is called
through ``ctypes`` (which also releases the GIL); failing that, the extension
with a copy -- the same values at every step down, only slower.
"""

from __future__ import annotations

import base64
import ctypes
import glob
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from shardkit.checkpoint.formats.dtypes import is_tensor
from shardkit.errors import InvalidManifest

if TYPE_CHECKING:
    import torch

__all__ = ["crc32c", "block_crcs", "BlockCrc", "pack_crcs", "unpack_crcs", "awscrt_extend", "libcrc32c_extend"]

#: (crc, address, nbytes) -> crc, continuing ``crc`` over ``nbytes`` at ``address``.
PointerCrc = Callable[[int, int, int], int]


def awscrt_extend() -> PointerCrc | None:
    """The fast backend: ``awscrt``'s folding crc32c over a pointer, or None when it is not installed."""
    try:
        from awscrt.checksums import crc32c as fold
    except ImportError:
        return None

    def extend(crc: int, address: int, nbytes: int) -> int:
        return fold((ctypes.c_ubyte * nbytes).from_address(address), crc)

    return extend


def libcrc32c_extend() -> PointerCrc | None:
    """The fallback backend: ``libcrc32c`` (shipped by ``google_crc32c``) through ``ctypes``, or None."""
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


_crc_extend_ptr: PointerCrc | None = awscrt_extend() or libcrc32c_extend()


def _address_and_length(data: Any) -> tuple[int, int, Any]:
    """(pointer, nbytes, keep-alive object) for a tensor, array or bytes-like."""
    if is_tensor(data):
        if not data.is_contiguous():
            raise ValueError("checksum of a non-contiguous tensor")
        return data.data_ptr(), data.numel() * data.element_size(), data
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if not arr.flags.c_contiguous:  # its bytes in memory order are not its elements in order
        raise ValueError("checksum of a non-contiguous array")
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

    def update(self, data: Any) -> None:
        """Feed ``data``: a tensor, an array or any bytes-like buffer (a passthrough's memoryview)."""
        if is_tensor(data):
            data = data.reshape(-1)
        elif isinstance(data, np.ndarray):
            if not data.flags.c_contiguous:  # reshape(-1) of a strided 1-D array is a view, still strided
                raise ValueError("checksum of a non-contiguous array")
            data = data.reshape(-1).view(np.uint8)
        else:
            data = np.frombuffer(data, dtype=np.uint8)
        if _crc_extend_ptr is None:  # pragma: no cover - neither awscrt nor google-crc32c's libcrc32c loads
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

    def _update_slices(self, data: Any) -> None:
        pos, n = 0, data.numel() if hasattr(data, "numel") else data.size
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
