"""The native format: ``manifest.json`` + safetensors data files, read by byte ranges.

Reading (:class:`NativeReader`): the manifest is parsed and validated once;
before any destination tensor is touched, every data file a batch of requests
needs is checked to exist with the size the manifest records, and its
safetensors header to be intact and to hold the chunks the manifest names.
What a request reads (its chunk record, byte runs and block span) is worked
out once, the first time the reader sees it (:mod:`.request_plans`).
Each request is then served with the fewest bytes that still verify:

* *direct*: the piece is one contiguous run of the stored chunk and the
  destination is contiguous -- the run is read with one ``preadv`` straight into
  the destination's memory, plus the partial checksum blocks at its two ends
  into a small scratch buffer; every covered block is verified.
* *staged*: otherwise (e.g. a column slice of a row-stored chunk) the covering
  block span is read into a per-thread scratch buffer, verified, then copied
  with one strided ``copy_``.
* *zstd*: the frame is read whole, verified, and decompressed straight into the
  destination when the piece is the whole chunk, else into scratch.

On a local disk a load's requests are sorted by file and offset and cut into
one consecutive run per I/O thread (:func:`~.chunk_reads.read_runs`); a thread
reads its run front to back, each file through one descriptor held open for the
run, so the kernel's read-ahead streams ahead of the reads and their checksums.
How each request's bytes reach its target is :mod:`.chunk_reads`; this module
opens the checkpoint, validates and plans the requests, and runs them.

A chunk stored as column strips is, to the reader, one plain chunk per strip
(:meth:`ChunkRecord.pieces`): a request names the strip it reads from, so a
column cut fetches only the strips it needs.

Writing lives in :mod:`~shardkit.checkpoint.formats.native.writer` (:class:`NativeWriter`,
:class:`WrittenFile` and the file-naming helpers).
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from shardkit.checkpoint.formats.base import (
    CheckpointInfo,
    CheckpointReader,
    ReadRequest,
    StoredChunk,
    TensorEntry,
)
from shardkit.checkpoint.formats.compression import zstd_decompress_into
from shardkit.checkpoint.formats.dtypes import code_to_dtype
from shardkit.checkpoint.formats.native.checksums import CHECK_SPAN, STEP_BYTES, check_chunk
from shardkit.checkpoint.formats.native.chunk_reads import ChunkReads, chunk_where, damaged, read_runs
from shardkit.checkpoint.formats.native.data_files import check_data_file, stored_entries
from shardkit.checkpoint.formats.native.index import attach_indexes, needed_indexes, read_indexes
from shardkit.checkpoint.formats.native.manifest import (
    MANIFEST_NAME,
    ChunkRecord,
    Manifest,
)
from shardkit.checkpoint.formats.native.manifest_parse import parse_manifest
from shardkit.checkpoint.formats.native.ownership import extra_files
from shardkit.checkpoint.formats.native.request_plans import RequestPlan, batches, plan_request
from shardkit.checkpoint.geometry.boxes import Box
from shardkit.checkpoint.io.concurrency import (
    DEFAULT_IO_THREADS,
    parallel_map,
)
from shardkit.checkpoint.io.read_cache import merge_ranges
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import (
    CheckpointNotFound,
    IncompatibleStateDict,
    InvalidManifest,
)

if TYPE_CHECKING:
    pass

__all__ = ["NativeReader", "read_manifest", "is_committed", "detect", "open_reader"]

REMOTE_IO_THREADS = 16  # object stores are latency-bound: keep many ranged requests in flight
# Local reads: hint at most this much of what a load needs, one POSIX_FADV_WILLNEED per merged range.  Linux
# reads at most the device's read-ahead window per hint (max(read_ahead_kb, max_sectors_kb): 8 MiB on these VMs),
# so this starts the disk on every file while the load plans and agrees; the kernel's own read-ahead, driven
# by the reads, streams the rest.  Hinting all of it (every MiB, the pages queued from a thread of their own)
# was slower: 2.08x a raw read against 1.20x (peers.py, 300 MB, 2 ranks, cold) -- likely because pages a hint
# brings in carry no read-ahead mark, and one thread then allocates every page the reads wait for.
_PREFETCH_BYTES = 1 << 30
MAX_PLANS = 1 << 16  # request plans kept (about 500 B each with their keys: 32 MiB at most); see NativeReader._plan


def read_manifest(storage: Storage, *, chunks: bool = True, io_threads: int = DEFAULT_IO_THREADS) -> Manifest:
    """Read and validate ``manifest.json``; a directory without one is not a checkpoint.

    ``chunks``: also read every index file of a version-3 checkpoint, so the manifest holds every chunk
    record (else only the regions; :func:`~.index.attach_indexes` adds the records of some writers)."""
    try:
        data = storage.read_bytes(MANIFEST_NAME)
    except CheckpointNotFound:
        raise CheckpointNotFound(f"{storage.url} holds no {MANIFEST_NAME}: not a committed shardkit checkpoint "
                                 f"(the save may have been interrupted, or the URL is wrong)") from None
    manifest = parse_manifest(data, storage.where(MANIFEST_NAME))
    if not chunks or manifest.complete:
        return manifest
    return attach_indexes(manifest, read_indexes(storage, manifest, manifest.indexes, io_threads), storage)


def is_committed(storage: Storage) -> bool:
    return storage.exists(MANIFEST_NAME)


def detect(storage: Storage) -> bool:
    return is_committed(storage)


def open_reader(storage: Storage, io_threads: int = DEFAULT_IO_THREADS) -> "NativeReader":
    return NativeReader(storage, io_threads=io_threads)


# --------------------------------------------------------------------------
# reading


class NativeReader(CheckpointReader):
    """A committed native checkpoint, opened for ranged, verified reads."""

    def __init__(self, storage: Storage | str, storage_options: Mapping[str, Any] | None = None, *,
                 io_threads: int = DEFAULT_IO_THREADS, manifest: Manifest | None = None) -> None:
        super().__init__()
        self.storage = storage if isinstance(storage, Storage) else Storage(storage, storage_options)
        self.io_threads = io_threads
        self._base = manifest if manifest is not None else read_manifest(self.storage, chunks=False)
        self._focused = False  # focus() chose which index files to read; else the first use reads them all
        self._loaded: set[str] = set()
        self._use(self._base)
        writer = self._base.writer
        self.info = CheckpointInfo("shardkit", self.storage.url, self._base.version,
                                   writer.get("world_size") if isinstance(writer.get("world_size"), int) else None,
                                   writer.get("mesh") if isinstance(writer.get("mesh"), dict) else None,
                                   self._base.meta, _layouts(writer.get("layouts")))
        self._checked: set[str] = set()
        self._lock = threading.Lock()
        self._reads = ChunkReads(self.storage, self.stats)
        self._hinted: dict[str, list[tuple[int, int]]] = {}  # file -> byte ranges the kernel was asked to read

    @property
    def folder(self) -> Storage:
        """The checkpoint's directory, where its side files are."""
        return self.storage

    @property
    def side_files(self) -> list[str]:
        """Files that travel with the weights (config.json, tokenizer files), kept under ``extra/``."""
        return extra_files(self.storage)

    def _use(self, manifest: Manifest) -> None:
        self._manifest = manifest
        self._plans: dict[tuple, RequestPlan] = {}  # chunk numbers change with the records
        self._entries = {
            fqn: TensorEntry(fqn, code_to_dtype(t.dtype), t.shape,
                             tuple(StoredChunk(p.offsets, p.shape, p) for c in t.chunks for p in c.pieces()))
            for fqn, t in manifest.tensors.items()}
        for alias, target in manifest.aliases.items():  # the same stored chunks under the tied key
            t = self._entries[target]
            self._entries[alias] = TensorEntry(alias, t.dtype, t.shape, t.chunks)

    @property
    def manifest(self) -> Manifest:
        """The manifest with every chunk record -- unless :meth:`focus` chose the index files to read."""
        if not self._focused and not self._manifest.complete:
            docs = read_indexes(self.storage, self._base, self._base.indexes, self.io_threads)
            self._use(attach_indexes(self._base, docs, self.storage))
        return self._manifest

    def focus(self, wanted: Mapping[str, Sequence[Box]]) -> None:
        """Read only the index files of the writers that stored part of ``wanted`` (fqn -> boxes): a rank
        of a large job reads the records of its neighbours, not of every rank (version 3)."""
        if self._manifest.complete:
            return
        self._focused = True
        names = set(needed_indexes(self._base, wanted)) | self._loaded
        if names - self._loaded:
            docs = read_indexes(self.storage, self._base, names, self.io_threads)
            self._use(attach_indexes(self._base, docs, self.storage))
            self._loaded = set(names)

    def tensors(self) -> Mapping[str, TensorEntry]:
        self.manifest  # noqa: B018 - every chunk record, unless focus() chose
        return self._entries

    def values(self) -> Mapping[str, Any]:
        return self._base.values

    def aliases(self) -> Mapping[str, str]:
        return self._base.aliases

    def close(self) -> None:
        self._reads.forget_scratch()
        self._plans = {}
        self._hinted = {}

    @property
    def rereads_from_cache(self) -> bool:
        """A local disk: a checking pass leaves the bytes in the page cache for the read that follows."""
        return self.storage.rereads_from_cache

    # -- validation before any write -----------------------------------
    def check_files(self, names: Sequence[str]) -> None:
        """Every named data file exists with exactly the size the manifest records, and its safetensors
        header is intact and holds the manifest's chunks where it says (:mod:`.data_files`)."""
        todo = sorted(set(names) - self._checked)
        if not todo:
            return
        expected = stored_entries(self._manifest, todo)
        parallel_map(lambda name: check_data_file(self.storage, self._manifest, name, expected[name]), todo,
                     self.io_threads if self.storage.parallel_requests_help else 1)
        with self._lock:
            self._checked.update(todo)

    def _plan(self, r: ReadRequest) -> RequestPlan:
        """``r``'s plan: computed by :meth:`_validate` the first time its key, chunk and box are seen (by
        ``prepare``, or by ``verify``/``read`` when nothing prepared it), then looked up; only the
        destination, which a copy of the request may change, is checked on every use.  The plans are a
        bounded cache (offline tools read a whole checkpoint through one reader): past ``MAX_PLANS`` the
        oldest plan goes, so a rank that prepares more requests than that in one load plans the evicted
        ones again when it reads them -- correct, and the price of flat memory."""
        key = (r.fqn, r.chunk, tuple(r.box[0]), tuple(r.box[1]))  # a caller's box may hold lists
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                del self._plans[next(iter(self._plans))]  # the oldest (dicts keep insertion order)
            plan = self._plans[key] = self._validate(r)
        else:
            self._check_destination(r)
        return plan

    def _check_destination(self, r: ReadRequest) -> None:
        dtype = self._entries[r.fqn].dtype
        if r.out.dtype != dtype or tuple(r.out.shape) != tuple(r.box[1]):
            raise IncompatibleStateDict(f"{r.fqn!r}: destination {tuple(r.out.shape)} {r.out.dtype} does not match "
                                        f"the requested box {tuple(r.box[1])} {dtype}")

    def _validate(self, r: ReadRequest) -> RequestPlan:
        """Check that ``r`` names a stored chunk holding its box and a destination of its shape and
        dtype, and work out the bytes it reads."""
        entry = self._entries.get(r.fqn)
        if entry is None:
            raise IncompatibleStateDict(f"{r.fqn!r} is not a tensor in {self.storage.url}")
        if not 0 <= r.chunk < len(entry.chunks):
            raise IncompatibleStateDict(f"{r.fqn!r} has no stored chunk {r.chunk}")
        rec: ChunkRecord = entry.chunks[r.chunk].locator
        self._check_destination(r)
        if not all(co <= o and o + s <= co + cs for co, cs, o, s in zip(rec.offsets, rec.shape, *r.box)):
            raise IncompatibleStateDict(f"{r.fqn!r}: requested box lies outside stored chunk {r.chunk}")
        if rec.codec == "raw" and rec.block % r.out.element_size():
            raise InvalidManifest(f"{r.fqn!r} chunk {r.chunk}: checksum block {rec.block} is not a multiple of "
                                  f"the item size")
        return plan_request(rec, r.box, r.out.element_size())

    def prepare(self, requests: Sequence[ReadRequest]) -> None:
        """Validate every request, work out its bytes, and check the size and header of every data file
        they touch.  On a local disk the kernel is asked first to read every header, then the data: the
        disk reads the data while the headers are checked, instead of after."""
        plans = [self._plan(r) for r in requests if r.out.numel()]
        ranges = [(p.record.file, p.record.start + p.lo, p.record.start + p.hi) for p in plans]
        heads = {}
        for file in {p.record.file for p in plans} - self._checked:
            header = self._manifest.files[file].header if file in self._manifest.files else None
            if header is not None:
                heads[file] = (file, 0, header.size)
        self._prefetch(list(heads.values()))  # the headers first: the checks below wait for them alone
        self._prefetch(ranges)
        self.check_files([p.record.file for p in plans])

    def read(self, requests: Sequence[ReadRequest]) -> None:
        requests = [r for r in requests if r.out.numel()]
        plans = [self._plan(r) for r in requests]
        self.check_files([p.record.file for p in plans])
        if self.storage.reads_in_place:
            order = sorted(range(len(requests)), key=lambda i: (plans[i].record.file, plans[i].record.start))
            self._prefetch([(p.record.file, p.record.start + p.lo, p.record.start + p.hi)
                            for p in (plans[i] for i in order)])
            sizes = [plans[i].hi - plans[i].lo for i in order]
            runs = [[(requests[i], plans[i]) for i in order[a:b]] for a, b in read_runs(sizes, self.io_threads)]
            parallel_map(self._reads.read_run, runs, self.io_threads)
            return
        parallel_map(self._reads.read_batch, batches(list(zip(requests, plans))),
                     max(self.io_threads, REMOTE_IO_THREADS))

    def verify(self, requests: Sequence[ReadRequest]) -> None:
        """Read and check every checksum block ``requests`` would read, writing no ``out``.

        The first pass of an all-or-nothing ``load``.  Targets are the only
        memory big enough to hold what a load reads, so the bytes are checked
        here and thrown away: the block ranges of all requests are merged per
        chunk (each block read once), cut into spans of at most ``CHECK_SPAN``
        and checked by :func:`check_chunk` in parallel over the I/O threads --
        crc32c only, no copy into any target.  Memory: one read step per
        thread.  On a local disk the pass leaves the bytes in the page cache,
        so the ``read`` that follows costs a cached copy, not a second trip to
        the disk.  zstd
        frames are read whole (a frame is at most a chunk) and also decoded
        into scratch, since a frame can only be checked by decoding it.
        """
        requests = [r for r in requests if r.out.numel()]
        plans = [self._plan(r) for r in requests]
        self.check_files([p.record.file for p in plans])
        spans: dict[tuple[str, int], tuple[str, ChunkRecord, list[tuple[int, int]]]] = {}
        for r, p in zip(requests, plans):
            spans.setdefault((p.record.file, p.record.start), (r.fqn, p.record, []))[2].append((p.lo, p.hi))
        items: list[tuple[str, ChunkRecord, int, int]] = []
        for fqn, rec, ranges in spans.values():
            step = rec.nbytes if rec.codec == "zstd" else max(rec.block, CHECK_SPAN // rec.block * rec.block)
            for lo, hi in merge_ranges(ranges):
                items.extend((fqn, rec, a, min(hi, a + step)) for a in range(lo, hi, step))
        items.sort(key=lambda it: (it[1].file, it[1].start + it[2]))
        self._prefetch([(rec.file, rec.start + lo, rec.start + hi) for _, rec, lo, hi in items])
        local = self.storage.small_reads_cheap

        def check(item: tuple[str, ChunkRecord, int, int]) -> None:
            import torch

            fqn, rec, lo, hi = item
            where = chunk_where(self.storage, fqn, rec)
            frame = rec.codec == "zstd"  # read whole and kept: a frame must also decode to the chunk's bytes
            buf = self._reads.scratch(0, hi - lo if frame else min(hi - lo, STEP_BYTES if local else CHECK_SPAN))
            bad = check_chunk(self.storage, rec, lo, hi, scratch=buf, keep=frame)
            if bad is not None:
                raise damaged(where, bad)
            if frame:
                itemsize = torch.empty((), dtype=self._entries[fqn].dtype).element_size()
                zstd_decompress_into(buf.numpy(), self._reads.scratch(1, math.prod(rec.shape) * itemsize), where)

        parallel_map(check, items, self.io_threads if local else max(self.io_threads, REMOTE_IO_THREADS))

    def _prefetch(self, ranges: Sequence[tuple[str, int, int]]) -> None:
        """Local files: ask the kernel to start reading the first ``_PREFETCH_BYTES`` of ``(file, a, b)`` ranges
        (enough to keep the disk busy; its readahead does the rest).  A file hinted already for these
        ranges is not hinted again (``prepare`` hints what ``read`` asks for)."""
        if not self.storage.reads_in_place:
            return
        by_file: dict[str, list[tuple[int, int]]] = {}
        for file, a, b in ranges:
            by_file.setdefault(file, []).append((a, b))
        budget = _PREFETCH_BYTES
        todo = []
        for file, spans in sorted(by_file.items()):
            hinted = []
            for a, b in merge_ranges(spans):
                if budget <= 0:
                    break
                hinted.append((a, min(b, a + budget)))
                budget -= hinted[-1][1] - a
            done = self._hinted.get(file)
            if done is not None and all(any(a >= c and b <= d for c, d in done) for a, b in hinted):
                continue
            self._hinted[file] = hinted
            todo.append((file, hinted))
        if todo:
            self.storage.prefetch_files(todo)


def _layouts(value: Any) -> tuple[dict[str, Any], ...]:
    """The writer's ``layouts`` as recorded, keeping only well-formed entries: the record is
    informational (``inspect`` shows it), so a foreign or older manifest never fails on it."""
    if not isinstance(value, list):
        return ()
    return tuple(e for e in value if isinstance(e, dict) and isinstance(e.get("mesh"), dict)
                 and isinstance(e.get("placements"), list) and isinstance(e.get("tensors"), list))
