"""The native format's writer for N ranks: plan, stream, resume, commit (``NATIVE.write``).

The plan is pure arithmetic: every output tensor is split along dim 0 the way
``Shard(0)`` splits it over the shard dim of the target mesh (``ceil(n/S)``
rows per rank, later ranks short or empty: :func:`~shardkit.checkpoint.geometry.boxes.shard_range`,
the rule of :func:`~shardkit.checkpoint.geometry.boxes.shard_box`), each rank's box is cut into
chunks of at most ``chunk_cap`` bytes (:func:`~shardkit.checkpoint.geometry.boxes.split_box`),
and each rank's chunks are packed into data files ("work units") of at most
``file_cap`` bytes.  Rank ``s`` of the replica-0 row writes file(s)
``data/<token>-<s>-<part>.safetensors``, so a job at the target size reads
exactly its own files; replicas of a 2-D mesh are written once.  Scalars go
to rank 0.

Each work unit is written by :class:`~shardkit.checkpoint.formats.native.writer.NativeWriter`
(streaming safetensors, crc32c per block, optional zstd), pulling each chunk
from the job's ``fetch`` just in time, so memory is one chunk per worker.
Units run on ``workers`` threads.

Resume: the token is a hash of the plan and of the source's identity (the
job's ``source_id``: its canonical location and a fingerprint of its
contents), so a rerun of the same command on the same SRC plans the same file
names.  After each unit, its manifest records are journaled
(:mod:`~shardkit.checkpoint.formats.native.journal`); a rerun keeps a journaled
file only when the identity matches and the file is as it landed (size, change
stamp, header: its data is not read back); those checks come before any
write, so that the job's ``will_fetch`` is told the chunks left to fetch before the
first is (the byte passthrough's source then reads only what they need).  When SRC
changed in between, the plan's names change and nothing old is kept: data
written from an older SRC can never end up in the new checkpoint.  The
manifest is committed last; the journal and any data files of older plans are
removed after the commit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.compression import parse_compression
from shardkit.checkpoint.formats.dtypes import as_bytes, is_tensor, itemsize
from shardkit.checkpoint.formats.native.journal import file_stamp, journal_entry, journal_name, journaled_file
from shardkit.checkpoint.formats.native.manifest import MANIFEST_NAME
from shardkit.checkpoint.formats.native.ownership import EXTRA_DIR, RESUME_DIR
from shardkit.checkpoint.formats.native.stoppable import Stopped, stoppable_map
from shardkit.checkpoint.formats.native.writer import (
    DEFAULT_CHUNK_BYTES,
    NativeWriter,
    WrittenFile,
    data_file_name,
    group_into_files,
)
from shardkit.checkpoint.formats.write_job import FetchBox, TensorSpec, WriteJob, Written
from shardkit.checkpoint.geometry.boxes import shard_range, split_box
from shardkit.checkpoint.io.direct_io import BUFFER_BYTES as DIRECT_BUFFER_BYTES
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.io.uploads import DEPTH as UPLOAD_DEPTH
from shardkit.checkpoint.io.uploads import PART_BYTES
from shardkit.errors import CheckpointError, ConfigurationError, ShardkitError

if TYPE_CHECKING:
    import torch

__all__ = ["FileUnit", "plan_files", "write_resumable", "commit_resumable", "assign_units", "chunk_cap_for",
           "concurrency_for", "upload_depth"]

log = logging.getLogger(__name__)

FILE_CAP = 1 << 30


@dataclass(frozen=True)
class FileUnit:
    """One output data file: who writes it (the target rank) and the chunks it holds, in order."""

    name: str
    writer: int
    chunks: tuple[FetchBox, ...]  # (output name, offsets, shape)
    nbytes: int


@dataclass(frozen=True)
class _PlannedChunk:
    """One output chunk of the plan: tensor name, box, and bytes (what file packing weighs)."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int


def _count(n: int, noun: str) -> str:
    return f"{n} {noun if n == 1 else noun + 's'}"


def plan_files(tensors: Sequence[TensorSpec], shards: int, chunk_cap: int, file_cap: int,
               salt: str) -> list[FileUnit]:
    """Work units for ``shards`` ranks; names carry a token derived from the whole plan."""
    per_rank: list[list[_PlannedChunk]] = [[] for _ in range(shards)]
    for name, dtype, shape in tensors:  # aliases are written once, as the tensor they are tied to
        size = itemsize(dtype)
        if not shape:
            per_rank[0].append(_PlannedChunk(name, (), (), size))
            continue
        for s in range(shards):
            lo, hi = shard_range(shape[0], shards, s)
            if hi == lo and not (s == 0 and shape[0] == 0):
                continue
            box = ((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))
            for offsets, piece in split_box(box, size, chunk_cap):
                per_rank[s].append(_PlannedChunk(name, tuple(offsets), tuple(piece), math.prod(piece) * size))
    plan = [[[c.name, c.offsets, c.shape, c.nbytes] for c in chunks] for chunks in per_rank]
    digest = hashlib.sha256(json.dumps([salt, plan, file_cap]).encode()).hexdigest()[:10]
    units: list[FileUnit] = []
    for s, chunks in enumerate(per_rank):
        for part, group in enumerate(group_into_files(chunks, 1, file_cap)):
            units.append(FileUnit(data_file_name(digest, s, part), s,
                                  tuple((c.name, c.offsets, c.shape) for c in group), sum(c.nbytes for c in group)))
    return units


def assign_units(units: Sequence[FileUnit], nprocs: int) -> list[list[int]]:
    """Split work units over ``nprocs`` processes, balanced by bytes (largest first, to the least loaded)."""
    loads = [0] * nprocs
    out: list[list[int]] = [[] for _ in range(nprocs)]
    for i in sorted(range(len(units)), key=lambda i: -units[i].nbytes):
        k = min(range(nprocs), key=lambda p: (loads[p], p))
        out[k].append(i)
        loads[k] += units[i].nbytes
    return [sorted(x) for x in out]


def write_units(storage: Storage, job: WriteJob, units: Sequence[FileUnit],
                workers: int) -> tuple[list[WrittenFile], int]:
    """Write (or, when journaled and intact, keep) each unit; journal each one as it lands.

    The units an earlier run finished are checked first (their journal records and headers, on
    ``workers`` threads), so that before the first byte is fetched the job's ``will_fetch`` can be told the
    boxes of the units left -- all of them on a first run.  Returns the records, in unit order, and the
    number of bytes kept from an earlier run.
    """
    dtypes = {name: dtype for name, dtype, _ in job.tensors}
    shapes = {name: shape for name, _, shape in job.tensors}
    writer = NativeWriter(storage, compression=parse_compression(job.compression), fsync=storage.fsync_worthwhile)
    # one listing of the journal instead of a probe per file (on an object store a probe of a missing
    # record is two requests); only a file whose record is listed can be kept
    journaled = set(storage.listdir(RESUME_DIR))
    listed = [u for u in units if journal_name(u.name).rsplit("/", 1)[-1] in journaled]
    found = stoppable_map(lambda unit, _: journaled_file(storage, unit.name, job.source_id), listed, workers)
    kept = {unit.name: wf for unit, wf in zip(listed, found) if wf is not None}
    for unit in units:
        if job.progress and unit.name in kept:
            job.progress.skip(unit.nbytes)
    todo = [u for u in units if u.name not in kept]
    if job.will_fetch is not None:
        job.will_fetch([box for unit in todo for box in unit.chunks])

    def one(unit: FileUnit, stop: threading.Event) -> WrittenFile:
        if stop.is_set():
            raise Stopped(unit.name)

        def loader(name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Callable[[], torch.Tensor | Any]:
            counted = [False]  # a retried write loads the chunk again: the progress counts it once

            def load() -> torch.Tensor | Any:
                if stop.is_set():  # interrupted: abandon this file between two chunks (it is never journaled)
                    raise Stopped(unit.name)
                data = job.fetch(name, offsets, shape)
                if not counted[0]:
                    counted[0] = True
                    job.on_bytes(data.numel() * data.element_size() if is_tensor(data) else as_bytes(data).nbytes)
                return data
            return load

        chunks = [WriteChunk(name, dtypes[name], offsets, shape, loader(name, offsets, shape), shapes[name])
                  for name, offsets, shape in unit.chunks]
        try:
            wf = writer.write_file(unit.name, chunks, writer=unit.writer)
        except BaseException:
            _discard(storage, unit.name)
            raise
        _, stamp = file_stamp(storage, unit.name)
        storage.put_atomic(journal_name(unit.name), journal_entry(wf, job.source_id, stamp))
        return wf

    written = dict(zip((u.name for u in todo), stoppable_map(one, todo, workers)))
    kept_bytes = sum(u.nbytes for u in units if u.name in kept)
    return [kept[u.name] if u.name in kept else written[u.name] for u in units], kept_bytes


def _discard(storage: Storage, name: str) -> None:
    """Remove the partial file a failed unit left (this run's own name: no user file is ever called so);
    a rerun would rewrite it anyway, and an empty or half file must not outlive the failure."""
    try:
        storage.delete([name])
    except ShardkitError as exc:
        log.debug("could not remove the partial %s: %s", storage.where(name), exc)


def chunk_cap_for(budget: int) -> int:
    """Output chunk size: 1/16 of the budget, between 1 MiB and the format's default cap."""
    return max(1 << 20, min(DEFAULT_CHUNK_BYTES, budget // 16))


def concurrency_for(budget: int, workers: int, reserved: int = 0, remote: bool = False, casts: bool = True) -> int:
    """Threads that may each hold a chunk's read buffer, the bytes it is read from and its cast (when
    ``casts``), plus the writer's per-thread buffer (the O_DIRECT staging buffer; on an object store
    the part being filled and the parts in flight), within the budget less ``reserved`` (the source's
    block cache)."""
    writer = (1 + UPLOAD_DEPTH) * PART_BYTES if remote else DIRECT_BUFFER_BYTES
    per_thread = (3 if casts else 2) * chunk_cap_for(budget) + writer
    return max(1, min(workers, (budget - reserved) // per_thread))


def upload_depth(threads: int, units: int, workers: int) -> int:
    """S3 parts in flight per file: the part buffers budgeted for ``threads`` writers shared by the files
    written at once (a single output file, ``convert --to shardkit``, keeps ``workers`` parts moving
    rather than one), never more than ``workers``."""
    running = max(1, min(threads, units))
    return max(UPLOAD_DEPTH, min(workers, threads * (1 + UPLOAD_DEPTH) // running - 1))


def _plan(job: WriteJob) -> tuple[list[FileUnit], dict[str, Any]]:
    mesh = job.mesh if job.mesh else (job.world_size,)
    shards = mesh[-1]
    # the plan (and so the file names a rerun resumes) must not depend on --workers: chunks are sized
    # from the budget alone, and write_resumable caps concurrency so in-flight chunks fit the budget
    chunk_cap = chunk_cap_for(job.budget)
    # with zstd a file's frames are built before its header: keep each file within the per-worker budget
    file_cap = chunk_cap if job.compression else FILE_CAP
    # ``replacing`` identifies the checkpoint an --overwrite replaces: the new files never take the names
    # of files it still references, and reruns of the interrupted replacement plan the same names.
    salt = json.dumps([job.source_id, job.replacing, job.compression, list(mesh), list(job.selection)], default=str)
    units = plan_files(job.stored, shards, chunk_cap, file_cap, salt)
    placements = ["Shard(dim=0)"] if len(mesh) == 1 else ["Replicate()", "Shard(dim=0)"]
    writer_info = {"world_size": job.world_size, "mesh": {"shape": list(mesh), "dim_names": [],
                                                          "placements": placements}, "tool": f"shardkit {job.tool}"}
    return units, writer_info


def commit_resumable(storage: Storage, job: WriteJob, files: Sequence[WrittenFile],
                     writer_info: dict[str, Any]) -> None:
    """Side files, then the manifest (the commit), then cleanup of the journal and stale files."""
    job.copy_side_files(f"{EXTRA_DIR}/")
    writer = NativeWriter(storage, compression=parse_compression(job.compression), fsync=storage.fsync_worthwhile)
    manifest = writer.build_manifest({name: (dtype, shape) for name, dtype, shape in job.stored}, files,
                                     values=dict(job.values), meta=dict(job.meta), writer_info=writer_info,
                                     aliases=dict(job.aliases))
    writer.commit(manifest, leftovers=[RESUME_DIR])


def write_resumable(storage: Storage, job: WriteJob, name: str) -> Written | None:
    """Write ``job`` as a native checkpoint for ``job.world_size`` ranks at ``storage`` (format ``name``).

    Resume keeps only files journaled under the same ``job.source_id``.
    ``job.replacing`` identifies the checkpoint already at ``storage`` that this
    one replaces: it stays untouched and loadable until the new manifest
    replaces its own in one atomic step.  ``job.tool`` ("reshard" or "convert")
    names the command in progress and in the manifest's ``writer.tool``.

    In a scale-out (``job.scaleout.nprocs > 1``) this process writes its share
    of the units; ``agree(ok)`` is a barrier that returns whether every process
    succeeded.  Process 0 then commits from the journaled records; the others
    return ``None``.
    """
    mesh, world_size = job.mesh, job.world_size
    rank, nprocs, agree = job.scaleout.rank, job.scaleout.nprocs, job.scaleout.agree
    if mesh is not None and len(mesh) == 2 and mesh[0] * mesh[1] != world_size:
        raise ConfigurationError(f"mesh {mesh} has {mesh[0] * mesh[1]} ranks, world size is {world_size}")
    units, writer_info = _plan(job)
    log.debug("%s plans %s (%d bytes) for %s at %s", job.tool, _count(len(units), "data file"),
              sum(u.nbytes for u in units), _count(world_size, "rank"), storage.url)
    mine = assign_units(units, nprocs)[rank] if nprocs > 1 else list(range(len(units)))
    if job.progress:
        target = _count(world_size, "rank") if job.tool == "reshard" else name
        job.progress.start(f"{job.tool} → {target}" if nprocs == 1 else f"{job.tool} [{rank}/{nprocs}]",
                           sum(units[i].nbytes for i in mine))
    try:
        threads = concurrency_for(job.budget, job.workers, getattr(job.fetch, "reserved_bytes", 0),
                                  storage.is_object_store, getattr(job.fetch, "casts", True))
        if storage.is_object_store and hasattr(storage.files, "upload_depth"):
            storage.files.upload_depth = upload_depth(threads, len(mine), job.workers)
        written, skipped = write_units(storage, job, [units[i] for i in mine], threads)
    except BaseException:
        if agree is not None:
            agree(False)
        raise
    if job.progress:
        job.progress.finish()
    if agree is not None:
        if not agree(True):
            raise CheckpointError(f"{storage.url}: another process failed; rerun the command to resume")
        if rank != 0:
            if not agree(True):
                raise CheckpointError(f"{storage.url}: process 0 could not commit; rerun the command to resume")
            return None
        try:
            written = []
            for unit in units:
                record = journaled_file(storage, unit.name, job.source_id, check_data=False)  # written by a peer
                if record is None:
                    raise CheckpointError(f"{storage.where(unit.name)}: no record of it; rerun to resume")
                written.append(record)
            commit_resumable(storage, job, written, writer_info)
        except BaseException:
            agree(False)
            raise
        agree(True)
    else:
        commit_resumable(storage, job, written, writer_info)
    return Written([u.name for u in units] + [MANIFEST_NAME], sum(u.nbytes for u in units),
                   sum(rec.nbytes for f in written for _, rec in f.chunks), skipped)
