"""``save``: write a state dict as a native checkpoint (collective when a process group exists;
plain in one process).

1. Flatten the state dict; every rank plans the chunks *it* writes (:mod:`~.save_planning`).  A rank
   holds each tensor as one or more boxes of the global tensor
   (:func:`~shardkit.checkpoint.geometry.placements.local_pieces`: any mesh,
   ``Shard``, ``_StridedShard``, ``Replicate``); the ranks exchange their boxes
   and the lowest rank holding a box writes it (:func:`~.writer_assignment.assign_writers`), so
   every stored element is written exactly once -- replicas on a mesh dim of
   the tensor's own mesh (HSDP), ranks outside that mesh holding the same data
   (a tensor FSDP shards over the dp sub-mesh, copied on every tp rank) and
   plain tensors alike.  Boxes are split at ``chunk_bytes``.  A key whose
   tensor is the same tensor as an earlier key's (tied weights) is written
   once, under the earlier key, and recorded as an alias.
2. Each rank streams its chunks into its own data files, in parallel threads,
   straight from the tensors' memory (``async_save``: from a reused staging
   copy), computing crc32c per block on the way; files are fsynced.
3. Rank 0 commits (:mod:`~.save_commit`): a small save's chunk records are
   gathered to it (JSON, no pickle) into one manifest; a large one's writers
   each write their own index file and send rank 0 only a summary (version 3).
   Rank 0 validates the manifest as a reader would and commits it atomically.
   Files of older saves at the same URL are removed only after that.  Every
   rank learns the outcome, so a failure anywhere raises everywhere and
   nothing hangs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.dtypes import dtype_to_code
from shardkit.checkpoint.formats.native import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_BYTES,
    NativeWriter,
    WrittenFile,
    data_file_name,
    is_committed,
    is_indexed,
    new_token,
)
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS, parallel_map
from shardkit.checkpoint.io.deadline import deadline_for, with_step
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.retries import with_retries
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.dcp_stateful import stateful_to_state_dict
from shardkit.checkpoint.training.checkpoint_id import checkpoint_url
from shardkit.checkpoint.training.dedup import deduplicate, digest_algorithm, with_digests
from shardkit.checkpoint.training.rank_report import FilesReport, RankReport, SummaryReport, report_from_json
from shardkit.checkpoint.training.save_commit import commit_gathered, state_digest, summary_of
from shardkit.checkpoint.training.save_options import SaveOptions
from shardkit.checkpoint.training.save_plan import SavePlan
from shardkit.checkpoint.training.save_planning import plan_save
from shardkit.errors import CheckpointExists, ShardkitError, error_record, from_record

log = logging.getLogger(__name__)

__all__ = ["save", "SavePlan", "SaveOptions", "write_and_commit", "RelayedFile"]


FileJobs = list[tuple[str, list[WriteChunk]]]


@dataclass(frozen=True)
class RelayedFile:
    """A data file another process wrote (the ``async_save`` writer process), as the JSON record it sent.

    Why not a :class:`WrittenFile`: decoding every chunk's record (its crc32c list from base64) only to
    encode it again into this rank's report held the GIL of the training process, whose training thread
    waits for it.  The record goes on as it came; rank 0's commit decodes and validates every rank's
    records as it does those of a synchronous save, and :meth:`decoded` gives them where they are used here
    (digests, index files)."""

    name: str
    size: int
    fqns: tuple[str, ...]  # the key of each chunk it holds, in order
    doc: Mapping[str, Any]

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> "RelayedFile":
        return cls(doc["name"], int(doc["size"]), tuple(fqn for fqn, _ in doc["chunks"]), doc)

    def to_json(self) -> Mapping[str, Any]:
        return self.doc

    def decoded(self) -> WrittenFile:
        return WrittenFile.from_json(self.doc)


def _decoded(files: Sequence[WrittenFile | RelayedFile]) -> list[WrittenFile]:
    return [f.decoded() if isinstance(f, RelayedFile) else f for f in files]


def _fqns(file: WrittenFile | RelayedFile) -> Sequence[str]:
    return file.fqns if isinstance(file, RelayedFile) else [fqn for fqn, _ in file.chunks]


# rank 0's commit made elsewhere (the ``async_save`` writer process): every rank's report as the JSON it
# travelled in, and rank 0's plan -> the error record every rank raises, or None once committed
CommitReports = Callable[[list[bytes], SavePlan], "dict[str, str] | None"]


def write_and_commit(storage: Storage, plan: SavePlan | None, local_error: BaseException | None, dist: Dist,
                     options: SaveOptions,
                     write_files: Callable[[FileJobs], Sequence[WrittenFile | RelayedFile]] | None = None,
                     commit_reports: CommitReports | None = None) -> None:
    """Steps 2 and 3 of a save (shared by ``save`` and the background writer of ``async_save``).

    ``write_files`` writes ``[(file name, chunks), ...]`` and returns the files' records (the
    ``async_save`` writer process: :class:`RelayedFile`); by default this process writes them, one I/O thread
    per file.
    ``commit_reports``: rank 0 hands a small save's reports, undecoded, to it rather than committing here.
    ``options.digests``/``options.reuse_from``: see :mod:`~shardkit.checkpoint.training.dedup`.
    """
    digests, reuse_from, io_threads = options.digests, options.reuse_from, options.io_threads
    writer = NativeWriter(storage, compression=options.compression, block_bytes=options.block_bytes,
                          fsync=options.fsync, direct_io=options.direct_io, column_strips=options.column_strips)
    files: list[WrittenFile | RelayedFile] = []
    jobs: list[tuple[str, Any]] = []
    reused: list[WrittenFile] = []
    started = time.perf_counter()
    if local_error is None and plan is not None:
        try:
            token = new_token()
            groups = plan.groups
            if digests or reuse_from is not None:
                found = deduplicate(groups, storage, reuse_from, dist.rank, io_threads,
                                    digest_algorithm(digests or True))
                groups, reused = found.groups, found.reused
            jobs = [(data_file_name(token, dist.rank, i), g) for i, g in enumerate(groups)]
            if write_files is not None:
                files = list(write_files(jobs))
            else:
                files = parallel_map(lambda job: writer.write_file(job[0], job[1], dist.rank), jobs, io_threads)
            if digests or reuse_from is not None:
                files = list(with_digests(_decoded(files), found.digests))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = exc
    if local_error is None:
        log.info("rank %d wrote %d files (%d bytes) to %s in %.2f s%s", dist.rank, len(files),
                 sum(f.size for f in files), storage.url, time.perf_counter() - started,
                 f", and referenced {sum(len(f.chunks) for f in reused)} unchanged chunks" if reused else "")
    mine: list[WrittenFile | RelayedFile] = files + reused
    counts: list[Any] = []
    dist.phase = "write"  # the ranks meet once every one of them has written its files
    if dist.agreed_most is None or is_indexed(dist.agreed_most * dist.group_size):
        counts = dist.all_gather_json(sum(len(_fqns(f)) for f in mine) if local_error is None else None)
        dist.phase = "commit"
    # else planning agreed the most chunks any rank writes, too few for index files: no rank asks, and the
    # ranks first meet in the gather of their reports
    new_names = [f.name for f in files] + ([name for name, _ in jobs] if local_error is not None else [])
    error = None if local_error is None else error_record(local_error)
    report: RankReport
    if counts and None not in counts and is_indexed(sum(counts)):  # every rank decides alike
        report = SummaryReport(error=error)
        if local_error is None and plan is not None:
            try:
                summary, written = summary_of(storage, plan, dist.rank, token, _decoded(mine))
                new_names += written
                report = SummaryReport(summary, state_digest(plan), plan.aliases)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                local_error = exc
                report = SummaryReport(error=error_record(exc))
    else:  # a relayed record goes in as it came: the report only encodes its files
        chunked = {fqn for f in files for fqn in _fqns(f)}
        report = FilesReport(tuple(mine), {k: (dtype_to_code(d), tuple(s)) for k, (d, s)
                                           in (plan.tensors.items() if plan else ()) if k in chunked},
                             plan.aliases if plan else {}, error)
    elsewhere = commit_reports is not None and plan is not None and isinstance(report, FilesReport)
    gathered = dist.gather_json(report.to_json(), encoded=elsewhere)
    dist.phase = "commit"
    commit_error = None
    if gathered is not None and elsewhere:
        assert commit_reports is not None and plan is not None
        commit_error = commit_reports(gathered, plan)
    elif gathered is not None:
        commit_error = commit_gathered(storage, writer, plan, [report_from_json(g) for g in gathered],
                                       dist.world_size, options.meta, options.overwrite)
    commit_error = dist.broadcast_json(commit_error)
    if commit_error is not None or local_error is not None:
        try:  # nothing will reference this rank's new files: remove them (never anything older)
            storage.delete(new_names)
        except ShardkitError:
            pass
    if local_error is not None:
        raise local_error
    if commit_error is not None:
        raise from_record(commit_error)


def save(state_dict: dict[str, Any], url: str | None = None, *, checkpoint_id: str | os.PathLike | None = None,
         compression: Any = None,
         storage_options: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
         overwrite: bool = True, fsync: bool = True, direct_io: bool = True,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES, block_bytes: int = DEFAULT_BLOCK_BYTES,
         io_threads: int = DEFAULT_IO_THREADS, process_group: Any = None, only: Sequence[str] | None = None,
         exclude: Sequence[str] | None = None, column_strips: str = "cut", digests: bool | str = False,
         reuse_from: str | None = None, timeout: float | timedelta | None = None,
         retries: int | None = None) -> None:
    """Save ``state_dict`` as a native checkpoint at ``url`` (collective when a process group exists).

    ``checkpoint_id``: DCP's keyword for ``url`` (give one of them), so
    ``dcp.save(state_dict, checkpoint_id=path)`` runs with the import swapped;
    a top-level value that is torch's ``Stateful`` (DCP's ``AppState``, a module)
    is saved as its ``state_dict()``, as DCP saves it (:mod:`~shardkit.checkpoint.state.dcp_stateful`).

    ``only``/``exclude``: globs over the flattened keys (``model.*lora*``,
    ``optim.*``) choosing what is saved, e.g. a fine-tune's adapters alone
    (see also ``get_training_state(..., trainable_only=True)``).

    ``compression``: ``None``, ``"zstd"`` or ``"zstd:LEVEL"`` (per chunk).
    ``meta``: JSON metadata stored in the manifest (e.g. ``{"step": 100}``).
    ``overwrite=False`` refuses a URL that already holds a committed checkpoint;
    with ``True`` the old checkpoint stays intact until the new one commits.
    ``fsync`` makes data durable before the manifest commits it (as DCP does).
    ``direct_io`` writes local data files with ``O_DIRECT``: no page-cache pages
    to allocate and no second copy of the checkpoint in memory, at the price of
    a load right after the save reading from the disk instead of the cache.
    ``column_strips`` (``"cut"``, ``"all"``, ``"off"``): which matrix chunks are
    stored as column strips, so that a load cutting their columns reads only
    what it needs -- by default those whose columns this layout cut (tensor
    parallelism's ``Shard(1)``); ``"all"`` for a checkpoint of whole rows that
    will be loaded under tensor parallelism (docs/format.md).
    ``digests`` stores every chunk's digest (``True``: xxh3-128, or ``"sha256"``); ``reuse_from`` (an earlier
    committed checkpoint in the same directory) references its chunks that are unchanged instead of writing them
    again (what ``CheckpointManager(dedup=True)`` does; see ``dedup.py``).
    ``timeout`` (seconds or a ``timedelta``; default ``SHARDKIT_CHECKPOINT_TIMEOUT``, else 600 s): how long a
    rank waits at one of the save's collectives (plan, write, commit) for the others; a rank that died, froze
    or never called fails them with :class:`~shardkit.errors.CheckpointTimeout` naming it, and nothing is
    committed (:mod:`~shardkit.checkpoint.io.deadline`).
    ``retries``: how often a failed storage request is retried (``storage_options={"shardkit": {"retries":
    N}}``, which it sets; see :func:`~shardkit.checkpoint.io.retries.with_retries`).
    """
    url = checkpoint_url(url, checkpoint_id, "save")
    storage_options = with_retries(storage_options, retries)
    options = SaveOptions.checked(compression=compression, meta=meta, overwrite=overwrite, fsync=fsync,
                                  direct_io=direct_io, chunk_bytes=chunk_bytes, block_bytes=block_bytes,
                                  io_threads=io_threads, column_strips=column_strips, digests=digests,
                                  reuse_from=reuse_from, only=only, exclude=exclude)
    dist = Dist(process_group, with_step(deadline_for("save", url, timeout), options.meta))
    storage = Storage(url, storage_options)
    plan, error = None, None
    try:
        plan = plan_save(stateful_to_state_dict(state_dict), dist, chunk_bytes=options.chunk_bytes,
                         io_threads=options.io_threads, compression=options.compression, keys=options.keys)
        if not overwrite and is_committed(storage):
            raise CheckpointExists(f"{url} already holds a committed checkpoint; pass overwrite=True or pick a new URL")
        log.debug("rank %d plans %d data files (%d chunks) for %s", dist.rank, len(plan.groups),
                  sum(len(g) for g in plan.groups), url)
        storage.makedirs()
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the collective
        error = exc
    write_and_commit(storage, plan, error, dist, options)
