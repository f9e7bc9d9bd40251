"""Per-chunk compression: the policy users pick and zstd frames in and out.

Compressors are kept per thread (a ``zstandard`` compressor is not thread
safe) so the writer's pool compresses in parallel; decompression writes into
the caller's buffer and refuses a frame whose size disagrees with the manifest.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardkit.errors import ConfigurationError, CorruptCheckpoint

if TYPE_CHECKING:
    import torch

__all__ = ["Compression", "parse_compression", "zstd_compress", "zstd_decompress_into"]


@dataclass(frozen=True)
class Compression:
    """Per-chunk compression policy: ``codec`` is ``"zstd"``; ``level`` its level."""

    codec: str = "zstd"
    level: int = 1


def parse_compression(value: Any) -> Compression | None:
    """Accept ``None``, ``"zstd"``, ``"zstd:3"`` or a :class:`Compression`."""
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
