"""``save``: write a state dict as a native checkpoint (collective when a process group exists;
plain in one process).

1. Flatten the state dict; every rank plans the chunks *it* writes.  A rank
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

import collections
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import (
    WriteChunk,
)
from shardkit.checkpoint.formats.compression import Compression
from shardkit.checkpoint.formats.dtypes import dtype_to_code
from shardkit.checkpoint.formats.native import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_BYTES,
    NativeWriter,
    WrittenFile,
    data_file_name,
    group_into_files,
    is_committed,
    is_indexed,
    new_token,
)
from shardkit.checkpoint.geometry.boxes import Box, box_numel, is_dtensor, local_tensor, split_box
from shardkit.checkpoint.geometry.placements import local_pieces, lowest_replica
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS, parallel_map
from shardkit.checkpoint.io.deadline import deadline_for, with_step
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage, with_retries
from shardkit.checkpoint.state.aliases import find_aliases
from shardkit.checkpoint.state.dcp_stateful import stateful_to_state_dict
from shardkit.checkpoint.state.tree import (
    flatten,
    keep_keys,
)
from shardkit.checkpoint.training.checkpoint_id import checkpoint_url
from shardkit.checkpoint.training.dedup import deduplicate, digest_algorithm, with_digests
from shardkit.checkpoint.training.rank_report import FilesReport, RankReport, SummaryReport, report_from_json
from shardkit.checkpoint.training.save_commit import commit_gathered, state_digest, summary_of
from shardkit.checkpoint.training.save_options import SaveOptions
from shardkit.checkpoint.training.save_plan import SavePlan, layouts_of
from shardkit.checkpoint.training.writer_assignment import WriterAssignments, writer_assignments
from shardkit.errors import (
    CheckpointError,
    CheckpointExists,
    ShardkitError,
    UnsupportedFormat,
    error_record,
    from_record,
)
from shardkit.held_groups import GroupRef

log = logging.getLogger(__name__)

__all__ = ["save", "SavePlan", "SaveOptions", "plan_save", "write_and_commit", "structure_of", "check_storable"]


class _LastPlan:
    """What planning derived from the structures of the last few saves, kept per process group.

    Everything :func:`plan_save` works out per tensor (pieces, replicas, tied
    keys, layouts, chunk boxes) depends only on the tensors' keys, shapes,
    dtypes, placements and memory addresses.  When those are what they were
    at one of the last saves, it is reused and only the views into the current
    tensors are made again.  No tensor is referenced, so nothing is kept alive
    (nor the group: see :mod:`shardkit.held_groups`).
    """

    KEPT = 4  # structures remembered per group: a job may alternate a few (the training state, an export)

    def __init__(self) -> None:
        self._groups: dict[int, tuple[GroupRef, list[tuple[tuple, dict[str, Any]]]]] = {}

    def get(self, dist: Dist, signature: tuple) -> dict[str, Any] | None:
        found = self._groups.get(id(dist.group))
        if found is None or not found[0].refers_to(dist.group):
            return None
        return next((derived for kept, derived in reversed(found[1]) if kept == signature), None)

    def put(self, dist: Dist, signature: tuple, derived: dict[str, Any]) -> None:
        found = self._groups.get(id(dist.group))
        kept = found[1] if found is not None and found[0].refers_to(dist.group) else []
        self._groups[id(dist.group)] = (GroupRef(dist.group), (kept + [(signature, derived)])[-self.KEPT:])


_last_plans = _LastPlan()


def structure_of(flat_tensors: Mapping[str, torch.Tensor], options: tuple) -> tuple[tuple, dict[str, torch.Tensor]]:
    """What planning a save depends on -- every tensor's key, dtype, shape, placements, mesh and local
    shape, strides and address, plus ``options`` -- as one comparable tuple; and each key's local tensor.

    Called on every save of a training run, so it reads as little as it can: a DTensor's spec (global
    dtype, shape, placements and mesh in one object, usually the very object of the last save, so
    comparing is an identity check) and its local tensor's geometry.  A plain tensor's address counts only
    where its storage is another key's too (it could be tied to it): a training state's RNG states and step
    counts are new tensors at every save, and would otherwise make every save plan afresh.
    """
    api = sys.modules.get("torch.distributed.tensor._api")
    dtensor = api.DTensor if api is not None else ()
    parts: list[tuple] = [options]
    locals_: dict[str, torch.Tensor] = {}
    plain: list[int] = []  # where in ``parts`` a plain tensor is, its address left out for now
    for key, tensor in flat_tensors.items():
        if isinstance(tensor, dtensor):
            spec = tensor._spec
            local = local_tensor(tensor)
            described = spec if spec.tensor_meta is not None else (spec, tensor.dtype, tensor.shape)
            parts.append((key, described, local.shape, local.stride(), local.data_ptr()))
        else:
            local = tensor
            plain.append(len(parts))
            parts.append((key, type(tensor), tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset()))
        locals_[key] = local
    if plain:
        storages = collections.Counter(_storage_address(t) for t in locals_.values())
        for at in plain:
            local = locals_[parts[at][0]]
            address = _storage_address(local)
            if address is None or storages[address] > 1:
                parts[at] += (id(local) if address is None else local.data_ptr(),)
    return tuple(parts), locals_


def _storage_address(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s storage is; ``None`` for a wrapper subclass that has none (planning refuses it)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _derive(flat_tensors: Mapping[str, torch.Tensor], dist: Dist) -> dict[str, Any]:
    """Per-tensor planning: global dtype/shape of each key written, the boxes this rank holds (and where
    they are in its local tensors), tied keys and layouts."""
    aliases = find_aliases(flat_tensors)
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    held: dict[str, list[Box]] = {}
    local_boxes: dict[tuple[str, Box], Box] = {}
    for key, tensor in flat_tensors.items():
        check_storable(key, tensor)  # unsupported dtypes and tensor subclasses fail here, before anything is written
        if key in aliases:
            continue
        tensors[key] = (tensor.dtype, tuple(tensor.shape))
        pieces = local_pieces(tensor, key)
        if not pieces or not lowest_replica(tensor) or (not is_dtensor(tensor) and dist.group_rank != 0):
            continue  # a plain tensor is every rank's: rank 0 writes it without asking the others
        for global_box, local_box in pieces:
            if box_numel(global_box):
                held.setdefault(key, []).append(global_box)
                local_boxes[(key, global_box)] = local_box
    layouts = layouts_of(flat_tensors)
    coords = [flat_tensors[layout["tensors"][0]].device_mesh.get_coordinate() for layout in layouts]
    return {"aliases": aliases, "tensors": tensors, "held": held, "local_boxes": local_boxes,
            "layouts": layouts, "coords": [None if c is None else tuple(c) for c in coords],
            "held_signature": WriterAssignments.signature(dist, held), "chunks": None}


def check_storable(key: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor the native format cannot hold: a dtype without a code, or a tensor subclass that
    dispatches its own operations (torchao's float8 weights, NF4, any wrapper subclass) -- its bytes are
    not the values it stands for, and saving them would load back wrong, so it is named instead."""
    dtype_to_code(tensor.dtype)
    local = local_tensor(tensor)
    if getattr(type(local), "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None):
        raise UnsupportedFormat(f"{key!r} is a {type(local).__module__}.{type(local).__qualname__}, a tensor "
                                f"subclass whose stored bytes are not its values; save a plain tensor of what it "
                                f"holds instead (e.g. its dequantized or high-precision form)")


def _chunk_boxes(derived: dict[str, Any], writes: Mapping[str, Sequence[Box]], chunk_bytes: int
                 ) -> list[tuple[str, Box, tuple[slice, ...]]]:
    """``(key, chunk box, index into the local tensor)`` of every chunk this rank writes (kept in
    ``derived`` for the next save with the same ``writes``)."""
    cached = derived["chunks"]
    if cached is not None and cached[0] == (writes, chunk_bytes):
        return cached[1]
    out = []
    for key, boxes in writes.items():
        itemsize = derived["tensors"][key][0].itemsize
        for box in boxes:
            local_box = derived["local_boxes"][(key, box)]
            for sub in split_box(box, itemsize, chunk_bytes):
                out.append((key, sub, tuple(slice(lo + o - bo, lo + o - bo + n) for lo, o, bo, n
                                            in zip(local_box[0], sub[0], box[0], sub[1]))))
    derived["chunks"] = ((writes, chunk_bytes), out)
    return out


def plan_save(state_dict: Mapping[str, Any], dist: Dist, *, chunk_bytes: int, io_threads: int,
              compression: Compression | None,
              keys: tuple[Sequence[str] | None, Sequence[str] | None] = (None, None)) -> SavePlan:
    """Chunks this rank writes (each stored box by one rank, tied tensors once), grouped into files balanced
    by bytes.  ``keys`` = (only, exclude) globs choose the keys saved.  Collective
    (:func:`~.writer_assignment.assign_writers`, reused across saves of the same structure by
    :class:`~.writer_assignment.WriterAssignments`):
    every rank reaches the exchange even when its own planning failed, and raises that failure after it.
    A save of the structure the last one had reuses its per-tensor planning (:class:`_LastPlan`)."""
    derived: dict[str, Any] | None = None
    error: BaseException | None = None
    try:
        flat = keep_keys(flatten(state_dict), *keys)
        signature = structure_of(flat.tensors, (dist.group_rank, dist.group_size))[0]
        derived = _last_plans.get(dist, signature)
        if derived is None:
            derived = _derive(flat.tensors, dist)
            _last_plans.put(dist, signature, derived)
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the exchange
        error, derived = exc, None
    writes = writer_assignments.assign(dist, None if derived is None else derived["held"],
                                       None if derived is None else derived["held_signature"],
                                       lambda writes: len(_chunk_boxes(derived, writes, chunk_bytes)))
    if error is not None or derived is None:
        raise error or CheckpointError("save planning failed")
    tensors = derived["tensors"]
    locals_ = {key: local_tensor(flat.tensors[key]).detach() for key in writes}
    chunks = [WriteChunk(key, tensors[key][0], sub[0], sub[1], locals_[key][index], tensors[key][1])
              for key, sub, index in _chunk_boxes(derived, writes, chunk_bytes)]
    return SavePlan(group_into_files(chunks, files_for(sum(c.nbytes for c in chunks), io_threads),
                                     chunk_bytes if compression else None),
                    tensors, flat.values, derived["layouts"], derived["aliases"], writes, derived["coords"])


# Each data file a rank writes costs its own create, fsync and hand-off to an I/O thread (a few ms on a busy
# machine); a second thread pays that back only with this much to write, so a small state goes into fewer
# files than there are I/O threads (one below twice this), a large one into one per thread.
PARALLEL_FILE_BYTES = 8 << 20


def files_for(nbytes: int, io_threads: int) -> int:
    """How many data files a rank writes ``nbytes`` into: one per I/O thread, at least
    :data:`PARALLEL_FILE_BYTES` each."""
    return max(1, min(io_threads, nbytes // PARALLEL_FILE_BYTES))


FileJobs = list[tuple[str, list[WriteChunk]]]


# rank 0's commit made elsewhere (the ``async_save`` writer process): every rank's report as the JSON it
# travelled in, and rank 0's plan -> the error record every rank raises, or None once committed
CommitReports = Callable[[list[bytes], SavePlan], "dict[str, str] | None"]


def write_and_commit(storage: Storage, plan: SavePlan | None, local_error: BaseException | None, dist: Dist,
                     options: SaveOptions, write_files: Callable[[FileJobs], list[WrittenFile]] | None = None,
                     commit_reports: CommitReports | None = None) -> None:
    """Steps 2 and 3 of a save (shared by ``save`` and the background writer of ``async_save``).

    ``write_files`` writes ``[(file name, chunks), ...]`` and returns the files' records (the
    ``async_save`` writer process); by default this process writes them, one I/O thread per file.
    ``commit_reports``: rank 0 hands a small save's reports, undecoded, to it rather than committing here.
    ``options.digests``/``options.reuse_from``: see :mod:`~shardkit.checkpoint.training.dedup`.
    """
    digests, reuse_from, io_threads = options.digests, options.reuse_from, options.io_threads
    writer = NativeWriter(storage, compression=options.compression, block_bytes=options.block_bytes,
                          fsync=options.fsync, direct_io=options.direct_io, column_strips=options.column_strips)
    files: list[WrittenFile] = []
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
                files = write_files(jobs)
            else:
                files = parallel_map(lambda job: writer.write_file(job[0], job[1], dist.rank), jobs, io_threads)
            if digests or reuse_from is not None:
                files = with_digests(files, found.digests)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = exc
    if local_error is None:
        log.info("rank %d wrote %d files (%d bytes) to %s in %.2f s%s", dist.rank, len(files),
                 sum(f.size for f in files), storage.url, time.perf_counter() - started,
                 f", and referenced {sum(len(f.chunks) for f in reused)} unchanged chunks" if reused else "")
    mine = files + reused
    counts: list[Any] = []
    dist.phase = "write"  # the ranks meet once every one of them has written its files
    if dist.agreed_most is None or is_indexed(dist.agreed_most * dist.group_size):
        counts = dist.all_gather_json(sum(len(f.chunks) for f in mine) if local_error is None else None)
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
                summary, written = summary_of(storage, plan, dist.rank, token, mine)
                new_names += written
                report = SummaryReport(summary, state_digest(plan), plan.aliases)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                local_error = exc
                report = SummaryReport(error=error_record(exc))
    else:
        chunked = {fqn for f in files for fqn, _ in f.chunks}
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
    N}}``, which it sets; see :func:`~shardkit.checkpoint.io.storage.with_retries`).
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
