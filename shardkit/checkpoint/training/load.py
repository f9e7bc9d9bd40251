"""``load``: fill a state dict in place from a checkpoint of any layout and format.

Each rank reads what it needs, and bytes that several ranks need (replicas
under HSDP) are read by one of them and sent to the others
(:mod:`.shared_reads`); collectives otherwise only to agree on the outcome:

1. Read and validate the manifest; match keys, dtypes and global shapes of the
   target (``strict``: missing or unexpected keys raise; a key of a tied
   target is present when a key it is tied to is, and only one of them is
   read); plan, for every local shard of the target, the pieces of stored
   chunks it needs and check every data file it will touch has the recorded
   size.  Ranks agree all is well *before any target tensor is written*.
2. Only with ``verify_first=True`` (see :func:`check_before_writing`): check
   the data before writing any of it -- what fits the staging budget is read
   once into host staging memory and checked there; the rest has every
   checksum block it needs read and verified; the ranks agree again.
3. The bytes go into the targets: staged ones are copied, the rest is read in
   place (contiguous runs straight into the target's memory, every byte
   verified against its checksum block as it lands).  Once every rank's reads
   succeeded, the bytes of shared requests go from the rank that read them to
   the others.  A failure from here on may have written targets: every rank raises
   the same error, naming the tensors that may be partly written
   (:func:`_partly_written_error`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from datetime import timedelta
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from shardkit.checkpoint.formats import NATIVE, open_reader
from shardkit.checkpoint.formats.base import (
    CheckpointReader,
    ReadRequest,
)
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS
from shardkit.checkpoint.io.deadline import deadline_for
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.retries import with_retries
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.dcp_stateful import load_into_statefuls, stateful_to_state_dict
from shardkit.checkpoint.state.tree import (
    flatten,
    from_json_value,
)
from shardkit.checkpoint.training import shared_reads
from shardkit.checkpoint.training.checkpoint_id import checkpoint_url
from shardkit.checkpoint.training.device_reads import read_requests
from shardkit.checkpoint.training.load_planning import plan_load
from shardkit.checkpoint.training.shared_reads import exchange, prepare_exchange, share_reads
from shardkit.errors import (
    CheckpointNotFound,
    ConfigurationError,
    ShardkitError,
    error_record,
    from_record,
)

log = logging.getLogger(__name__)

__all__ = ["load", "open_checkpoint", "LoadResult", "check_before_writing", "Checked",
           "default_staging_bytes", "every_ranks_keys", "name_some"]

_NAMED_TARGETS = 5  # keys a message names (the exception's ``partly_written`` holds them all)


def load(state_dict: dict[str, Any], url: str | None = None, *, checkpoint_id: str | os.PathLike | None = None,
         strict: bool = True,
         storage_options: Mapping[str, Any] | None = None, verify_first: bool = False,
         format: str | None = None, io_threads: int = DEFAULT_IO_THREADS,
         process_group: Any = None, dtype_cast: bool = False,
         staging_bytes: int | None = None, timeout: float | timedelta | None = None,
         retries: int | None = None) -> dict[str, Any]:
    """Load the checkpoint at ``url`` into ``state_dict`` in place, whatever its layout; return its ``meta``.

    Tensors (plain or DTensor, any mesh and placements) are filled in place,
    each rank reading only the byte ranges its shards need; non-tensor values
    are replaced in ``state_dict``.  ``strict``: missing and unexpected keys
    raise; shape and dtype mismatches always raise.  Works without a process group.

    One verified pass by default: every checksum block is checked as its bytes
    land in their target, so each byte is read from storage once.  A damaged
    checkpoint (missing or truncated files, checksum mismatches, undecodable
    frames) raises the same error on every rank, naming the file and key at
    fault.  What can be checked without reading the data -- manifest, keys,
    shapes, data file sizes and headers -- is checked before any target is
    written (then the error says no target was written); damage found while
    reading means targets may be partly written, and the error names them (all
    of them in its ``partly_written``): load an older checkpoint into them.
    :meth:`~shardkit.checkpoint.CheckpointManager.load_latest` does so itself.

    ``verify_first=True`` is all or nothing, for code that must keep its
    in-memory state when a load fails: every byte is checked before any rank
    writes any target, in host staging memory of at most ``staging_bytes`` per
    rank (``None``: :func:`default_staging_bytes`) so it is read once, and a
    load needing more checks the rest in a first pass and reads it again (see
    :func:`check_before_writing`).  ``format`` (``"shardkit"``, ``"hf"``, ``"torch"``,
    ``"dcp"``, and the read-only ``"deepspeed"`` and ``"trainer"``) is detected when ``None``.

    ``dtype_cast=True`` lets a tensor load into a target of another floating
    dtype (a bf16 model from an fp32 checkpoint, as DCP allows): it is read in
    the stored dtype into a host buffer of the target's local shape, then cast
    into the target; such buffers add the stored size of the cast shards to
    the load's memory.  Off by default, so a dtype mismatch is an error.

    ``checkpoint_id``: DCP's keyword for ``url`` (give one of them), so
    ``dcp.load(state_dict, checkpoint_id=path)`` runs with the import swapped
    (DCP returns ``None``; the ``meta`` returned here is simply not used).  DCP's
    load also writes as it reads, so the one-pass default keeps its contract.
    A top-level value that is torch's ``Stateful`` (DCP's ``AppState``) is loaded as
    DCP loads it: into its ``state_dict()``, then handed to its ``load_state_dict()``
    once every rank's load succeeded (:mod:`~shardkit.checkpoint.state.dcp_stateful`).

    ``timeout`` (seconds or a ``timedelta``; default ``SHARDKIT_CHECKPOINT_TIMEOUT``, else 600 s): how long a
    rank waits at one of the load's collectives for the others; a rank that died, froze or never called
    fails them with :class:`~shardkit.errors.CheckpointTimeout` naming it (:mod:`~shardkit.checkpoint.io.deadline`).
    ``retries``: how often a failed storage request is retried (``storage_options={"shardkit": {"retries":
    N}}``, which it sets; see :func:`~shardkit.checkpoint.io.retries.with_retries`).
    """
    url = checkpoint_url(url, checkpoint_id, "load")
    storage_options = with_retries(storage_options, retries)
    dist = Dist(process_group, deadline_for("load", url, timeout))
    dist.phase = "read"
    local_exc: BaseException | None = None
    requests: list[ReadRequest] = []
    checked = Checked([], [])
    budget = 0
    targets: Any = state_dict
    try:
        if staging_bytes is not None and staging_bytes < 0:
            raise ConfigurationError(f"staging_bytes must be >= 0, got {staging_bytes}")
        if verify_first:  # the default load stages nothing
            budget = default_staging_bytes() if staging_bytes is None else staging_bytes
        storage = Storage(url, storage_options)
        reader = open_checkpoint(storage, format, io_threads)
        targets = stateful_to_state_dict(state_dict)
        flat = flatten(targets)
        started = time.perf_counter()
        plan = plan_load(reader, flat, strict, dtype_cast)
        requests, device_copies = plan.requests, plan.device_copies
        log.debug("rank %d plans %d reads from %s (%s)", dist.rank, len(requests), url, reader.info.format)
        reader.prepare(requests)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the collectives below
        local_exc, requests = exc, []
    # collective: bytes several ranks need are read by one of them; the ranks learn in it too whether any of
    # them failed so far, so a default load agrees that all is well before writing without a collective more
    cheap = local_exc is None and reader.rereads_from_cache  # a local disk: a few bytes read twice cost nothing
    shared = share_reads(requests, dist, failure=None if local_exc is None else error_record(local_exc),
                         reread_below=shared_reads.REREAD_BELOW if cheap else 0)
    if shared.failed is not None:
        _raise_first(dist, shared.failed, local_exc, url)
    checked = Checked([], list(shared.mine))
    if verify_first:
        try:
            checked = check_before_writing(reader, shared.mine, budget, shared.for_others)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
            local_exc = exc
        _agree(dist, local_exc, url)  # nothing is written before this agreement
    written = {r.fqn for r in requests}  # from here on a failure may leave these partly written
    prepared = None
    try:
        for out, buf in checked.staged:
            out.copy_(buf)
        checked.staged.clear()  # staging memory goes before the in-place reads
        read_requests(reader, checked.in_place)  # a GPU target through small page-locked rounds
        prepared = prepare_exchange(shared, dist)  # its buffer, before the agreement that lets bytes travel
    except Exception as exc:  # noqa: BLE001
        local_exc = exc
    if shared.shared:  # no bytes leave a rank unless every rank's own reads succeeded
        _agree(dist, local_exc, url, written, verify_first)
    try:
        exchange(shared, dist, prepared)
        if local_exc is None:  # a failed read leaves cast buffers partly unread and values of a damaged step
            for buf, target in device_copies:
                target.copy_(buf)
            stored = reader.values()
            for key in flat.values:
                if key in stored:
                    written.add(key)
                    flat.set_value(key, from_json_value(stored[key]))
    except Exception as exc:  # noqa: BLE001
        local_exc = exc
    finally:
        reader.close()
    try:
        _agree(dist, local_exc, url, written, verify_first)
    except BaseException:
        load_into_statefuls(state_dict, targets, statefuls=False)
        raise
    load_into_statefuls(state_dict, targets)
    log.info("rank %d loaded %d tensors (%d bytes) from %s in %.2f s", dist.rank, len(requests),
             sum(r.out.numel() * r.out.element_size() for r in requests), url, time.perf_counter() - started)
    return LoadResult(reader.info.meta, missing=plan.missing, unexpected=plan.unexpected)


def open_checkpoint(storage: Storage, format: str | None = None, io_threads: int = DEFAULT_IO_THREADS
                    ) -> CheckpointReader:
    """:func:`~shardkit.checkpoint.formats.registry.open_reader` of ``storage``, a native checkpoint first.

    Detection asks storage whether the checkpoint exists and then whether it
    holds a manifest before the reader reads that manifest: three requests to
    an object store, where reading the manifest alone answers all three for the
    checkpoints shardkit writes.  So an undetected format is tried as native
    first; only where there is no manifest does detection run (and word the
    error of a path that holds no checkpoint)."""
    if format is None:
        try:
            return NATIVE.open_reader(storage, io_threads=io_threads)
        except CheckpointNotFound:
            pass  # not a native checkpoint: detection says what it is
    return open_reader(storage, format=format, io_threads=io_threads)


class Checked(NamedTuple):
    """What :func:`check_before_writing` leaves to do once the ranks agree: ``staged`` (target, checked
    copy) pairs to copy, and requests to read ``in_place`` (checked already, unless the check was skipped)."""

    staged: list[tuple[torch.Tensor, torch.Tensor]]
    in_place: list[ReadRequest]


def default_staging_bytes() -> int:
    """Host memory one rank's load may stage: a quarter of the memory available now, shared by the
    ranks of this machine (torchrun's ``LOCAL_WORLD_SIZE``); 0 where that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return available // (4 * local_ranks)


def check_before_writing(reader: CheckpointReader, requests: Sequence[ReadRequest], staging_bytes: int | None,
                         for_others: Sequence[ReadRequest] = ()) -> Checked:
    """Check every byte ``requests`` need without writing any ``out`` (``staging_bytes=None``: skip the check).

    Checksums are known only once the bytes are read, and a load must not
    write a target before every rank knows its bytes are good.  Requests
    whose bytes fit ``staging_bytes`` are read once into staging tensors
    (checked by the read); ``load`` copies them into the targets after the
    ranks agree -- one read from storage per byte.  Requests beyond the
    budget are checked by ``reader.verify`` (every needed checksum block read
    through small per-thread buffers), then read again into the targets.

    Where the reader rereads from the page cache
    (:attr:`~shardkit.checkpoint.formats.base.CheckpointReader.rereads_from_cache`: a native
    checkpoint on a local disk) requests are staged only when this rank reads
    them for others too (``for_others``: replicas under HSDP, whose bytes must
    come from storage once); the rest are checked, not staged -- the check
    leaves the bytes in the page cache, so the second read is a memory-speed
    copy and needs no fresh memory, whose page faults cost about as much
    (docs/checkpoint.md has the figures).  Elsewhere every request is a
    candidate: there a second read is a second fetch.
    """
    if staging_bytes is None:
        return Checked([], list(requests))
    if reader.rereads_from_cache:
        candidates = {id(r) for r in for_others}
    else:
        candidates = {id(r) for r in requests}
    staged, in_place, used = [], [], 0
    for r in requests:
        nbytes = r.out.numel() * r.out.element_size()
        if id(r) in candidates and used + nbytes <= staging_bytes:
            staged.append(r)
            used += nbytes
        else:
            in_place.append(r)
    if in_place:
        reader.verify(in_place)
    pairs = [(r.out, torch.empty(r.out.shape, dtype=r.out.dtype)) for r in staged]
    reader.read([ReadRequest(r.fqn, r.chunk, r.box, buf) for r, (_, buf) in zip(staged, pairs)])
    return Checked(pairs, in_place)


def _agree(dist: Dist, local_exc: BaseException | None, url: str, written: set[str] | None = None,
           verify_first: bool = False) -> None:
    """Raise on every rank when any rank failed, the same error everywhere (the class and message of
    the lowest failing rank's, chained to the local exception where there is one).

    ``written``: the keys this rank's load writes, once writing began (``None``: nothing was
    written yet, and the error says so); the error then names every rank's, as
    :func:`_partly_written_error` says.  The same with or without a process group.  A built-in
    failure (``OSError``, ``torch.OutOfMemoryError``, ...) keeps its type: the error is a
    :class:`~shardkit.errors.CheckpointError` that is also one (:func:`~shardkit.errors.from_record`).
    """
    first = dist.first_error(None if local_exc is None else error_record(local_exc))
    if first is not None:
        _raise_first(dist, first, local_exc, url, written, verify_first)


def _raise_first(dist: Dist, first: tuple[int, Any], local_exc: BaseException | None, url: str,
                 written: set[str] | None = None, verify_first: bool = False) -> None:
    """Raise the error every rank raises once the ranks agreed that ``first`` (the lowest failing rank
    and its error record) failed, as :func:`_agree` says."""
    rank, record = first
    text = str(record["message"]).rstrip(".")
    message = f"loading {url} failed on rank {rank} ({record['type']}: {text})" if dist.active else text
    if written is None:
        raise from_record(record, f"{message}. No target was written.") from local_exc
    raise _partly_written_error(record, message, every_ranks_keys(dist, written), verify_first) from local_exc


def every_ranks_keys(dist: Dist, keys: set[str]) -> list[str]:
    """Every rank's ``keys`` together, sorted, on every rank -- without every rank holding every rank's list.

    After a failure that may be about memory, at thousands of ranks, an
    all-gather of key lists would cost each rank the lists of all of them.
    Ranks holding the same keys (the usual case: each holds a piece of every
    tensor) find so in one small all-reduce of a digest; only otherwise are
    the lists gathered to rank 0, whose union is broadcast.
    """
    mine = sorted(keys)
    if not dist.active:
        return mine
    digest = int.from_bytes(hashlib.blake2b("\n".join(mine).encode("utf-8"), digest_size=7).digest(), "big")
    if dist.all_same(True, digest):
        return mine
    gathered = dist.gather_json(mine)
    return dist.broadcast_json(None if gathered is None else sorted({key for keys in gathered for key in keys}))


def _partly_written_error(record: Mapping[str, str], message: str, keys: Sequence[str],
                          verify_first: bool) -> ShardkitError:
    """The error of a load that failed after it began writing ``keys`` (every rank's, sorted): the
    failure's own class (:func:`~shardkit.errors.from_record`), its ``message``, then the keys (tensors
    and values) that may be partly written -- the count and the first few by name, all of them in
    ``partly_written`` (what :meth:`~shardkit.checkpoint.CheckpointManager.load_latest` reads to know a
    failed attempt touched the targets) -- and what to do.  The same on every rank, whichever rank failed."""
    advice = "load an older checkpoint into them" + (
        "" if verify_first else ", or pass verify_first=True to keep the targets as they were when a load fails")
    error = from_record(dict(record), f"{message}. Targets may be partly written: {name_some(keys)}; {advice}.")
    error.partly_written = tuple(keys)
    return error


def name_some(keys: Sequence[str]) -> str:
    """``keys`` for a message: how many, and the first few by name (a load's keys can number millions)."""
    shown = ", ".join(keys[:_NAMED_TARGETS]) + (", ..." if len(keys) > _NAMED_TARGETS else "")
    return f"{len(keys)} key{'' if len(keys) == 1 else 's'} ({shown})"


class LoadResult(dict):
    """What ``load`` returns: the checkpoint's ``meta`` (a dict, as always), plus the target keys the
    checkpoint did not have (``missing``) and its keys the target did not take (``unexpected``) --
    empty under ``strict=True``, the report of a partial load under ``strict=False``."""

    def __init__(self, meta: Mapping[str, Any], *, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(meta)
        self.missing = missing
        self.unexpected = unexpected
