"""How a save writes, checked once and passed down whole: :class:`SaveOptions`.

``save`` and ``async_save`` take these as keywords (their public
signatures); everything below them -- planning, the background submit, the
write and the commit -- takes the one frozen record, so an option is added in
one place and cannot be dropped on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from shardkit.checkpoint.formats.compression import Compression, parse_compression
from shardkit.checkpoint.formats.native import COLUMN_STRIPS, DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_BYTES
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS
from shardkit.checkpoint.state.tree import to_json_value
from shardkit.checkpoint.training.dedup import digest_algorithm
from shardkit.errors import ConfigurationError

__all__ = ["SaveOptions"]


@dataclass(frozen=True)
class SaveOptions:
    """The options of one save, as :func:`~shardkit.checkpoint.training.save.save` documents them; build it
    with :meth:`checked`, which refuses a bad value before anything is written."""

    compression: Compression | None = None
    meta: Mapping[str, Any] | None = None     # JSON metadata for the manifest
    overwrite: bool = True
    fsync: bool = True
    direct_io: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    block_bytes: int = DEFAULT_BLOCK_BYTES
    io_threads: int = DEFAULT_IO_THREADS
    column_strips: str = "cut"
    digests: bool | str = False               # False, or the digest algorithm
    reuse_from: str | None = None
    keys: tuple[Sequence[str] | None, Sequence[str] | None] = field(default=(None, None))  # (only, exclude)

    @classmethod
    def checked(cls, *, compression: Any = None, meta: Mapping[str, Any] | None = None, overwrite: bool = True,
                fsync: bool = True, direct_io: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                block_bytes: int = DEFAULT_BLOCK_BYTES, io_threads: int = DEFAULT_IO_THREADS,
                column_strips: str = "cut", digests: bool | str = False, reuse_from: str | None = None,
                only: Sequence[str] | None = None, exclude: Sequence[str] | None = None) -> "SaveOptions":
        """The options as given to ``save``/``async_save``, checked: sizes, ``column_strips``, the
        compression spelled out, the digest algorithm chosen, ``meta`` made JSON."""
        if chunk_bytes < 1024 or block_bytes < 8 or block_bytes % 8:
            raise ConfigurationError("chunk_bytes must be >= 1024 and block_bytes a positive multiple of 8")
        if column_strips not in COLUMN_STRIPS:
            raise ConfigurationError(f"column_strips must be one of {', '.join(COLUMN_STRIPS)}, "
                                     f"got {column_strips!r}")
        return cls(parse_compression(compression), to_json_value(dict(meta), "meta") if meta else None, overwrite,
                   fsync, direct_io, chunk_bytes, block_bytes, io_threads, column_strips,
                   digest_algorithm(digests) if digests or reuse_from else False, reuse_from, (only, exclude))
