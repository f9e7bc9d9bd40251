"""The one checksum loop of the native format: load's checking pass, offline verify and resume
all check stored chunk bytes against the manifest's crc32c blocks through :func:`check_chunk`."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from shardkit.checkpoint.formats.crc32c import block_crcs
from shardkit.checkpoint.formats.native.manifest import ChunkRecord
from shardkit.checkpoint.io.storage import Storage

if TYPE_CHECKING:
    import torch

__all__ = ["check_chunk", "thread_scratch", "CHECK_SPAN", "STEP_BYTES"]

CHECK_SPAN = 8 << 20  # remote: one ranged read per this many bytes
STEP_BYTES = 2 << 20  # local reads: read, then checksum, this much at a time (stays in the CPU cache)


def check_chunk(storage: Storage, record: ChunkRecord, lo: int = 0, hi: int | None = None, *,
                span: int | None = None, scratch: torch.Tensor | None = None, keep: bool = False,
                on_bytes: Callable[[int], None] | None = None) -> int | None:
    """Index of the first checksum block of ``record`` that does not match the manifest, or ``None``.

    The one checksum loop of the native format (load's checking pass, offline
    verify and resume): chunk bytes ``[lo, hi)`` (default: the whole stored
    chunk; ``lo`` on a block boundary, ``hi`` on one or at the chunk's end) are
    fetched with one ranged read per ``span`` bytes (default ``CHECK_SPAN``)
    -- never one request per block, which on an object store would cost a
    round trip per 256 KiB -- and crc32c'd block by block, stopping at the
    first bad block.  Local files
    are read in cache-sized steps instead, so each is checksummed while still
    in the CPU cache.  Memory: one span, in ``scratch`` (a flat uint8 tensor)
    or a buffer reused per thread.  ``keep=True`` reads the whole range in one
    request into ``scratch`` (which must hold it) and leaves it there, e.g. to
    decode a zstd frame after.  ``on_bytes(n)`` is called after each read
    (progress bars).  Missing or short files raise what :class:`Storage` raises.
    A record stored as column strips is checked whole (``lo``/``hi`` refer to
    one strip, so they are refused), strip by strip; the index counts blocks
    over all strips, as the manifest lists them.
    """
    if record.strips is not None:
        if lo or hi not in (None, record.nbytes) or keep:
            raise ValueError("check_chunk: a chunk stored as strips is checked whole, strip by strip")
        first = 0
        for piece in record.pieces():
            bad = check_chunk(storage, piece, span=span, scratch=scratch, on_bytes=on_bytes)
            if bad is not None:
                return first + bad
            first += len(piece.crc32c)
        return None
    block = record.block
    hi = record.nbytes if hi is None else min(hi, record.nbytes)
    if lo % block or not 0 <= lo <= hi or (hi % block and hi != record.nbytes):
        raise ValueError(f"check_chunk: [{lo}, {hi}) is not a run of whole checksum blocks of {block} bytes")
    if keep and (scratch is None or scratch.numel() < hi - lo):
        raise ValueError(f"check_chunk(keep=True) needs a scratch tensor of at least {hi - lo} bytes")
    span = CHECK_SPAN if span is None else span
    step = hi - lo if keep else min(span, STEP_BYTES) if storage.small_reads_cheap else span
    step = max(block, step // block * block)
    with storage.files_held_open():
        return _check_steps(storage, record, lo, hi, step, scratch, on_bytes)


def _check_steps(storage: Storage, record: ChunkRecord, lo: int, hi: int, step: int, scratch: torch.Tensor | None,
                 on_bytes: Callable[[int], None] | None) -> int | None:
    """:func:`check_chunk`'s loop over ``[lo, hi)``, ``step`` bytes at a time (a local file held open)."""
    block = record.block
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        if scratch is None or scratch.numel() < b - a:
            scratch = thread_scratch(b - a)
        buf = scratch[:b - a]
        storage.read_parts(record.file, record.start + a, [buf])
        if on_bytes is not None:
            on_bytes(b - a)
        first = a // block
        for i, got in enumerate(block_crcs(buf, block)):
            if got != record.crc32c[first + i]:
                return first + i
    return None


_scratch_of_thread = threading.local()


def thread_scratch(n: int) -> torch.Tensor:
    import torch

    buf = getattr(_scratch_of_thread, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch_of_thread.buf = torch.empty(max(n, 1 << 16), dtype=torch.uint8)
    return buf
