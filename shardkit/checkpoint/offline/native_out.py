"""Offline writing of a native checkpoint laid out for N ranks: plan, stream, resume, commit.

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

Each work unit is written by the engine's :class:`NativeWriter` (streaming
safetensors, crc32c per block, optional zstd), pulling each chunk from the
source through a :class:`~shardkit.checkpoint.offline.fetch.Fetcher` just in
time, so memory is one chunk per worker.  Units run on ``workers`` threads.

Resume: the token is a hash of the plan and of the source's identity (its
canonical location and a fingerprint of its contents, see
:func:`~shardkit.checkpoint.offline.source.source_fingerprint`), so a rerun of
the same command on the same SRC plans the same file names.  After each unit,
its manifest records are journaled under ``.shardkit-resume/`` together with
that identity; a rerun keeps a journaled file only when the identity matches
and the file re-verifies (size, its header's crc32c and every checksum block).  When SRC changed in
between, the plan's names change and nothing old is kept: data written from an
older SRC can never end up in the new checkpoint.  The manifest is committed
last; the journal and any data files of older plans are removed after the commit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from shardkit.checkpoint.formats.base import CheckpointReader, WriteChunk
from shardkit.checkpoint.formats.compression import parse_compression
from shardkit.checkpoint.formats.dtypes import itemsize
from shardkit.checkpoint.formats.native.checksums import check_chunk
from shardkit.checkpoint.formats.native.handler import NATIVE
from shardkit.checkpoint.formats.native.headers import check_header
from shardkit.checkpoint.formats.native.ownership import EXTRA_DIR, RESUME_DIR
from shardkit.checkpoint.formats.native.writer import (
    DEFAULT_CHUNK_BYTES,
    NativeWriter,
    WrittenFile,
    data_file_name,
    group_into_files,
)
from shardkit.checkpoint.geometry.boxes import shard_range, split_box
from shardkit.checkpoint.io.direct_io import BUFFER_BYTES as DIRECT_BUFFER_BYTES
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.offline.fetch import Fetcher
from shardkit.checkpoint.offline.progress import Progress, human_count
from shardkit.checkpoint.offline.result import ConvertResult
from shardkit.checkpoint.offline.select import Selection
from shardkit.checkpoint.offline.side_files import copy_side_files
from shardkit.checkpoint.offline.stoppable import Stopped, stoppable_map
from shardkit.errors import CheckpointError, ConfigurationError, ShardkitError

__all__ = ["parse_mesh", "FileUnit", "plan_files", "write_native", "RESUME_DIR", "assign_units"]

log = logging.getLogger("shardkit.checkpoint.offline.convert")

FILE_CAP = 1 << 30


def parse_mesh(value: Any) -> tuple[int, ...]:
    """``"2x4"``, ``(2, 4)`` or ``8`` → a mesh shape of one or two positive sizes."""
    try:
        if isinstance(value, str):
            dims = tuple(int(x) for x in value.lower().split("x"))
        elif isinstance(value, int):
            dims = (value,)
        else:
            dims = tuple(int(x) for x in value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"--mesh {value!r}: write e.g. 8 or 2x4 (replicas x shards)") from None
    if not 1 <= len(dims) <= 2 or min(dims) < 1:
        raise ConfigurationError(f"--mesh {value!r}: one or two positive sizes, e.g. 8 or 2x4")
    return dims


@dataclass(frozen=True)
class FileUnit:
    """One output data file: who writes it (the target rank) and the chunks it holds, in order."""

    name: str
    writer: int
    chunks: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # (output name, offsets, shape)
    nbytes: int


@dataclass(frozen=True)
class _PlannedChunk:
    """One output chunk of the plan: tensor name, box, and bytes (what file packing weighs)."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int


def plan_files(sel: Selection, shards: int, chunk_cap: int, file_cap: int, salt: str) -> list[FileUnit]:
    """Work units for ``shards`` ranks; names carry a token derived from the whole plan."""
    per_rank: list[list[_PlannedChunk]] = [[] for _ in range(shards)]
    for t in sel.stored:  # aliases are written once, as the tensor they are tied to
        size = itemsize(t.dtype)
        if not t.shape:
            per_rank[0].append(_PlannedChunk(t.name, (), (), size))
            continue
        for s in range(shards):
            lo, hi = shard_range(t.shape[0], shards, s)
            if hi == lo and not (s == 0 and t.shape[0] == 0):
                continue
            box = ((lo,) + (0,) * (len(t.shape) - 1), (hi - lo,) + tuple(t.shape[1:]))
            for offsets, shape in split_box(box, size, chunk_cap):
                per_rank[s].append(_PlannedChunk(t.name, tuple(offsets), tuple(shape), math.prod(shape) * size))
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


def _journal_name(unit: FileUnit) -> str:
    return f"{RESUME_DIR}/{unit.name.rsplit('/', 1)[-1]}.json"


def _journal_entry(wf: WrittenFile, source_id: str) -> bytes:
    return json.dumps({"source": source_id, "file": wf.to_json()}).encode()


def _verified_record(storage: Storage, unit: FileUnit, source_id: str,
                     check_data: bool = True) -> WrittenFile | None:
    """The journaled record of ``unit`` if it was written from the same source (``source_id``) and
    its file is complete (and, with ``check_data``, its header and every checksum block match; a
    record without a header checksum, from an older shardkit, is not kept)."""
    journal = _journal_name(unit)
    if not storage.exists(journal):
        return None
    try:
        entry = json.loads(storage.read_bytes(journal))
        if entry.get("source") != source_id:
            return None
        wf = WrittenFile.from_json(entry["file"])
        if wf.name != unit.name or storage.size(unit.name) != wf.size:
            return None
        if check_data:
            if wf.header is None:  # journaled by an older shardkit: write the file again
                return None
            check_header(storage, wf.name, wf.size, wf.header, ())  # a damaged header raises: written again
            if any(check_chunk(storage, rec) is not None for _, rec in wf.chunks):
                return None
        return wf
    except (ShardkitError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_units(reader: CheckpointReader, sel: Selection, storage: Storage, units: Sequence[FileUnit], *,
                source_id: str, compression: str | None, workers: int,
                progress: Progress | None) -> tuple[list[WrittenFile], int]:
    """Write (or, when journaled and intact, keep) each unit; journal each one as it lands.

    Returns the records and the number of bytes kept from an earlier run.
    """
    fetch = Fetcher(reader, sel.dtype_for, sel.rename_back, reuse=True, scales=sel.scales)
    dtypes = sel.dtype_for
    shapes = {name: shape for name, _, shape in sel.triples}
    writer = NativeWriter(storage, compression=parse_compression(compression), fsync=storage.fsync_worthwhile)
    update: Callable[[int], None] = progress.update if progress else (lambda n: None)
    skipped = [0]
    lock = threading.Lock()

    def one(unit: FileUnit, stop: threading.Event) -> WrittenFile:
        if stop.is_set():
            raise Stopped(unit.name)
        kept = _verified_record(storage, unit, source_id)
        if kept is not None:
            with lock:
                skipped[0] += unit.nbytes
            if progress:
                progress.skip(unit.nbytes)
            return kept

        def loader(name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
            counted = [False]  # a retried write loads the chunk again: the progress counts it once

            def load() -> torch.Tensor:
                if stop.is_set():  # interrupted: abandon this file between two chunks (it is never journaled)
                    raise Stopped(unit.name)
                data = fetch(name, offsets, shape)
                if not counted[0]:
                    counted[0] = True
                    update(data.numel() * data.element_size())
                return data
            return load

        chunks = [WriteChunk(name, dtypes[name], offsets, shape, loader(name, offsets, shape), shapes[name])
                  for name, offsets, shape in unit.chunks]
        try:
            wf = writer.write_file(unit.name, chunks, writer=unit.writer)
        except BaseException:
            _discard(storage, unit.name)
            raise
        storage.put_atomic(_journal_name(unit), _journal_entry(wf, source_id))
        return wf

    return stoppable_map(one, list(units), workers), skipped[0]


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


def concurrency_for(budget: int, workers: int) -> int:
    """Threads that may each hold a chunk, its read buffer and its cast, plus the writer's
    per-thread O_DIRECT staging buffer, within the budget."""
    per_thread = 3 * chunk_cap_for(budget) + DIRECT_BUFFER_BYTES
    return max(1, min(workers, budget // per_thread))


def _plan(sel: Selection, world_size: int, mesh: tuple[int, ...] | None, compression: str | None, budget: int,
          source_id: str, replacing: str, tool: str) -> tuple[list[FileUnit], dict[str, Any]]:
    mesh = mesh if mesh else (world_size,)
    shards = mesh[-1]
    # the plan (and so the file names a rerun resumes) must not depend on --workers: chunks are sized
    # from the budget alone, and write_native caps concurrency so in-flight chunks fit the budget
    chunk_cap = chunk_cap_for(budget)
    # with zstd a file's frames are built before its header: keep each file within the per-worker budget
    file_cap = chunk_cap if compression else FILE_CAP
    # ``replacing`` identifies the checkpoint an --overwrite replaces: the new files never take the names
    # of files it still references, and reruns of the interrupted replacement plan the same names.
    salt = json.dumps([source_id, replacing, compression, list(mesh),
                       [[t.name, t.source, str(t.dtype), list(t.shape)] for t in sel.tensors]], default=str)
    units = plan_files(sel, shards, chunk_cap, file_cap, salt)
    placements = ["Shard(dim=0)"] if len(mesh) == 1 else ["Replicate()", "Shard(dim=0)"]
    writer_info = {"world_size": world_size, "mesh": {"shape": list(mesh), "dim_names": [],
                                                      "placements": placements}, "tool": f"shardkit {tool}"}
    return units, writer_info


def commit_native(reader: CheckpointReader, sel: Selection, storage: Storage, files: Sequence[WrittenFile],
                  writer_info: dict[str, Any], compression: str | None) -> None:
    """Side files, then the manifest (the commit), then cleanup of the journal and stale files."""
    copy_side_files(reader, storage, into=f"{EXTRA_DIR}/")
    writer = NativeWriter(storage, compression=parse_compression(compression), fsync=storage.fsync_worthwhile)
    meta = dict(reader.info.meta) if reader.info.format == NATIVE.name else {}
    manifest = writer.build_manifest({t.name: (t.dtype, t.shape) for t in sel.stored}, files,
                                     values=sel.values, meta=meta, writer_info=writer_info, aliases=sel.aliases)
    writer.commit(manifest, leftovers=[RESUME_DIR])


def write_native(reader: CheckpointReader, sel: Selection, storage: Storage, *, world_size: int,
                 mesh: tuple[int, ...] | None, compression: str | None, budget: int, workers: int,
                 progress: Progress | None, source_id: str, rank: int = 0, nprocs: int = 1,
                 agree: Callable[[bool], bool] | None = None, replacing: str = "", tool: str = "reshard") -> Any:
    """Write ``sel`` from ``reader`` as a native checkpoint for ``world_size`` ranks at ``storage``.

    ``source_id`` names the source's location and contents (see
    :func:`~shardkit.checkpoint.offline.source.source_fingerprint`); resume keeps
    only files journaled under the same id.  ``replacing`` identifies the
    checkpoint already at ``storage`` that this one replaces (see
    :func:`~shardkit.checkpoint.offline.replace.prepare_dst`): it stays untouched and
    loadable until the new manifest replaces its own in one atomic step.
    ``tool`` ("reshard" or "convert") names the command in progress and in the
    manifest's ``writer.tool``.

    With ``nprocs > 1`` (scale-out) this process writes its share of the units;
    ``agree(ok)`` is a barrier that returns whether every process succeeded.
    Process 0 then commits from the journaled records; the others return ``None``.
    """
    if mesh is not None and len(mesh) == 2 and mesh[0] * mesh[1] != world_size:
        raise ConfigurationError(f"mesh {mesh} has {mesh[0] * mesh[1]} ranks, world size is {world_size}")
    units, writer_info = _plan(sel, world_size, mesh, compression, budget, source_id, replacing, tool)
    log.debug("%s plans %s (%d bytes) for %s at %s", tool, human_count(len(units), "data file"),
              sum(u.nbytes for u in units), human_count(world_size, "rank"), storage.url)
    mine = assign_units(units, nprocs)[rank] if nprocs > 1 else list(range(len(units)))
    if progress:
        target = human_count(world_size, "rank") if tool == "reshard" else "shardkit"
        progress.start(f"{tool} → {target}" if nprocs == 1 else f"{tool} [{rank}/{nprocs}]",
                       sum(units[i].nbytes for i in mine))
    try:
        written, skipped = write_units(reader, sel, storage, [units[i] for i in mine], source_id=source_id,
                                       compression=compression,
                                       workers=concurrency_for(budget, workers), progress=progress)
    except BaseException:
        if agree is not None:
            agree(False)
        raise
    if progress:
        progress.finish()
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
                record = _verified_record(storage, unit, source_id, check_data=False)  # just written by a peer
                if record is None:
                    raise CheckpointError(f"{storage.where(unit.name)}: no record of it; rerun to resume")
                written.append(record)
            commit_native(reader, sel, storage, written, writer_info, compression)
        except BaseException:
            agree(False)
            raise
        agree(True)
    else:
        commit_native(reader, sel, storage, written, writer_info, compression)
    return ConvertResult(reader.info.format, "shardkit", storage.url, len(sel.tensors),
                         sum(u.nbytes for u in units), [u.name for u in units] + ["manifest.json"], sel.dropped,
                         skipped, sum(rec.nbytes for f in written for _, rec in f.chunks))
