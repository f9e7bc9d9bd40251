"""Saves that store only what changed: chunks equal to an earlier sibling checkpoint's are referenced.

A fine-tune with a frozen base rewrites the same bytes at every step.  With
``digests`` a save records a digest of every chunk it writes; with
``reuse_from`` (an earlier committed checkpoint in the same parent directory,
as ``CheckpointManager(dedup=True)`` passes its newest step) each rank hashes
the chunks it is about to write and, where the earlier checkpoint stored a
chunk of the same key, box and dtype with the same digest *and* its data file
is still there with the recorded size, records a reference to that file
instead of writing the bytes again (format version 4, see
:mod:`~shardkit.checkpoint.formats.native.references`).

Why a digest and not the crc32c already stored: a crc32c per block misses
one changed block in 2**32, which a job writing terabytes per step would meet.
The default digest is XXH3's 128 bits: a changed chunk goes unnoticed with
odds of 2**-128, and it hashes at memory speed (about 17 GB/s per core), so
hashing every byte costs a small part of writing it -- which is what lets a
dedup save take time in proportion to what changed.  It is not a
cryptographic hash: whoever can choose the model's bytes could forge a
collision, so ``dedup="sha256"`` (about 1.5 GB/s per core) is there for
those who need that.  Hashing runs on the save's I/O threads (both release
the GIL), in the background for ``async_save``.

A rank only references files its own rank number wrote or referenced in the
earlier checkpoint (the same layout saves the same boxes from the same ranks),
so two ranks never claim one file.  Anything unusable -- no earlier
checkpoint, one from another layout, a damaged manifest -- only means the
chunks are written in full; dedup never fails a save.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Sequence

import xxhash

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.dtypes import as_bytes, dtype_to_code
from shardkit.checkpoint.formats.native import (
    DIGEST_ALGORITHMS,
    ChunkRecord,
    FileRecord,
    NativeReader,
    WrittenFile,
    rebase_reference,
)
from shardkit.checkpoint.io.concurrency import parallel_map
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ConfigurationError, ShardkitError

__all__ = ["DEFAULT_DIGEST", "digest_algorithm", "chunk_digest", "sibling_name", "Deduplicated", "deduplicate",
           "with_digests"]

log = logging.getLogger(__name__)

_Key = tuple[str, tuple[int, ...], tuple[int, ...]]


DEFAULT_DIGEST = "xxh3-128"


def digest_algorithm(choice: bool | str) -> str:
    """The digest algorithm a ``digests``/``dedup`` option asks for (``True``: the default)."""
    algorithm = DEFAULT_DIGEST if choice is True else choice
    if not isinstance(algorithm, str) or algorithm not in DIGEST_ALGORITHMS:
        raise ConfigurationError(f"dedup/digests must be True or one of {sorted(DIGEST_ALGORITHMS)}, got {choice!r}")
    return algorithm


def chunk_digest(chunk: WriteChunk, algorithm: str = DEFAULT_DIGEST) -> str:
    """``"<algorithm>:<hex>"`` of the chunk's raw bytes: row-major, little-endian, as a raw record stores them."""
    data = memoryview(as_bytes(chunk.materialize()).numpy())
    found = xxhash.xxh3_128(data) if algorithm == "xxh3-128" else hashlib.sha256(data)
    return f"{algorithm}:{found.hexdigest()}"


def sibling_name(storage: Storage, base_url: str) -> str:
    """The directory name of ``base_url`` when it lies beside ``storage`` (same parent, another name)."""
    parent, _, name = base_url.rstrip("/").rpartition("/")
    own_parent, _, own = storage.url.rstrip("/").rpartition("/")
    if not name or parent != own_parent or name == own:
        raise ConfigurationError(f"reuse_from={base_url!r} must be another checkpoint in the same directory as "
                                 f"{storage.url} (references name a sibling: ../<name>/data/...)")
    return name


@dataclass
class Deduplicated:
    """What is left to write (``groups``), the references made instead (``reused``, one entry per
    referenced file) and every chunk's digest (fqn, offsets) -> hex."""

    groups: list[list[WriteChunk]]
    reused: list[WrittenFile]
    digests: dict[tuple[str, tuple[int, ...]], str]


def deduplicate(groups: Sequence[Sequence[WriteChunk]], storage: Storage, reuse_from: str | None, writer: int,
                io_threads: int, algorithm: str = DEFAULT_DIGEST) -> Deduplicated:
    """Hash every chunk of ``groups``; drop those the checkpoint at ``reuse_from`` already stores (a chunk
    it stored with another digest algorithm is written again)."""
    chunks = [c for g in groups for c in g]
    digests = dict(zip(((c.fqn, tuple(c.offsets)) for c in chunks),
                       parallel_map(lambda c: chunk_digest(c, algorithm), chunks, io_threads)))
    if reuse_from is None or not chunks:
        return Deduplicated([list(g) for g in groups], [], digests)
    sibling = sibling_name(storage, reuse_from)
    stored = _stored_chunks(storage, reuse_from, sibling, chunks, writer)
    reused: dict[str, list[tuple[str, ChunkRecord]]] = {}
    infos: dict[str, FileRecord] = {}
    kept_groups = []
    for group in groups:
        kept = []
        for c in group:
            found = stored.get((c.fqn, tuple(c.offsets), tuple(c.shape)))
            if found is not None and found[0] == dtype_to_code(c.dtype) and found[1].digest == digests[
                    (c.fqn, tuple(c.offsets))]:
                reused.setdefault(found[1].file, []).append((c.fqn, found[1]))
                infos[found[1].file] = found[2]
            else:
                kept.append(c)
        if kept:
            kept_groups.append(kept)
    files = [WrittenFile(name, infos[name].size, writer, tuple(recs), infos[name].header)
             for name, recs in sorted(reused.items())]
    return Deduplicated(kept_groups, files, digests)


def _stored_chunks(storage: Storage, reuse_from: str, sibling: str, chunks: Sequence[WriteChunk],
                   writer: int) -> dict[_Key, tuple[str, ChunkRecord, FileRecord]]:
    """The earlier checkpoint's records of these chunks' boxes -- dtype code, record (file rebased to
    a reference from ``storage``), its file's record (size, header) -- for files of this writer that are
    still whole."""
    try:
        reader = NativeReader(Storage(reuse_from, storage.storage_options))
        wanted: dict[str, set] = {}
        for c in chunks:
            wanted.setdefault(c.fqn, set()).add((tuple(c.offsets), tuple(c.shape)))
        reader.focus({fqn: sorted(boxes) for fqn, boxes in wanted.items()})
        manifest = reader.manifest
    except (ShardkitError, OSError) as exc:
        log.warning("writing every chunk: could not read %s to reuse its chunks (%s)", reuse_from, exc)
        return {}
    out: dict[_Key, tuple[str, ChunkRecord, FileRecord]] = {}
    usable: dict[str, bool] = {}
    own = storage.url.rstrip("/").rpartition("/")[2]
    for fqn, boxes in wanted.items():
        t = manifest.tensors.get(fqn)
        for rec in t.chunks if t is not None else ():
            info = manifest.files[rec.file]
            if rec.digest is None or info.writer != writer or rec.box not in boxes:
                continue
            name = rebase_reference(rec.file, sibling, own)
            if name not in usable:
                usable[name] = _still_whole(storage, name, info.size)
            if usable[name]:
                out[(fqn, *rec.box)] = (t.dtype, replace(rec, file=name), info)
    return out


def _still_whole(storage: Storage, name: str, size: int) -> bool:
    """A referenced file must be there with the size its checkpoint recorded (it may have been deleted by
    hand); otherwise its chunks are written again."""
    try:
        found = storage.size(name)
    except (ShardkitError, OSError):  # missing (CheckpointNotFound) or unreachable
        found = None
    if found != size:
        log.warning("not reusing %s: it is %s, the checkpoint that wrote it records %d bytes", storage.where(name),
                    "missing" if found is None else f"{found} bytes", size)
    return found == size


def with_digests(files: Sequence[WrittenFile], digests: dict[tuple[str, tuple[int, ...]], str]) -> list[WrittenFile]:
    """``files`` with each chunk record carrying its digest."""
    return [replace(f, chunks=tuple((fqn, replace(rec, digest=digests.get((fqn, rec.offsets), rec.digest)))
                                    for fqn, rec in f.chunks)) for f in files]
