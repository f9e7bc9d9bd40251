"""The native manifest: the one JSON document that describes, and commits, a checkpoint.

Schema (versions 1, 2 and 4 without index files; docs/format.md is the full specification)::

    {"format": "shardkit", "version": 1 | 2 | 4,
     "references": ["step-0000000100", ...],   # version 4: siblings whose data files are referenced
     "meta":   {...user metadata, e.g. "step"...},
     "writer": {"world_size": 2, "mesh": {"shape": [2], "dim_names": [], "placements": [...]} | null},
     "tensors": {fqn: {"dtype": "F32", "shape": [...],
                       "chunks": [{"offsets": [...], "shape": [...], "file": "data/...safetensors",
                                   "key": "...", "start": int, "nbytes": int, "codec": "raw" | "zstd",
                                   "block": int, "crc32c": "<base64 LE uint32 per block>",
                                   "strips": [dim, width],       # optional, version 2: column strips
                                   "digest": "xxh3-128:<hex>"}]}},  # optional: of the raw bytes (dedup)
     "values": {fqn: <JSON value>},
     "aliases": {fqn: fqn of a tensor},         # optional: tied tensors, stored once
     "files":  {name: {"size": int, "writer": int,
                       "header": {"size": int, "crc32c": "<base64 LE uint32>"}}}}  # optional (headers.py)

:func:`~.manifest_parse.parse_manifest` reads a manifest back, trusting nothing.

A chunk with ``strips`` (format version 2) stores its box as consecutive
strips of ``width`` indices of dim ``dim``, each strip row-major with its own
checksum blocks: a reader that wants some columns of the chunk reads those
strips and nothing else.  :meth:`ChunkRecord.pieces` turns such a record into
one plain record per strip, so every reader, planner and checker handles plain
records only.  A manifest without strips is written as version 1, which every
shardkit reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from shardkit.checkpoint.formats.crc32c import pack_crcs
from shardkit.checkpoint.formats.native.headers import HeaderRecord, header_record_json
from shardkit.checkpoint.formats.native.references import (
    DIGEST_NAME,
    REFERENCES_VERSION,
    referenced_dirs,
)
from shardkit.checkpoint.formats.native.regions import (
    Regions,
    Rule,
    by_writer,
    overlapping_writers,
    rule_by_writer,
    rule_overlapping_writers,
)
from shardkit.checkpoint.formats.safetensors import SafetensorsEntry
from shardkit.checkpoint.geometry.boxes import Box
from shardkit.checkpoint.geometry.strips import strip_boxes

__all__ = ["FORMAT_NAME", "VERSION", "STRIPS_VERSION", "INDEXED_VERSION", "IndexRecord", "MANIFEST_NAME", "crc_count",
           "CODECS", "ChunkRecord", "TensorRecord", "FileRecord", "Manifest", "dump_manifest"]

FORMAT_NAME = "shardkit"
VERSION = 4            # the highest version this shardkit reads
STRIPS_VERSION = 2     # the first version whose chunks may carry ``strips``
INDEXED_VERSION = 3    # the first version whose chunk records live in per-writer index files
MANIFEST_NAME = "manifest.json"
CODECS = ("raw", "zstd")


@dataclass(frozen=True)
class ChunkRecord:
    """One stored chunk: a box of a tensor, and where its bytes are."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    key: str
    start: int                 # absolute byte offset of the stored bytes in ``file``
    nbytes: int                # stored (possibly compressed) length
    codec: str                 # "raw" or "zstd"
    block: int                 # checksum block size in bytes (over the stored bytes)
    crc32c: tuple[int, ...]    # one crc32c per block (per block of each strip, strip after strip)
    strips: tuple[int, int] | None = None  # (dim, width): stored as column strips, see the module docstring
    digest: str | None = None  # "<algorithm>:<hex>" of the raw bytes, written for dedup (references.py)

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.shape

    def pieces(self) -> tuple["ChunkRecord", ...]:
        """The record as plain (strip-free) records: itself, or one per strip, each a row-major box
        with its own bytes and checksum blocks (safetensors key ``<key>#<strip>``)."""
        if self.strips is None:
            return (self,)
        out = []
        start, first = self.start, 0
        item = self.nbytes // math.prod(self.shape)
        for j, (offsets, shape) in enumerate(strip_boxes(self.box, *self.strips)):
            nbytes = math.prod(shape) * item
            count = _blocks(nbytes, self.block)
            out.append(ChunkRecord(offsets, shape, self.file, f"{self.key}#{j}", start, nbytes, self.codec,
                                   self.block, self.crc32c[first:first + count]))
            start, first = start + nbytes, first + count
        return tuple(out)

    def stored_entries(self, dtype: str) -> tuple[SafetensorsEntry, ...]:
        """The safetensors entries that hold this chunk in its data file (one per strip), for a tensor
        of dtype code ``dtype``: a ``zstd`` frame is a ``U8`` entry of its length."""
        return tuple(SafetensorsEntry(p.key, dtype if p.codec == "raw" else "U8",
                                      p.shape if p.codec == "raw" else (p.nbytes,), p.start, p.start + p.nbytes)
                     for p in self.pieces())

    def to_json(self) -> dict[str, Any]:
        return {"offsets": list(self.offsets), "shape": list(self.shape), "file": self.file, "key": self.key,
                "start": self.start, "nbytes": self.nbytes, "codec": self.codec, "block": self.block,
                "crc32c": pack_crcs(self.crc32c), **({"strips": list(self.strips)} if self.strips else {}),
                **({DIGEST_NAME: self.digest} if self.digest else {})}


def crc_count(box: tuple[tuple[int, ...], tuple[int, ...]], nbytes: int, block: int,
              strips: tuple[int, int] | None) -> int:
    """How many checksum blocks a chunk record of ``box`` carries: one per ``block`` stored bytes (at least
    one), counted strip by strip when the chunk is stored as strips."""
    if strips is None:
        return _blocks(nbytes, block)
    item = nbytes // math.prod(box[1])
    return sum(_blocks(math.prod(s) * item, block) for _, s in strip_boxes(box, *strips))


def _blocks(nbytes: int, block: int) -> int:
    return max(1, -(-nbytes // block))


@dataclass(frozen=True)
class TensorRecord:
    dtype: str                 # safetensors dtype code
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True)
class FileRecord:
    size: int
    writer: int = 0
    header: HeaderRecord | None = None  # the safetensors header's size and crc32c; None: not recorded


@dataclass(frozen=True)
class IndexRecord:
    """A writer's index file (version 3): its size and crc32c, checked before it is parsed."""

    size: int
    crc32c: int
    writer: int


@dataclass(frozen=True)
class Manifest:
    tensors: dict[str, TensorRecord]
    values: dict[str, Any] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    writer: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION     # as read; dump_manifest writes the lowest version that holds the manifest
    aliases: dict[str, str] = field(default_factory=dict)  # tied key -> the key whose tensor it is
    # version 3 (see index.py): rules, each tensor's rule index or listed regions, the index files; and
    # whether every index file's chunk records are in ``tensors`` (a loading rank reads only some)
    rules: tuple[Rule, ...] = ()
    regions: dict[str, int | Regions] = field(default_factory=dict)
    indexes: dict[str, IndexRecord] = field(default_factory=dict)
    complete: bool = True
    references: tuple[str, ...] = ()  # version 4: sibling directories whose data files this one reads

    def regions_by_writer(self, fqn: str) -> Mapping[int, Sequence[Box]]:
        """Which writer stored which boxes of ``fqn`` (version 3; computed once per shape and rule)."""
        found = self.regions[fqn]
        shape = self.tensors[fqn].shape
        return rule_by_writer(shape, self.rules[found]) if isinstance(found, int) else by_writer(found)

    def writers_of(self, fqn: str, boxes: Sequence[Box]) -> set[int]:
        """The writers whose regions of ``fqn`` meet any of ``boxes`` (computed once per shape, rule and boxes)."""
        found = self.regions[fqn]
        if isinstance(found, int):
            return set(rule_overlapping_writers(self.tensors[fqn].shape, self.rules[found], tuple(boxes)))
        return overlapping_writers(found, boxes)


def dump_manifest(manifest: Manifest) -> bytes:
    """Serialise (deterministic key order within each tensor, compact), as the lowest format version that
    holds it: version 1 unless a chunk is stored as strips, so older readers keep reading what they can.
    (A version-3 manifest, whose records are in index files, is dumped by :mod:`.index`.)"""
    striped = any(c.strips for t in manifest.tensors.values() for c in t.chunks)
    references = referenced_dirs(manifest.files)
    doc = {
        "format": FORMAT_NAME,
        "version": REFERENCES_VERSION if references else STRIPS_VERSION if striped else 1,
        **({"references": list(references)} if references else {}),
        "meta": manifest.meta,
        "writer": manifest.writer,
        "tensors": {fqn: {"dtype": t.dtype, "shape": list(t.shape), "chunks": [c.to_json() for c in t.chunks]}
                    for fqn, t in manifest.tensors.items()},
        "values": manifest.values,
        **({"aliases": dict(manifest.aliases)} if manifest.aliases else {}),
        "files": {name: {"size": f.size, "writer": f.writer,
                         **({"header": header_record_json(f.header)} if f.header else {})}
                  for name, f in manifest.files.items()},
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
