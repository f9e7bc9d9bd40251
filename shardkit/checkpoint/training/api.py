"""``save``, ``async_save`` and ``load``: the in-training entry points.

Save (collective when a process group exists; plain in one process):

1. Flatten the state dict; every rank plans the chunks *it* writes -- the boxes
   of its local shards for which it is the lowest rank holding them (so HSDP
   replicas and plain tensors are written once), split at ``chunk_bytes``.
   A key whose tensor is the same tensor as an earlier key's (tied weights)
   is written once, under the earlier key, and recorded as an alias.
2. Each rank streams its chunks into its own data files, in parallel threads,
   straight from the tensors' memory (``async_save``: from a reused staging
   copy), computing crc32c per block on the way; files are fsynced.
3. Rank 0 gathers the chunk records (JSON, no pickle), validates the whole
   manifest as a reader would and commits it atomically.  Files of older saves
   at the same URL are removed only after that.  Every rank learns the outcome,
   so a failure anywhere raises everywhere and nothing hangs.

Load (each rank independently reads what it needs; collectives only to agree
on the outcome):

1. Read and validate the manifest; match keys, dtypes and global shapes of the
   target (``strict``: missing or unexpected keys raise; a key of a tied
   target is present when a key it is tied to is, and only one of them is
   read); plan, for every local shard of the target, the pieces of stored
   chunks it needs and check every data file it will touch has the recorded
   size.  Ranks agree all is well *before any target tensor is written*.
2. Check the data before writing any of it (the default, see
   :func:`check_before_writing`): every checksum block the load needs is read
   and verified -- or, for a small load from remote storage, fetched once into
   staging -- and the ranks agree again.
3. Read in place: contiguous runs go straight into the target's memory; every
   byte read is verified against its checksum block.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats import open_reader
from shardkit.checkpoint.formats.base import (
    CheckpointReader,
    ReadRequest,
    WriteChunk,
    plan_reads,
)
from shardkit.checkpoint.formats.codec import (
    Compression,
    dtype_to_code,
    parse_compression,
)
from shardkit.checkpoint.formats.native.reader import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_BYTES,
    NativeReader,
    NativeWriter,
    WrittenFile,
    data_file_name,
    is_committed,
    new_token,
    unreferenced_files,
)
from shardkit.checkpoint.formats.native.writer import group_into_files
from shardkit.checkpoint.geometry.boxes import (
    is_primary_replica,
    local_box,
    local_tensor,
    mesh_description,
    split_box,
)
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS, parallel_map
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.aliases import alias_groups, find_aliases
from shardkit.checkpoint.state.tree import (
    Flat,
    check_value_kind,
    flatten,
    from_json_value,
    to_json_value,
)
from shardkit.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    ConfigurationError,
    IncompatibleStateDict,
    ShardkitError,
)

log = logging.getLogger("shardkit.checkpoint.training.api")

__all__ = ["save", "async_save", "load", "check_before_writing", "SavePlan", "plan_save", "write_and_commit"]

STAGE_BYTES = 64 << 20  # a load needing at most this much from remote storage is fetched once, into staging


class SavePlan:
    """What one rank writes: its chunks grouped into files, and the tensors' global metadata."""

    def __init__(self, groups: list[list[WriteChunk]], tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 values: dict[str, Any], mesh: dict[str, Any] | None, aliases: dict[str, str] | None = None) -> None:
        self.groups = groups
        self.tensors = tensors
        self.values = values
        self.mesh = mesh
        self.aliases = aliases or {}  # tied key -> the key its data is written under

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for g in self.groups for c in g)


def _chunk_view(local: torch.Tensor, box_offsets: Sequence[int], sub: tuple[tuple[int, ...], tuple[int, ...]]):
    index = tuple(slice(o - bo, o - bo + s) for o, bo, s in zip(sub[0], box_offsets, sub[1]))
    view = local[index]
    if view.device.type != "cpu":
        return lambda: view.to("cpu")
    if not view.is_contiguous():
        return lambda: view.contiguous()
    return view


def plan_save(flat: Flat, rank: int, *, chunk_bytes: int, io_threads: int,
              compression: Compression | None) -> SavePlan:
    """Chunks this rank writes (primary replicas only, tied tensors once), grouped into files balanced by bytes."""
    chunks: list[WriteChunk] = []
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    mesh = None
    aliases = find_aliases(flat.tensors)
    for key, tensor in flat.tensors.items():
        dtype_to_code(tensor.dtype)  # unsupported dtypes fail here, before anything is written
        if key in aliases:
            continue
        tensors[key] = (tensor.dtype, tuple(tensor.shape))
        mesh = mesh or mesh_description(tensor)
        box = local_box(tensor, key)
        if box is None or math.prod(box[1]) == 0 or not is_primary_replica(tensor, rank):
            continue
        local = local_tensor(tensor).detach()
        for sub in split_box(box, tensor.element_size(), chunk_bytes):
            chunks.append(WriteChunk(key, tensor.dtype, sub[0], sub[1], _chunk_view(local, box[0], sub)))
    return SavePlan(group_into_files(chunks, io_threads, chunk_bytes if compression else None),
                    tensors, flat.values, mesh, aliases)


def write_and_commit(storage: Storage, plan: SavePlan | None, local_error: BaseException | None, dist: Dist, *,
                     compression: Compression | None, block_bytes: int, fsync: bool, io_threads: int,
                     meta: Mapping[str, Any] | None, overwrite: bool, direct_io: bool = True) -> None:
    """Steps 2 and 3 of a save (shared by ``save`` and the background writer of ``async_save``)."""
    writer = NativeWriter(storage, compression=compression, block_bytes=block_bytes, fsync=fsync,
                          direct_io=direct_io)
    files: list[WrittenFile] = []
    started = time.perf_counter()
    if local_error is None and plan is not None:
        try:
            token = new_token()
            jobs = [(data_file_name(token, dist.rank, i), g) for i, g in enumerate(plan.groups)]
            files = parallel_map(lambda job: writer.write_file(job[0], job[1], dist.rank), jobs, io_threads)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = exc
    written = {fqn for f in files for fqn, _ in f.chunks}
    payload = {"error": None if local_error is None else f"{type(local_error).__name__}: {local_error}",
               "files": [f.to_json() for f in files],
               "tensors": {k: [dtype_to_code(d), list(s)] for k, (d, s) in (plan.tensors.items() if plan else ())
                           if k in written},
               "aliases": plan.aliases if plan else {}}
    if local_error is None:
        log.info("rank %d wrote %d files (%d bytes) to %s in %.2f s", dist.rank, len(files),
                 sum(f.size for f in files), storage.url, time.perf_counter() - started)
    gathered = dist.gather_json(payload)
    commit_error = None
    if gathered is not None:
        commit_error = _commit(storage, writer, plan, gathered, dist, meta, overwrite)
    commit_error = dist.broadcast_json(commit_error)
    if commit_error is not None or local_error is not None:
        try:  # nothing will reference this rank's new files: remove them (never anything older)
            storage.delete([f.name for f in files])
        except ShardkitError:
            pass
    if local_error is not None:
        raise local_error
    if commit_error is not None:
        raise _same_kind(commit_error)(commit_error)


def _commit(storage: Storage, writer: NativeWriter, plan: SavePlan | None, gathered: list[dict], dist: Dist,
            meta: Mapping[str, Any] | None, overwrite: bool) -> str | None:
    """On rank 0: build, validate and publish the manifest; return an error message or ``None``."""
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"] is not None]
    try:
        if failed:
            return f"save to {storage.url} failed on rank {failed[0][0]}: {failed[0][1]}; nothing was committed"
        if plan is None:
            return f"save to {storage.url}: rank 0 has no plan"
        tensors = dict(plan.tensors)
        from shardkit.checkpoint.formats.codec import code_to_dtype

        for g in gathered:
            for key, (code, shape) in g["tensors"].items():
                seen = tensors.setdefault(key, (code_to_dtype(code), tuple(shape)))
                if (seen[0], tuple(seen[1])) != (code_to_dtype(code), tuple(shape)):
                    return (f"save to {storage.url}: ranks disagree about {key!r}: {seen[0]} {list(seen[1])} vs "
                            f"{code} {shape}")
        for r, g in enumerate(gathered):
            if g["aliases"] != plan.aliases:
                return (f"save to {storage.url}: ranks disagree about tied tensors: rank 0 has {plan.aliases}, "
                        f"rank {r} {g['aliases']}; every rank must tie the same keys")
        files = [WrittenFile.from_json(f) for g in gathered for f in g["files"]]
        writer_info = {"world_size": dist.world_size, "mesh": plan.mesh}
        manifest = writer.build_manifest(tensors, files, values=plan.values, meta=meta, writer_info=writer_info,
                                         aliases=plan.aliases)
        if not overwrite and is_committed(storage):
            return f"{storage.url} already holds a committed checkpoint; pass overwrite=True to replace it"
        writer.commit(manifest)
        log.info("committed %s: %d files from %d ranks", storage.url, sum(len(g["files"]) for g in gathered),
                 len(gathered))
        try:  # files of older saves at this URL: only now, after the new manifest is in place
            storage.delete(unreferenced_files(storage, manifest))
        except ShardkitError:
            pass
        return None
    except ShardkitError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - turned into a message every rank raises
        return f"save to {storage.url} could not commit: {type(exc).__name__}: {exc}"


def _options(compression: Any, chunk_bytes: int, block_bytes: int) -> Compression | None:
    if chunk_bytes < 1024 or block_bytes < 8 or block_bytes % 8:
        raise ConfigurationError("chunk_bytes must be >= 1024 and block_bytes a positive multiple of 8")
    return parse_compression(compression)


def save(state_dict: dict[str, Any], url: str, *, compression: Any = None,
         storage_options: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
         overwrite: bool = True, fsync: bool = True, direct_io: bool = True,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES, block_bytes: int = DEFAULT_BLOCK_BYTES,
         io_threads: int = DEFAULT_IO_THREADS, process_group: Any = None) -> None:
    """Save ``state_dict`` as a native checkpoint at ``url`` (collective when a process group exists).

    ``compression``: ``None``, ``"zstd"`` or ``"zstd:LEVEL"`` (per chunk).
    ``meta``: JSON metadata stored in the manifest (e.g. ``{"step": 100}``).
    ``overwrite=False`` refuses a URL that already holds a committed checkpoint;
    with ``True`` the old checkpoint stays intact until the new one commits.
    ``fsync`` makes data durable before the manifest commits it (as DCP does).
    ``direct_io`` writes local data files with ``O_DIRECT``: no page-cache pages
    to allocate and no second copy of the checkpoint in memory, at the price of
    a load right after the save reading from the disk instead of the cache.
    """
    comp = _options(compression, chunk_bytes, block_bytes)
    meta = to_json_value(dict(meta), "meta") if meta else None
    dist = Dist(process_group)
    storage = Storage(url, storage_options)
    plan, error = None, None
    try:
        if not overwrite and is_committed(storage):
            raise CheckpointExists(f"{url} already holds a committed checkpoint; pass overwrite=True or pick a new URL")
        plan = plan_save(flatten(state_dict), dist.rank, chunk_bytes=chunk_bytes, io_threads=io_threads,
                         compression=comp)
        log.debug("rank %d plans %d data files (%d chunks) for %s", dist.rank, len(plan.groups),
                  sum(len(g) for g in plan.groups), url)
        storage.makedirs()
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the collective
        error = exc
    write_and_commit(storage, plan, error, dist, compression=comp, block_bytes=block_bytes, fsync=fsync,
                     io_threads=io_threads, meta=meta, overwrite=overwrite, direct_io=direct_io)


def async_save(state_dict: dict[str, Any], url: str, *, compression: Any = None,
               storage_options: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
               overwrite: bool = True, fsync: bool = True, direct_io: bool = True,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, block_bytes: int = DEFAULT_BLOCK_BYTES,
               io_threads: int = DEFAULT_IO_THREADS, process_group: Any = None) -> Future:
    """Like :func:`save`, but return once the state is copied to host memory.

    The upload and commit run on a background thread with its own gloo process
    group (never the training thread's): ``process_group`` if given (it must
    not be used by anything else while a save runs), else one created on the
    first call (a collective).  Staging buffers are reused from save to save,
    so host memory stays flat; a new ``async_save`` first waits for the
    previous one.  The returned future raises what the save raised.
    """
    from shardkit.checkpoint.training.async_save import background_saver

    comp = _options(compression, chunk_bytes, block_bytes)
    meta = to_json_value(dict(meta), "meta") if meta else None
    return background_saver().submit(state_dict, Storage(url, storage_options), compression=comp, meta=meta,
                                     overwrite=overwrite, fsync=fsync, chunk_bytes=chunk_bytes,
                                     block_bytes=block_bytes, io_threads=io_threads, process_group=process_group,
                                     direct_io=direct_io)


def load(state_dict: dict[str, Any], url: str, *, strict: bool = True,
         storage_options: Mapping[str, Any] | None = None, verify_first: bool = True,
         format: str | None = None, io_threads: int = DEFAULT_IO_THREADS,
         process_group: Any = None, dtype_cast: bool = False) -> dict[str, Any]:
    """Load the checkpoint at ``url`` into ``state_dict`` in place, whatever its layout; return its ``meta``.

    Tensors (plain or DTensor, any mesh and placements) are filled in place,
    each rank reading only the byte ranges its shards need; non-tensor values
    are replaced in ``state_dict``.  ``strict``: missing and unexpected keys
    raise; shape and dtype mismatches always raise.  Works without a process group.

    All or nothing: a damaged checkpoint (missing or truncated files, checksum
    mismatches, undecodable frames) raises on every rank before any target is
    written.  ``verify_first=False`` skips the checking pass (see
    :func:`check_before_writing`): faster, but a checksum error may then leave
    targets partly loaded.  ``format`` (``"shardkit"``, ``"hf"``, ``"torch"``,
    ``"dcp"``) is detected when ``None``.

    ``dtype_cast=True`` lets a tensor load into a target of another floating
    dtype (a bf16 model from an fp32 checkpoint, as DCP allows): it is read in
    the stored dtype into a host buffer of the target's local shape, then cast
    into the target; such buffers add the stored size of the cast shards to
    the load's memory.  Off by default, so a dtype mismatch is an error.
    """
    dist = Dist(process_group)
    local_exc: BaseException | None = None
    staged = None
    try:
        storage = Storage(url, storage_options)
        reader = _open(storage, format, io_threads)
        flat = flatten(state_dict)
        started = time.perf_counter()
        requests, device_copies = _plan_load(reader, flat, strict, dtype_cast)
        log.debug("rank %d plans %d reads from %s (%s)", dist.rank, len(requests), url, reader.info.format)
        reader.prepare(requests)
        if verify_first:
            staged = check_before_writing(reader, requests)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
        local_exc = exc
    _agree(dist, local_exc, url)
    try:
        if staged is None:
            reader.read(requests)
        for out, buf in staged or ():
            out.copy_(buf)
        for buf, target in device_copies:
            target.copy_(buf)
        for key in flat.values:
            if key in reader.values():
                flat.set_value(key, from_json_value(reader.values()[key]))
    except Exception as exc:  # noqa: BLE001
        local_exc = exc
    finally:
        reader.close()
    _agree(dist, local_exc, url)
    log.info("rank %d loaded %d tensors (%d bytes) from %s in %.2f s", dist.rank, len(requests),
             sum(r.out.numel() * r.out.element_size() for r in requests), url, time.perf_counter() - started)
    return dict(reader.info.meta)


def check_before_writing(reader: CheckpointReader,
                         requests: Sequence[ReadRequest]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Check every byte ``requests`` need without writing any ``out``; return staged copies or ``None``.

    Checksums are known only once the bytes are read, and the targets are the
    only memory big enough to hold what a load reads: a second copy of the
    state would break the bounded-memory promise.  So the default is two
    passes -- ``reader.verify`` reads and checks every needed checksum block
    through small per-thread buffers, then ``load`` reads into the targets.  On
    a local disk the first pass leaves the bytes in the page cache, so the
    price is one extra memory-speed pass, not a second disk read (unless the
    checkpoint outgrows the free page cache).

    One pass is cheaper when everything fits a small buffer and re-reading is
    expensive: from remote storage (a second pass would fetch every byte over
    the network twice) or from a format without ranged, checksummed reads, a
    load needing at most ``STAGE_BYTES`` is read once into staging tensors
    (checked by the read), and ``load`` copies them into the targets after the
    ranks agree; the list of ``(out, staged)`` pairs is returned.  Native
    checkpoints on a local disk are never staged: on these VMs fresh memory
    is first touched at 0.5-0.8 GB/s, slower than a second read from the page
    cache.  Larger remote loads are fetched twice; ``load(verify_first=False)``
    fetches once at the price of all or nothing.
    """
    needed = sum(r.out.numel() * r.out.element_size() for r in requests)
    local_native = isinstance(reader, NativeReader) and reader.storage.is_local
    if needed > STAGE_BYTES or local_native:
        reader.verify(requests)
        return None
    staged = [(r.out, torch.empty(r.out.shape, dtype=r.out.dtype)) for r in requests]
    reader.read([ReadRequest(r.fqn, r.chunk, r.box, buf) for r, (_, buf) in zip(requests, staged)])
    return staged


def _open(storage: Storage, format: str | None, io_threads: int) -> CheckpointReader:
    """The native reader when ``manifest.json`` is there; else the detected (or named) format."""
    if format not in (None, "shardkit"):
        return open_reader(storage, format=format)
    try:
        return NativeReader(storage, io_threads=io_threads)
    except CheckpointNotFound as native_error:
        if format == "shardkit":
            raise
        try:
            return open_reader(storage)
        except CheckpointNotFound:
            raise native_error from None


def _agree(dist: Dist, local_exc: BaseException | None, url: str) -> None:
    """Raise on every rank when any rank failed (the failing rank re-raises its own exception)."""
    message = None if local_exc is None else f"{type(local_exc).__name__}: {local_exc}"
    first = dist.first_error(message)
    if first is None:
        return
    if local_exc is not None:
        raise local_exc
    rank, text = first
    raise _same_kind(text)(f"loading {url} failed on rank {rank} ({text})")


def _same_kind(message: str) -> type[ShardkitError]:
    """The shardkit error class named at the start of ``message`` (so every rank raises alike)."""
    import shardkit.errors as errors

    cls = getattr(errors, message.split(":", 1)[0], None)
    return cls if isinstance(cls, type) and issubclass(cls, ShardkitError) else CheckpointError


def _plan_load(reader: CheckpointReader, flat: Flat, strict: bool, dtype_cast: bool = False):
    entries, values = reader.tensors(), reader.values()
    stored = set(entries) | set(values)
    wanted_keys = set(flat.tensors) | set(flat.values)
    tied = alias_groups(find_aliases(flat.tensors))
    # a tied group of the target is one tensor: read the first of its keys the checkpoint holds (the others
    # then hold the same bytes), and count every key of the group as present when one of them is stored
    reads = {key: next((k for k in tied.get(key, [key]) if k in stored), None) for key in flat.tensors}
    missing = sorted(k for k in wanted_keys - stored if reads.get(k) is None)
    unexpected = sorted(stored - wanted_keys)
    if strict and (missing or unexpected):
        raise IncompatibleStateDict(
            f"{reader.info.url} does not match the state dict: missing keys {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; unexpected keys {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}. Pass strict=False to load the common keys.")
    wanted, device_copies = [], []
    for key, target in flat.tensors.items():
        if key not in stored:
            continue
        check_value_kind(key, key in entries, True)
        entry = entries[key]
        cast = entry.dtype != target.dtype
        if tuple(entry.shape) != tuple(target.shape) or (cast and not (
                dtype_cast and entry.dtype.is_floating_point and target.dtype.is_floating_point)):
            hint = " (pass dtype_cast=True to cast floating-point values)" if cast and not dtype_cast else ""
            raise IncompatibleStateDict(f"{key!r}: checkpoint holds {entry.dtype} {list(entry.shape)}, the target "
                                        f"is {target.dtype} {list(target.shape)}{hint}")
        if reads[key] != key:  # tied to a key read already: the same memory
            continue
        box = local_box(target, key)
        if box is None or math.prod(box[1]) == 0:
            continue
        local = local_tensor(target).detach()
        if local.device.type != "cpu" or cast:  # read as stored, then copy_ (casting) into the target
            buf = torch.empty(local.shape, dtype=entry.dtype)
            device_copies.append((buf, local))
            local = buf
        wanted.append((key, box, local))
    for key in flat.values:
        if key in stored:
            check_value_kind(key, key in entries, False)
    return plan_reads(reader, wanted), device_copies
