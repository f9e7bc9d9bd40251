"""``reshard``/``convert --to shardkit`` of a native checkpoint as a byte passthrough, without torch.

A migration between object stores (issue 40) spends its first second importing
torch, while a plain copy is already uploading.  Yet when a native source is
stored the way the output will be, the output's chunks are byte ranges of the
source's: each rank's rows of a tensor are a run of whole rows of the chunks
that tile it along dim 0.  So such a command is written here, from the bytes,
by the same writer, journal and commit as the engine (one
:class:`~shardkit.checkpoint.formats.write_job.WriteJob` given to the native
handler's ``write``): same plan, same file names, same manifest, same resume.

Eligible (:func:`eligible_manifest`): a committed native checkpoint whose
manifest holds every chunk record (no index files, no sibling references),
whose chunks are raw (not zstd), not column-striped, and cut along dim 0 only
(each spans the tensor's other dims whole, and they tile dim 0 without gap or
overlap); and a command that filters, renames, casts and compresses nothing
(the CLI checks its words: ``shardkit.cli.passthrough``).  Anything else is
answered ``None`` and left to the engine.

What it keeps: every source byte is read in blocks of the chunk's checksum
grid and checked against its crc32c before it is written
(:func:`~shardkit.checkpoint.formats.native.chunk_reads.read_rows`); the output's
block checksums are computed on the way; DST is checked and replaced exactly
as the engine does (:mod:`~shardkit.checkpoint.offline.replace`); memory is
one output chunk per writer thread plus the block cache of an object-store
source (:func:`~shardkit.checkpoint.offline.read_through.read_through`).

A rerun (DST holds a resume journal) reads no source byte that feeds only the
outputs already finished: the writer keeps those once their journal records
and headers check out, then tells the job's ``will_fetch`` the chunks it still
writes; their rows, rounded out to their checksum blocks
(:meth:`RowFetch.needed`), become the block cache's blocks instead of its
aligned 8 MiB ones (which hold the finished outputs' rows too): the needed
ranges of each file joined where they touch, fetched in pieces of 8 MiB or
more where they run that long, read ahead, within the same budget
(:meth:`~shardkit.checkpoint.io.read_cache.BlockCache.plan`), every byte
still checked against its crc32c.  The head start, told of the journal,
fetched nothing ahead (:mod:`shardkit.checkpoint.io.head_start`); one that
was not told and guessed blocks leaves them read as they are.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from shardkit.checkpoint.formats import NATIVE
from shardkit.checkpoint.formats.dtypes import code_itemsize, dtype_spelling
from shardkit.checkpoint.formats.native import (
    MANIFEST_NAME,
    ChunkRecord,
    Manifest,
    check_data_file,
    checked_span,
    extra_files,
    parse_manifest,
    read_rows,
    stored_entries,
)
from shardkit.checkpoint.formats.write_job import FetchBox, WriteJob
from shardkit.checkpoint.io.names import RESUME_DIR, split_reference
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.offline.options import DEFAULT_WORKERS, parse_memory
from shardkit.checkpoint.offline.progress import Progress
from shardkit.checkpoint.offline.read_through import plan_reads, read_through
from shardkit.checkpoint.offline.replace import prepare_dst_meanwhile
from shardkit.checkpoint.offline.result import ConvertResult
from shardkit.checkpoint.offline.side_files import copy_side_files, side_files_meanwhile
from shardkit.checkpoint.offline.source import check_distinct, source_id_meanwhile
from shardkit.errors import CorruptCheckpoint, ShardkitError

__all__ = ["passthrough", "eligible_manifest", "RowFetch"]

log = logging.getLogger(__name__)


def eligible_manifest(storage: Storage) -> Manifest | None:
    """The manifest of the native checkpoint at ``storage`` when its bytes can be passed through as they are
    stored (see the module docstring), else ``None`` -- also when there is none or it does not parse: the
    engine then opens SRC and reports what is wrong in its own words."""
    try:
        manifest = parse_manifest(storage.read_bytes(MANIFEST_NAME), storage.where(MANIFEST_NAME))
    except ShardkitError as exc:
        log.debug("%s: no passthrough (%s)", storage.url, exc)
        return None
    why = _ineligible(manifest)
    if why:
        log.debug("%s: no passthrough: %s", storage.url, why)
        return None
    return manifest


def _ineligible(manifest: Manifest) -> str:
    """Why ``manifest``'s chunks are not the output's bytes ("" when they are)."""
    if not manifest.complete or manifest.indexes or manifest.references:
        return "chunk records in index files, or sibling references"
    if not manifest.tensors:
        return "no tensor"
    for name, t in manifest.tensors.items():
        chunks = sorted(t.chunks, key=lambda c: c.offsets)
        if not t.shape:
            if len(chunks) != 1 or chunks[0].shape != ():
                return f"{name!r}: a scalar stored as {len(chunks)} chunks"
        covered = 0
        for rec in chunks:
            if rec.codec != "raw" or rec.strips or split_reference(rec.file) is not None:
                return f"{name!r}: a {rec.codec}{' striped' if rec.strips else ''} or referenced chunk"
            if t.shape and (tuple(rec.offsets[1:]) != (0,) * (len(t.shape) - 1)
                            or tuple(rec.shape[1:]) != tuple(t.shape[1:]) or rec.offsets[0] != covered):
                return f"{name!r}: chunks not cut along dim 0 alone"
            if rec.nbytes != math.prod(rec.shape) * code_itemsize(t.dtype):
                return f"{name!r}: a chunk of {rec.nbytes} bytes for its {list(rec.shape)} {t.dtype}"
            covered += rec.shape[0] if rec.shape else 0
        if t.shape and covered != t.shape[0]:
            return f"{name!r}: chunks cover {covered} of {t.shape[0]} rows"
    return ""


@dataclass
class RowFetch:
    """``fetch(name, offsets, shape)`` -> the stored bytes of that box (rows of dim 0, whole along the other
    dims) of an eligible source, each block checked against its crc32c: the passthrough's ``WriteJob.fetch``.
    A box inside one stored chunk is a view of one read; one across chunks is joined in a buffer of its size.
    Each data file is checked (there, its size, its header: :func:`check_data_file`) before its first byte
    is used, as the engine's reader checks it."""

    storage: Storage
    manifest: Manifest
    reserved_bytes: int = 0  # the source's block cache, set aside before the writers size their concurrency
    casts: bool = False      # bytes are never cast: one buffer per thread
    _chunks: dict[str, list[ChunkRecord]] = field(default_factory=dict)
    _files: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._chunks = {name: sorted(t.chunks, key=lambda c: c.offsets) for name, t in self.manifest.tensors.items()}

    def _read(self, name: str, rec: ChunkRecord, first: int, past: int, item: int) -> memoryview:
        if rec.file not in self._files:
            with self._lock:
                if rec.file not in self._files:
                    check_data_file(self.storage, self.manifest, rec.file,
                                    stored_entries(self.manifest, [rec.file])[rec.file])
                    self._files.add(rec.file)
        return read_rows(self.storage, name, rec, (first, past), item)

    def _parts(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[ChunkRecord, int, int]]:
        """The stored chunks of box ``(offsets, shape)`` of ``name`` and its rows in each, in their own
        numbering: ``(record, first row, past row)``, in row order."""
        chunks = self._chunks[name]
        if not shape:
            return [(chunks[0], 0, 1)]
        lo, hi = offsets[0], offsets[0] + shape[0]
        parts = [(rec, max(lo, rec.offsets[0]) - rec.offsets[0], min(hi, rec.offsets[0] + rec.shape[0])
                  - rec.offsets[0]) for rec in chunks if rec.offsets[0] < hi and lo < rec.offsets[0] + rec.shape[0]]
        if sum(b - a for _, a, b in parts) != hi - lo:
            raise CorruptCheckpoint(f"{self.storage.where(MANIFEST_NAME)}: the chunks of {name!r} do not cover "
                                    f"rows {lo}-{hi}")
        return parts

    def needed(self, boxes: Sequence[FetchBox]) -> dict[str, list[tuple[int, int]]]:
        """Per data file, the byte ranges that fetching ``boxes`` reads: each box's rows in each chunk, rounded
        out to the chunk's checksum blocks (:func:`checked_span`, as :func:`read_rows` reads them)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for name, offsets, shape in boxes:
            item = code_itemsize(self.manifest.tensors[name].dtype)
            for rec, a, b in self._parts(name, offsets, shape):
                row = math.prod(rec.shape[1:]) * item
                lo, hi = checked_span(rec, a * row, b * row)
                if lo < hi:
                    out.setdefault(rec.file, []).append((rec.start + lo, rec.start + hi))
        return out

    def __call__(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> memoryview | bytearray:
        item = code_itemsize(self.manifest.tensors[name].dtype)
        parts = self._parts(name, offsets, shape)
        if len(parts) == 1:
            return self._read(name, *parts[0], item)
        out = bytearray(math.prod(shape) * item)
        pos = 0
        for rec, a, b in parts:
            piece = self._read(name, rec, a, b, item)
            out[pos:pos + piece.nbytes] = piece
            pos += piece.nbytes
        return out


@dataclass
class _Info:
    format: str
    meta: Mapping[str, Any]


class _Source:
    """What the side-file copy and the source identity ask of an open source, for a manifest read here."""

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage = self.folder = storage
        self.info = _Info(NATIVE.name, manifest.meta)

    @property
    def side_files(self) -> list[str]:
        return extra_files(self.storage)


def _plan_reads(storage: Storage, fetch: RowFetch, boxes: Sequence[FetchBox]) -> None:
    """Tell the source's block cache the bytes that ``boxes`` (what a rerun still writes) read."""
    needed = fetch.needed(boxes)
    planned = plan_reads(storage, needed)
    log.debug("%s: a rerun reads %d bytes of %d data files%s", storage.url,
              sum(b - a for ranges in needed.values() for a, b in ranges), len(needed),
              " in runs of the needed bytes" if planned else "")


def passthrough(src: str, dst: str, *, tool: str, world_size: int = 1, overwrite: bool = False,
                storage_options: dict[str, Any] | None = None, dst_storage_options: dict[str, Any] | None = None,
                max_memory: int | str | None = None, workers: int = DEFAULT_WORKERS,
                progress: Progress | None = None) -> ConvertResult | None:
    """``reshard --world-size N`` (``tool="reshard"``) or ``convert --to shardkit`` (``"convert"``, one rank)
    of the native checkpoint ``src`` to ``dst`` from its bytes; ``None`` (nothing done, DST untouched) when
    ``src`` is not eligible: the engine (:mod:`~shardkit.checkpoint.offline.convert`) then runs the command.
    Options are :func:`~shardkit.checkpoint.offline.convert.reshard`'s; the result is the one it returns."""
    budget = parse_memory(max_memory)
    if dst_storage_options is None:
        dst_storage_options = storage_options
    check_distinct(src, dst, storage_options, dst_storage_options)
    storage = Storage(src, storage_options)
    manifest = eligible_manifest(storage)
    if manifest is None:
        return None
    dest_of = prepare_dst_meanwhile(dst, NATIVE, dst_storage_options, overwrite)
    source = _Source(storage, manifest)
    pin = source_id_meanwhile(src, storage_options, source)
    tensors = [(name, t.dtype, tuple(t.shape)) for name, t in manifest.tensors.items()]
    tensors += [(alias, manifest.tensors[target].dtype, tuple(manifest.tensors[target].shape))
                for alias, target in manifest.aliases.items()]
    started = time.perf_counter()
    dest = dest_of()
    out = dest.storage
    side_files = side_files_meanwhile(source)
    # a rerun: its finished outputs need none of the source, and only the writer knows which they are once
    # it has checked their journal records and headers; it then tells will_fetch the boxes left, and the
    # source's block cache fetches those boxes' bytes (rounded to checksum blocks) in runs of 8 MiB or more
    # instead of aligned blocks, which hold the finished outputs' rows too -- unless a head start fetched
    # blocks already (it did not know of the journal): those are read through the cache as they are
    resumes = RESUME_DIR in dest.before
    with read_through(source, budget, workers) as reserved:
        fetch = RowFetch(storage, manifest, reserved)
        job = WriteJob(
            tensors=tuple(tensors), values=dict(manifest.values), aliases=dict(manifest.aliases), tool=tool,
            fetch=fetch, will_fetch=(lambda boxes: _plan_reads(storage, fetch, boxes)) if resumes else None,
            selection=tuple((name, name, dtype_spelling(code), shape) for name, code, shape in tensors),
            meta=dict(manifest.meta), avoid=frozenset(dest.avoid), replacing=dest.replacing,
            discard=dest.discard_created,
            copy_side_files=lambda into: copy_side_files(source, out, into=into, found=side_files()),
            progress=progress, world_size=world_size, budget=budget, workers=workers, source_id=pin())
        written = NATIVE.write(out, job)
    result = ConvertResult(NATIVE.name, NATIVE.name, out.url, len(tensors), written.nbytes, written.files, [],
                           written.kept_bytes, written.stored_bytes)
    dest.remove_stale(result.files)
    log.info("%s %s -> %s (bytes passed through): %d tensors, %d bytes, %d files in %.2f s", tool, src, out.url,
             result.tensors, result.bytes, len(result.files), time.perf_counter() - started)
    return result
