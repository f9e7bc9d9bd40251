"""Version 3's per-writer index files: chunk records where only the ranks that need them read them.

A checkpoint saved by many ranks has chunk records in proportion to tensors
times ranks.  In one ``manifest.json`` every loading rank would read and parse
all of them (hundreds of MB for a 70B model saved at 1,024 ranks).  Version 3
moves them into one index file per writer::

    index/<token>-<writer>.json   {"format": "shardkit-index", "version": 3, "writer": 5,
                                   "files": {"data/<token>-5-0.safetensors": 123456, ...},
                                   "headers": {"data/<token>-5-0.safetensors": {"size", "crc32c"}, ...},
                                   "chunks": {fqn: [chunk record, ...]}}

(``headers``, optional: each data file's header record, :mod:`.headers`; ``files`` keeps plain sizes, which
every version-3 reader knows.)

and ``manifest.json`` lists each index file with its size and crc32c (checked
before it is parsed) and says per tensor which writer stored which box
(:mod:`~shardkit.checkpoint.formats.native.regions`).  A loading rank reads
the manifest, works out which writers' regions meet the boxes it needs and
reads only their index files (:func:`needed_indexes`); the offline tools read
all of them, and then see the same :class:`Manifest` as from a version 1 or 2
checkpoint.  Every chunk must lie in a region of its writer, and each region
must be tiled exactly by its writer's chunks, so a partial read is as safe
as a whole one.

Small checkpoints stay in one file (version 1 or 2, readable by every
shardkit): the index files are written once the chunk records reach
:data:`INDEXED_FROM_CHUNKS`.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Sequence

from shardkit.checkpoint.formats.crc32c import crc32c, pack_crcs
from shardkit.checkpoint.formats.native.fields import expect_object, json_object
from shardkit.checkpoint.formats.native.headers import header_record_json, parse_header_record
from shardkit.checkpoint.formats.native.manifest import (
    FORMAT_NAME,
    INDEXED_VERSION,
    ChunkRecord,
    FileRecord,
    IndexRecord,
    Manifest,
    TensorRecord,
)
from shardkit.checkpoint.formats.native.manifest_parse import parse_chunk
from shardkit.checkpoint.formats.native.ownership import INDEX_DIR
from shardkit.checkpoint.formats.native.references import REFERENCES_VERSION, check_file_name, referenced_dirs
from shardkit.checkpoint.formats.native.regions import chunks_problem, derive_regions
from shardkit.checkpoint.geometry.boxes import Box, check_cover
from shardkit.checkpoint.io.concurrency import parallel_map
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CheckpointNotFound, CorruptCheckpoint, InvalidManifest

__all__ = ["INDEX_DIR", "INDEX_FORMAT", "INDEXED_FROM_CHUNKS", "is_indexed", "index_file_name", "index_document",
           "split_into_indexes",
           "read_indexes", "attach_indexes", "needed_indexes", "dump_indexed_manifest"]

INDEX_FORMAT = "shardkit-index"
INDEXED_FROM_CHUNKS = 4096  # chunk records from which a manifest moves them into index files


def is_indexed(chunk_records: int) -> bool:
    """Whether a checkpoint of ``chunk_records`` chunk records keeps them in index files (version 3)."""
    return chunk_records >= INDEXED_FROM_CHUNKS


def index_file_name(token: str, writer: int) -> str:
    return f"{INDEX_DIR}/{token}-{writer}.json"


def _candidates(manifest: Manifest) -> dict[str, list[tuple[tuple[int, ...], tuple]]]:
    """Layouts each tensor may have been saved with: the job's recorded layout, then one writer per
    ``Shard(0)`` row range over the world or over the writers (how the offline tools write: a
    ``--mesh RxS`` output has S writers)."""
    out: dict[str, list] = {}
    layouts = manifest.writer.get("layouts")
    for layout in layouts if isinstance(layouts, list) else ():
        try:
            mesh = tuple(int(n) for n in layout["mesh"]["shape"])
            specs = tuple(tuple(s) for s in layout["specs"])
        except (KeyError, TypeError, ValueError):
            continue
        for fqn in layout.get("tensors", ()):
            out.setdefault(fqn, []).append((mesh, specs))
    world = manifest.writer.get("world_size")
    sizes = {world if isinstance(world, int) and world > 0 else 0, len({f.writer for f in manifest.files.values()})}
    for fqn, t in manifest.tensors.items():
        if t.shape:
            out.setdefault(fqn, []).extend(((n,), (("shard", 0),)) for n in sorted(sizes, reverse=True) if n)
    return out


def index_document(writer: int, files: Mapping[str, int], headers: Mapping[str, Any],
                   chunks: Mapping[str, Sequence[Mapping[str, Any]]]) -> bytes:
    """The bytes of ``writer``'s index file: its data files (name -> size), their header records
    (name -> JSON, :mod:`.headers`) and its chunk records (fqn -> JSON records)."""
    return json.dumps({"format": INDEX_FORMAT, "version": INDEXED_VERSION, "writer": writer, "files": dict(files),
                       **({"headers": dict(headers)} if headers else {}), "chunks": dict(chunks)},
                      separators=(",", ":"), allow_nan=False).encode("utf-8")


def split_into_indexes(manifest: Manifest, token: str) -> tuple[Manifest, dict[str, bytes]]:
    """``manifest`` (every chunk record in it) as version 3: the manifest to commit, and each writer's
    index file (name -> bytes) to write before it."""
    chunks: dict[str, list[tuple[int, Box]]] = {}
    per_writer: dict[int, tuple[dict[str, int], dict[str, list[dict[str, Any]]], dict[str, Any]]] = {}
    for fqn, t in manifest.tensors.items():
        for c in t.chunks:
            writer = manifest.files[c.file].writer
            chunks.setdefault(fqn, []).append((writer, c.box))
            per_writer.setdefault(writer, ({}, {}, {}))[1].setdefault(fqn, []).append(c.to_json())
    for name, f in manifest.files.items():
        per_writer.setdefault(f.writer, ({}, {}, {}))[0][name] = f.size
        if f.header is not None:
            per_writer[f.writer][2][name] = header_record_json(f.header)
    rules, regions = derive_regions({fqn: t.shape for fqn, t in manifest.tensors.items()}, chunks,
                                    _candidates(manifest))
    docs: dict[str, bytes] = {}
    indexes: dict[str, IndexRecord] = {}
    for writer, (files, records, headers) in sorted(per_writer.items()):
        name = index_file_name(token, writer)
        docs[name] = index_document(writer, files, headers, records)
        indexes[name] = IndexRecord(len(docs[name]), crc32c(docs[name]), writer)
    references = referenced_dirs(manifest.files)
    indexed = Manifest(tensors={fqn: TensorRecord(t.dtype, t.shape, ()) for fqn, t in manifest.tensors.items()},
                       values=manifest.values, meta=manifest.meta, writer=manifest.writer,
                       version=REFERENCES_VERSION if references else INDEXED_VERSION, aliases=manifest.aliases,
                       rules=tuple(rules), regions=regions, indexes=indexes, complete=False, references=references)
    return indexed, docs


def dump_indexed_manifest(manifest: Manifest) -> bytes:
    """A version-3 ``manifest.json``: no chunk records and no file list (the index files hold them), regions
    by rule or listed."""
    def regions(fqn: str) -> dict[str, Any]:
        found = manifest.regions[fqn]
        if isinstance(found, int):
            return {"rule": found}
        return {"regions": [[w, list(box[0]), list(box[1])] for w, box in found]}

    doc = {
        "format": FORMAT_NAME, "version": REFERENCES_VERSION if manifest.references else INDEXED_VERSION,
        **({"references": list(manifest.references)} if manifest.references else {}),
        "meta": manifest.meta, "writer": manifest.writer,
        "rules": [{"mesh": list(mesh), "placements": [list(s) for s in specs], "writers": list(writers)}
                  for mesh, specs, writers in manifest.rules],
        "tensors": {fqn: {"dtype": t.dtype, "shape": list(t.shape), **regions(fqn)}
                    for fqn, t in manifest.tensors.items()},
        "values": manifest.values,
        **({"aliases": dict(manifest.aliases)} if manifest.aliases else {}),
        "indexes": {name: {"size": i.size, "crc32c": pack_crcs([i.crc32c]), "writer": i.writer}
                    for name, i in manifest.indexes.items()},
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def needed_indexes(manifest: Manifest, wanted: Mapping[str, Sequence[Box]]) -> list[str]:
    """The index files whose writers stored any part of the ``wanted`` boxes (fqn -> boxes)."""
    writers: set[int] = set()
    for fqn, boxes in wanted.items():
        fqn = manifest.aliases.get(fqn, fqn)
        if fqn in manifest.regions:
            writers |= manifest.writers_of(fqn, boxes)
    return sorted(name for name, rec in manifest.indexes.items() if rec.writer in writers)


def read_indexes(storage: Storage, manifest: Manifest, names: Iterable[str], io_threads: int = 8
                 ) -> dict[str, bytes]:
    """The bytes of each named index file, each checked against the size and crc32c the manifest records."""
    def fetch(name: str) -> tuple[str, bytes]:
        rec = manifest.indexes[name]
        try:
            data = storage.read_bytes(name)
        except CheckpointNotFound:
            raise CorruptCheckpoint(f"{storage.where(name)} is missing; the checkpoint is incomplete -- restore "
                                    f"the file or load another checkpoint") from None
        if len(data) != rec.size or crc32c(data) != rec.crc32c:
            raise CorruptCheckpoint(f"{storage.where(name)} has {len(data)} bytes and crc32c {crc32c(data):08x}, "
                                    f"the manifest records {rec.size} and {rec.crc32c:08x}: the index file is damaged "
                                    f"or was replaced")
        return name, data

    todo = sorted(set(names))
    return dict(parallel_map(fetch, todo, io_threads if storage.parallel_requests_help and len(todo) >= 2 else 1))


def attach_indexes(manifest: Manifest, docs: Mapping[str, bytes], storage: Storage) -> Manifest:
    """``manifest`` with the chunk records and data files of the index files in ``docs`` (fetched by
    :func:`read_indexes`), all checked; complete when ``docs`` holds every index file."""
    files: dict[str, FileRecord] = dict(manifest.files)
    found: dict[str, list[ChunkRecord]] = {fqn: list(t.chunks) for fqn, t in manifest.tensors.items()}
    writers: dict[str, list[tuple[int, Box]]] = {}
    for name, data in sorted(docs.items()):
        where = storage.where(name)
        writer = manifest.indexes[name].writer
        doc = json_object(data, where)
        if (doc.get("format") != INDEX_FORMAT or type(doc.get("version")) is not int
                or doc["version"] != INDEXED_VERSION or type(doc.get("writer")) is not int or doc["writer"] != writer):
            raise InvalidManifest(f"{where} is not the version-{INDEXED_VERSION} index file of writer {writer}")
        mine: dict[str, FileRecord] = {}
        headers = expect_object(doc.get("headers", {}), f"{where}: headers")
        for file, size in expect_object(doc.get("files"), f"{where}: files").items():
            check_file_name(file, f"{where}: files", manifest.version)
            if type(size) is not int or size < 0 or file in files:
                raise InvalidManifest(f"{where}: file {file!r} has a bad size {size!r} or is listed twice")
            mine[file] = FileRecord(size, writer, parse_header_record(headers.get(file), size, f"{where}: {file!r}"))
        if set(headers) - set(mine):
            raise InvalidManifest(f"{where}: headers of files {sorted(set(headers) - set(mine))[:3]}, which its "
                                  f"files do not list")
        files.update(mine)
        for fqn, records in expect_object(doc.get("chunks"), f"{where}: chunks").items():
            t = manifest.tensors.get(fqn)
            if t is None:
                raise InvalidManifest(f"{where}: chunks of {fqn!r:.200}, which the manifest holds no tensor of")
            if not isinstance(records, list):
                raise InvalidManifest(f"{where}: the chunks of {fqn!r:.200} must be a list")
            for i, c in enumerate(records):
                rec = parse_chunk(expect_object(c, where), f"{where}: {fqn!r} chunk {i}", t.shape, t.dtype, mine,
                                  manifest.version)
                found[fqn].append(rec)
                writers.setdefault(fqn, []).append((writer, rec.box))
    unlisted = set(referenced_dirs(files)) - set(manifest.references)
    if unlisted:
        raise InvalidManifest(f"{storage.where('manifest.json')}: index files reference {sorted(unlisted)[:3]}, "
                              f"which the manifest's 'references' does not list")
    complete = set(docs) >= set(manifest.indexes)
    loaded = {manifest.indexes[name].writer for name in docs}
    tensors = {}
    for fqn, t in manifest.tensors.items():
        at = f"{storage.where('manifest.json')}: tensor {fqn!r}"
        problem = chunks_problem(manifest.regions_by_writer(fqn), writers.get(fqn, []), loaded)
        if problem is None and complete:
            problem = check_cover(t.shape, [c.box for c in found[fqn]])
        if problem:
            raise InvalidManifest(f"{at}: the index files disagree with the manifest's regions: {problem}")
        tensors[fqn] = TensorRecord(t.dtype, t.shape, tuple(sorted(found[fqn], key=lambda c: c.offsets)))
    return Manifest(tensors=tensors, values=manifest.values, files=files, meta=manifest.meta, writer=manifest.writer,
                    version=manifest.version, aliases=manifest.aliases, rules=manifest.rules,
                    regions=manifest.regions, indexes=manifest.indexes, complete=complete,
                    references=manifest.references)
