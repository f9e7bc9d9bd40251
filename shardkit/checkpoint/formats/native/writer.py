"""The native format's write side: stream chunks into data files, commit the manifest.

:meth:`NativeWriter.write_file` streams the chunks it is given into one
safetensors file (header first, then bytes; crc32c per block computed on the
way; ``O_DIRECT`` on local disks) and returns their manifest records;
:meth:`NativeWriter.commit` validates the manifest as a reader would and
writes it atomically, last.  Used by ``save``/``async_save`` (one writer per
rank) and by the offline reshard/convert (one process writing every file).
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Iterable, Mapping, Protocol, Sequence, TypeVar

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.compression import Compression, zstd_compress
from shardkit.checkpoint.formats.crc32c import unpack_crcs
from shardkit.checkpoint.formats.dtypes import as_bytes, dtype_to_code, is_tensor, itemsize
from shardkit.checkpoint.formats.native import index
from shardkit.checkpoint.formats.native.headers import (
    DATA_FILE_METADATA,
    HeaderRecord,
    header_record_json,
    header_record_of,
    parse_header_record,
)
from shardkit.checkpoint.formats.native.manifest import (
    MANIFEST_NAME,
    ChunkRecord,
    FileRecord,
    Manifest,
    TensorRecord,
    crc_count,
    dump_manifest,
)
from shardkit.checkpoint.formats.native.manifest_parse import parse_manifest
from shardkit.checkpoint.formats.native.ownership import DATA_DIR, is_native_file_name
from shardkit.checkpoint.formats.native.references import DIGEST_NAME
from shardkit.checkpoint.formats.native.siblings import referenced_by_siblings
from shardkit.checkpoint.formats.safetensors import SafetensorsStreamWriter
from shardkit.checkpoint.geometry.boxes import Box
from shardkit.checkpoint.geometry.strips import strip_block, strip_boxes, strip_width
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS, parallel_map
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import UnsupportedFormat

if TYPE_CHECKING:
    import torch

__all__ = ["check_tensors", "unreferenced_files", "DATA_DIR", "DEFAULT_BLOCK_BYTES", "DEFAULT_CHUNK_BYTES",
           "DEFAULT_MAX_STRIPS", "COLUMN_STRIPS",
           "NativeWriter", "WrittenFile", "data_file_name", "new_token", "chunk_key", "group_into_files"]

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_BLOCK_BYTES = 256 << 10
DEFAULT_MAX_STRIPS = 16  # a column cut then reads at most 2/16 of a chunk's width more than it needs
COLUMN_STRIPS = ("cut", "all", "off")

log = logging.getLogger(__name__)


class _HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


_Sized = TypeVar("_Sized", bound=_HasNbytes)


def group_into_files(chunks: Sequence[_Sized], n_files: int, cap: int | None) -> list[list[_Sized]]:
    """Consecutive runs of ``chunks`` (anything with ``.nbytes``) for data files: balanced by bytes over
    ``n_files`` files, or, with ``cap``, filled greedily up to ``cap`` bytes each (a bigger chunk alone).

    Balanced files let a rank's I/O threads each stream one; capped files bound what a zstd writer
    holds (one file's frames) and what an offline reshard keeps in flight.
    """
    if not chunks:
        return []
    total = sum(c.nbytes for c in chunks)
    target = cap if cap is not None else max(1, -(-total // max(1, n_files)))
    groups: list[list[_Sized]] = [[]]
    filled = 0
    for c in chunks:
        if groups[-1] and filled + c.nbytes > target and (cap is not None or len(groups) < n_files):
            groups.append([])
            filled = 0
        groups[-1].append(c)
        filled += c.nbytes
    return groups


def new_token() -> str:
    return uuid.uuid4().hex[:10]


def data_file_name(token: str, writer: int, part: int) -> str:
    return f"{DATA_DIR}/{token}-{writer}-{part}.safetensors"


def chunk_key(fqn: str, offsets: Sequence[int]) -> str:
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


@dataclass(frozen=True)
class WrittenFile:
    """A data file on storage and the manifest records of the chunks it holds."""

    name: str
    size: int
    writer: int
    chunks: tuple[tuple[str, ChunkRecord], ...]  # (fqn, record)
    header: HeaderRecord | None = None  # its safetensors header's size and crc32c (None: not recorded)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "writer": self.writer,
                "chunks": [[fqn, rec.to_json()] for fqn, rec in self.chunks],
                **({"header": header_record_json(self.header)} if self.header else {})}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "WrittenFile":
        """Inverse of :meth:`to_json` (for records sent between ranks; validated again at commit)."""
        chunks = []
        for fqn, c in doc["chunks"]:
            box, strips = (tuple(c["offsets"]), tuple(c["shape"])), tuple(c["strips"]) if c.get("strips") else None
            count = crc_count(box, c["nbytes"], c["block"], strips)
            chunks.append((fqn, ChunkRecord(*box, c["file"], c["key"], c["start"],
                                            c["nbytes"], c["codec"], c["block"],
                                            tuple(unpack_crcs(c["crc32c"], count, doc["name"])), strips,
                                            c.get(DIGEST_NAME))))
        return cls(doc["name"], doc["size"], doc["writer"], tuple(chunks),
                   parse_header_record(doc.get("header"), doc["size"], doc["name"]))


class NativeWriter:
    """Streams chunks into native data files and commits the manifest.

    ``compression`` (a :class:`~shardkit.checkpoint.formats.compression.Compression`) stores
    every chunk as one zstd frame (safetensors dtype ``U8``); the frames of one
    file are built before its header, so with compression a file should hold a
    bounded amount of data (the save path uses one chunk cap per file).
    ``fsync`` makes each data file durable before :meth:`commit` can reference it.
    ``direct_io`` writes local files with ``O_DIRECT`` (see ``direct_io.py``).
    ``column_strips``: which uncompressed matrix chunks are stored as column
    strips -- ``"cut"`` (those whose columns the saved layout cut, e.g. by
    ``RowwiseParallel``), ``"all"`` (also chunks of whole rows: a checkpoint
    to be loaded under tensor parallelism it was not saved with, at the price
    of a copy per striped chunk on every load), ``"off"``; ``max_strips``
    bounds the strips of one chunk.
    """

    def __init__(self, storage: Storage, *, compression: Compression | None = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, fsync: bool = True, direct_io: bool = True,
                 column_strips: str = "cut", max_strips: int = DEFAULT_MAX_STRIPS) -> None:
        if block_bytes <= 0 or block_bytes % 8:
            raise ValueError("block_bytes must be a positive multiple of 8")
        if column_strips not in COLUMN_STRIPS:
            raise ValueError(f"column_strips must be one of {COLUMN_STRIPS}, got {column_strips!r}")
        self.storage = storage
        self.max_strips = 0 if column_strips == "off" else max_strips
        self.strip_whole_rows = column_strips == "all"
        self.compression = compression
        self.block_bytes = block_bytes
        self.fsync = fsync
        self.direct_io = direct_io

    def write_file(self, name: str, chunks: Sequence[WriteChunk], writer: int = 0) -> WrittenFile:
        """Write ``chunks`` (in order) into data file ``name``; return their records.

        Uncompressed matrix chunks that ``column_strips`` selects (by default,
        those whose columns the layout cut) and that span more than two
        checksum blocks are stored as column strips (one safetensors entry
        ``<key>#<strip>`` each, see ``geometry/strips.py``); a compressed chunk
        is one frame, read whole anyway, so it never is.
        """
        keys = [chunk_key(c.fqn, c.offsets) for c in chunks]
        frames: list[bytes] | None = None
        widths: list[int | None] = [None] * len(chunks)
        parts: list[list[tuple[str, Box]]] = [[(k, (tuple(c.offsets), tuple(c.shape)))] for k, c in zip(keys, chunks)]
        blocks = [self.block_bytes] * len(chunks)
        if self.compression is not None:
            level = self.compression.level
            frames = [zstd_compress(as_bytes(c.materialize()), level) for c in chunks]
            entries = [(k, "U8", (len(f),), len(f)) for k, f in zip(keys, frames)]
        else:
            for i, (k, c) in enumerate(zip(keys, chunks)):
                widths[i] = strip_width(c.columns, c.shape, itemsize(c.dtype), self.block_bytes, self.max_strips,
                                        cut_only=not self.strip_whole_rows)
                if widths[i] is not None:  # one entry per strip, blocks scaled to the strip's width
                    parts[i] = [(f"{k}#{j}", box) for j, box in enumerate(_strips_of(c, widths[i]))]
                    blocks[i] = strip_block(self.block_bytes, widths[i], c.shape[1], itemsize(c.dtype))
            entries = [(key, dtype_to_code(c.dtype), box[1], math.prod(box[1]) * itemsize(c.dtype))
                       for c, chunk_parts in zip(chunks, parts) for key, box in chunk_parts]
        entry_blocks = {key: block for chunk_parts, block in zip(parts, blocks) for key, _ in chunk_parts}

        def produce(f: Any) -> tuple[Any, dict[str, list[int]]]:
            stream = SafetensorsStreamWriter(f, entries, DATA_FILE_METADATA, self._block_for,
                                             None if frames is not None else entry_blocks)
            for i, (key, chunk) in enumerate(zip(keys, chunks)):
                if frames is not None:
                    stream.write(key, frames[i])
                    continue
                data = chunk.materialize()
                for part_key, (offsets, shape) in parts[i]:
                    if widths[i] is not None and not is_tensor(data):
                        raise ValueError(f"chunk of {chunk.fqn!r} at {list(chunk.offsets)}: column strips are "
                                         "cut from a tensor, not from bytes")
                    if widths[i] is not None:
                        data_part = data.narrow(1, offsets[1] - chunk.offsets[1], shape[1]).contiguous()
                    else:
                        data_part = data
                    stream.write(part_key, as_bytes(data_part))
            return stream, stream.finish()

        stream, crcs = self.storage.write_stream(name, produce, fsync=self.fsync, direct=self.direct_io)
        placed = {e.key: e for e in stream.entries}
        records = []
        for chunk, key, chunk_parts, block, width in zip(chunks, keys, parts, blocks, widths):
            first, last = placed[chunk_parts[0][0]], placed[chunk_parts[-1][0]]
            nbytes = last.end - first.start
            records.append((chunk.fqn, ChunkRecord(
                tuple(chunk.offsets), tuple(chunk.shape), name, key, first.start, nbytes,
                "raw" if frames is None else "zstd", block if frames is None else max(nbytes, 1),
                tuple(c for part_key, _ in chunk_parts for c in crcs[part_key]),
                None if width is None else (1, width))))
        return WrittenFile(name, stream.size, writer, tuple(records), header_record_of(stream.header))

    @property
    def _block_for(self) -> int:
        # compressed entries are checked as one block: the frame is always read whole
        return self.block_bytes if self.compression is None else 1 << 62

    def build_manifest(self, tensors: Mapping[str, tuple[torch.dtype | str, Sequence[int]]],
                       files: Sequence[WrittenFile],
                       *, values: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
                       writer_info: Mapping[str, Any] | None = None,
                       aliases: Mapping[str, str] | None = None) -> Manifest:
        """The manifest for ``tensors`` (fqn -> dtype or its code, global shape) stored in ``files``; ``aliases``
        (tied key -> stored key) name tensors stored once under another key."""
        chunks: dict[str, list[ChunkRecord]] = {fqn: [] for fqn in tensors}
        for wf in files:
            for fqn, rec in wf.chunks:
                if fqn not in chunks:
                    raise ValueError(f"file {wf.name} holds chunks of {fqn!r}, which is not a planned tensor")
                chunks[fqn].append(rec)
        records = {fqn: TensorRecord(dtype_to_code(dtype), tuple(int(s) for s in shape),
                                     tuple(sorted(chunks[fqn], key=lambda c: c.offsets)))
                   for fqn, (dtype, shape) in tensors.items()}
        return Manifest(tensors=records, values=dict(values or {}),
                        files={wf.name: FileRecord(wf.size, wf.writer, wf.header) for wf in files},
                        meta=dict(meta or {}), writer=dict(writer_info or {}), aliases=dict(aliases or {}))

    def commit(self, manifest: Manifest, *, leftovers: Sequence[str] = ()) -> bytes:
        """The one native commit, for ``save`` and the offline writers alike: validate ``manifest``
        as a reader would, publish it atomically, then remove what the new checkpoint does not use.

        A manifest of :data:`~.index.INDEXED_FROM_CHUNKS` chunk records or more is committed as
        version 3: each writer's index file is written (under a fresh name) before the manifest that
        lists it.  Removal comes only after the commit (a crash before it leaves the old checkpoint
        whole) and takes only shardkit's own names: data and index files the manifest does not
        reference and the ``leftovers`` folders (e.g. a resume journal) -- never a file a checkpoint
        beside this one references (``siblings.py``).  It is best effort: the checkpoint is complete
        without it.
        """
        docs: dict[str, bytes] = {}
        kept = set(manifest.files)
        if sum(len(t.chunks) for t in manifest.tensors.values()) >= index.INDEXED_FROM_CHUNKS:
            manifest, docs = index.split_into_indexes(manifest, new_token())
            kept |= set(docs)
        data = index.dump_indexed_manifest(manifest) if docs else dump_manifest(manifest)
        parsed = parse_manifest(data, self.storage.where(MANIFEST_NAME))  # never commit what we could not load
        if docs:
            index.attach_indexes(parsed, docs, self.storage)
            parallel_map(lambda item: self.storage.put_atomic(*item), sorted(docs.items()),
                         DEFAULT_IO_THREADS if self.storage.parallel_requests_help else 1)
        return self._publish(data, kept, leftovers, indexed=bool(docs))

    def commit_indexed(self, manifest: Manifest, kept: Collection[str]) -> bytes:
        """The commit of a version-3 ``manifest`` whose index files its writers wrote already
        (:mod:`.summaries`): validate it as a reader would (without the chunk records, which only the
        index files hold), publish it, then remove what it does not use -- as :meth:`commit`.  ``kept``:
        every data and index file it references."""
        data = index.dump_indexed_manifest(manifest)
        parse_manifest(data, self.storage.where(MANIFEST_NAME))  # never commit what we could not load
        return self._publish(data, set(kept), (), indexed=True)

    def _publish(self, data: bytes, kept: Collection[str], leftovers: Sequence[str], *, indexed: bool) -> bytes:
        """Make the data (and index) files' names durable, write the manifest atomically, then clean up."""
        if indexed:
            self.storage.sync_dir(index.INDEX_DIR)
        self.storage.sync_dir(DATA_DIR)
        self.storage.put_atomic(MANIFEST_NAME, data)
        # after the commit, so in any order: on an object store the removal of each leftover folder and the
        # listings that find unreferenced files are requests of their own, sent together rather than in a row
        jobs = [*((self.storage.delete_tree, folder) for folder in leftovers), (self._remove_unreferenced, kept)]
        try:
            parallel_map(lambda job: job[0](job[1]), jobs, len(jobs) if self.storage.parallel_requests_help else 1)
        except Exception as exc:  # noqa: BLE001 - committed: a failed cleanup must not read as a failed save
            log.warning("committed %s, but could not remove older files: %s", self.storage.url, exc)
        return data

    def _remove_unreferenced(self, kept: Collection[str]) -> None:
        doomed = unreferenced_files(self.storage, kept)
        if doomed:  # an older save here: keep what a checkpoint beside this one references
            shared = referenced_by_siblings(self.storage)
            self.storage.delete([name for name in doomed if name not in shared])


def unreferenced_files(storage: Storage, kept: Collection[str]) -> list[str]:
    """Shardkit data and index files not in ``kept`` (left by older or interrupted saves); a file shardkit
    did not name so is never one of them."""
    folders = (DATA_DIR, index.INDEX_DIR)
    listed = parallel_map(storage.listdir, folders, len(folders) if storage.parallel_requests_help else 1)
    return [f"{folder}/{n}" for folder, names in zip(folders, listed) for n in names
            if f"{folder}/{n}" not in kept and is_native_file_name(f"{folder}/{n}")]


def check_tensors(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
    """Refuse, before anything is written, a tensor whose dtype a safetensors data file cannot hold."""
    for name, dtype, _ in tensors:
        try:
            dtype_to_code(dtype)
        except UnsupportedFormat:
            raise UnsupportedFormat(f"{name!r} is {dtype}, which --to shardkit cannot hold; exclude it "
                                    "(--exclude) or cast it (--dtype)") from None


def _strips_of(chunk: WriteChunk, width: int) -> list[Box]:
    return strip_boxes((tuple(chunk.offsets), tuple(chunk.shape)), 1, width)
