"""How a native checkpoint's planned read requests reach their targets, every covered checksum block verified.

:class:`~.reader.NativeReader` validates and plans each request
(:mod:`.request_plans`: its chunk record, byte run and block span) and hands
the plans here.  On a local disk a request whose piece is one contiguous run of
the chunk and whose target is contiguous is read with ``preadv`` straight into
the target (the partial blocks at its two ends into scratch), checksummed step
by step while each step is still in cache; anything else (a column slice of a
row-stored chunk, a zstd frame) is read into per-thread scratch, verified, then
copied or decompressed.  From an object store, neighbouring pieces come in one
ranged request whose response is used in place, the bytes in flight bounded.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from shardkit.checkpoint.formats.base import ReadRequest, ReadStats, contiguous_strides
from shardkit.checkpoint.formats.compression import zstd_decompress_into
from shardkit.checkpoint.formats.crc32c import BlockCrc
from shardkit.checkpoint.formats.dtypes import as_bytes
from shardkit.checkpoint.formats.native.checksums import STEP_BYTES
from shardkit.checkpoint.formats.native.manifest import ChunkRecord
from shardkit.checkpoint.formats.native.request_plans import RequestPlan, checked_span
from shardkit.checkpoint.io.concurrency import ByteBudget
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ChecksumMismatch, CorruptCheckpoint

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkReads", "chunk_where", "damaged", "check_blocks", "check_span", "read_rows", "read_runs",
           "REMOTE_INFLIGHT_BYTES"]

REMOTE_INFLIGHT_BYTES = 256 << 20  # fetched object-store data held at once, over all threads


def chunk_where(storage: Storage, fqn: str, rec: ChunkRecord) -> str:
    """A chunk as messages name it: its key, its offsets and its data file's URL."""
    return f"{fqn!r} chunk at {list(rec.offsets)} in {storage.where(rec.file)}"


def damaged(where: str, block: int) -> ChecksumMismatch:
    """The error of a checksum block that does not match the manifest."""
    return ChecksumMismatch(f"{where}: checksum block {block} does not match the manifest; the data file is "
                            f"damaged -- restore it or load an older checkpoint")


def check_blocks(got: Sequence[int], first_block: int, rec: ChunkRecord, where: str) -> None:
    """Raise :func:`damaged` unless ``got`` are ``rec``'s checksums of blocks ``first_block`` onwards."""
    want = rec.crc32c[first_block:first_block + len(got)]
    if tuple(got) != tuple(want):
        bad = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w) if len(got) == len(want) else 0
        raise damaged(where, first_block + bad)


def check_span(span: Any, lo: int, rec: ChunkRecord, where: str) -> None:
    """Raise :func:`damaged` unless ``span`` (a tensor or buffer: the chunk's stored bytes ``[lo, lo + len)``,
    ``lo`` on a block boundary, ending on one or at the chunk's end) has ``rec``'s checksums."""
    acc = BlockCrc(rec.block)
    acc.update(span)
    check_blocks(acc.finish(), lo // rec.block, rec, where)


def read_rows(storage: Storage, fqn: str, rec: ChunkRecord, rows: tuple[int, int], item: int) -> memoryview:
    """The stored bytes of rows ``[a, b)`` (dim 0, in the chunk's own numbering) of raw, unstriped chunk
    ``rec`` of ``item``-byte elements: one ranged read rounded out to the chunk's checksum blocks, every
    block checked against ``rec.crc32c`` before a byte is returned (no torch: a byte passthrough's read).
    On an object store it is served by the storage's read-through cache when one is open."""
    if rec.codec != "raw" or rec.strips:
        raise ValueError(f"{chunk_where(storage, fqn, rec)} is {rec.codec}"
                         f"{', striped' if rec.strips else ''}: its bytes are not its rows")
    row = math.prod(rec.shape[1:]) * item
    a, b = rows[0] * row, rows[1] * row
    if not 0 <= a <= b <= rec.nbytes:
        raise ValueError(f"rows {list(rows)} lie outside {chunk_where(storage, fqn, rec)}")
    if a == b:
        return memoryview(b"")
    lo, hi = checked_span(rec, a, b)
    data = storage.read_bytes(rec.file, rec.start + lo, rec.start + hi)
    if len(data) != hi - lo:
        raise CorruptCheckpoint(f"{storage.where(rec.file)} ends before byte {rec.start + hi}; the file is "
                                f"truncated")
    check_span(data, lo, rec, chunk_where(storage, fqn, rec))
    return memoryview(data)[a - lo:b - lo]


class ChunkReads:
    """The byte path of one reader: per-thread scratch buffers, the object-store bytes in flight, and the
    reader's :class:`~shardkit.checkpoint.formats.base.ReadStats`, which every served request adds to."""

    def __init__(self, storage: Storage, stats: ReadStats) -> None:
        self.storage = storage
        self.stats = stats
        self._local = threading.local()
        self._inflight = ByteBudget(REMOTE_INFLIGHT_BYTES)

    def forget_scratch(self) -> None:
        """Let the scratch buffers go (a closed reader holds no memory)."""
        self._local = threading.local()

    def scratch(self, slot: int, n: int) -> torch.Tensor:
        """This thread's scratch buffer ``slot`` (0: fetched bytes, 1: decoded or realigned ones), grown to at
        least ``n`` bytes and kept for the next request."""
        import torch

        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = [None, None]
        buf = bufs[slot]
        if buf is None or buf.numel() < n:
            buf = bufs[slot] = torch.empty(max(n, 1 << 16), dtype=torch.uint8)
        return buf[:n]

    def read_run(self, run: Sequence[tuple[ReadRequest, RequestPlan]]) -> None:
        """Local files: ``run``'s requests (in file order) one after the other, each file read through one
        open descriptor (:meth:`~shardkit.checkpoint.io.storage.Storage.files_held_open`), so the
        kernel's read-ahead streams it ahead of the reads and their checksums."""
        with self.storage.files_held_open():
            for r, plan in run:
                self.read_local(r, plan)

    def read_local(self, r: ReadRequest, plan: RequestPlan) -> None:
        """Local file: a contiguous piece goes straight into ``out``; anything else via scratch."""
        rec, lo, hi = plan.record, plan.lo, plan.hi
        needed = math.prod(r.box[1]) * r.out.element_size()
        if plan.run is not None and r.out.is_contiguous():
            a, b = plan.run
            head = self.scratch(0, (a - lo) + (hi - b))
            parts = [head[:a - lo], as_bytes(r.out), head[a - lo:]]
            acc = BlockCrc(rec.block)
            pos = rec.start + lo
            for step in _steps(parts, STEP_BYTES):  # checksum each step while it is still in cache
                self.storage.read_parts(rec.file, pos, step)
                for seg in step:
                    acc.update(seg)
                pos += sum(seg.numel() for seg in step)
            check_blocks(acc.finish(), lo // rec.block, rec, chunk_where(self.storage, r.fqn, rec))
            self.stats.add(read=hi - lo, needed=needed, requests=1)
            return
        buf = self.scratch(0, hi - lo)
        self.storage.read_parts(rec.file, rec.start + lo, [buf])
        self.deliver(r, rec, buf, lo)

    def read_batch(self, batch: list[tuple[ReadRequest, RequestPlan]]) -> None:
        """Remote file: one ranged request for neighbouring pieces, then verify and copy each.

        The response is used in place (no scratch copy), and the bytes in flight
        over all threads are bounded by ``REMOTE_INFLIGHT_BYTES``.
        """
        import torch

        file = batch[0][1].record.file
        start = min(p.record.start + p.lo for _, p in batch)
        end = max(p.record.start + p.hi for _, p in batch)
        with self._inflight.take(end - start):
            data = self.storage.read_bytes(file, start, end)
            if len(data) != end - start:
                raise CorruptCheckpoint(f"{self.storage.where(file)} ends before byte {end}; the file is truncated")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffer: we only read from it
                buf = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            for r, p in batch:
                self.deliver(r, p.record, buf[p.record.start + p.lo - start:p.record.start + p.hi - start], p.lo)

    def deliver(self, r: ReadRequest, rec: ChunkRecord, span: torch.Tensor, lo: int) -> None:
        """Verify the fetched span (chunk bytes ``[lo, lo + len(span))``), then copy ``r``'s piece into ``out``."""
        where = chunk_where(self.storage, r.fqn, rec)
        check_span(span, lo, rec, where)
        item = r.out.element_size()
        strides = contiguous_strides(rec.shape)
        first = sum((o - co) * s for o, co, s in zip(r.box[0], rec.offsets, strides))
        if rec.codec == "zstd":
            if tuple(r.box[1]) == tuple(rec.shape) and r.out.is_contiguous():
                zstd_decompress_into(span.numpy(), as_bytes(r.out), where)
            else:
                raw = self.scratch(1, math.prod(rec.shape) * item)
                zstd_decompress_into(span.numpy(), raw, where)
                typed = raw.view(r.out.dtype)
                r.out.copy_(typed.as_strided(r.box[1], strides, typed.storage_offset() + first))
        else:
            if span.storage_offset() % item:  # a piece of a batch may start off the item grid
                span = self.scratch(1, span.numel()).copy_(span)
            typed = span.view(r.out.dtype)
            r.out.copy_(typed.as_strided(r.box[1], strides, typed.storage_offset() + first - lo // item))
        self.stats.add(read=span.numel(), needed=math.prod(r.box[1]) * item, requests=1)


def read_runs(sizes: Sequence[int], lanes: int) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges cutting ``sizes`` (in file order) into at most ``lanes`` consecutive runs of
    about equal bytes: each I/O thread reads one run front to back, a stream the kernel reads ahead of."""
    total, out, a, acc = sum(sizes), [], 0, 0
    lanes = max(1, min(lanes, len(sizes)))
    for i, n in enumerate(sizes):
        acc += n
        if len(out) < lanes - 1 and acc * lanes >= total * (len(out) + 1) and i + 1 < len(sizes):
            out.append((a, i + 1))
            a = i + 1
    if a < len(sizes):
        out.append((a, len(sizes)))
    return out


def _steps(parts: Sequence[torch.Tensor], step: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive pieces of ``parts`` (flat byte tensors) covering at most ``step`` bytes each."""
    parts = [p for p in parts if p.numel()]
    i, off = 0, 0
    while i < len(parts):
        out, room = [], step
        while i < len(parts) and room:
            take = min(room, parts[i].numel() - off)
            out.append(parts[i][off:off + take])
            off += take
            room -= take
            if off == parts[i].numel():
                i, off = i + 1, 0
        yield out
