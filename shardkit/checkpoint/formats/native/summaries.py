"""A save's version-3 commit in two parts: each writer writes its own index file, rank 0 a manifest of summaries.

Rank 0 of a large job cannot afford the chunk records: a 70B model saved by
1,024 ranks has millions of them, and turning them into index files on one
rank takes minutes.  So each writer, once its data files are written,

1. checks that its chunks tile exactly its **regions** (the boxes it was
   assigned to store, per tensor) and writes its index file
   (:func:`write_index`, the same document :mod:`.index` describes), and
2. sends rank 0 a :class:`WriterSummary`: the index file's name, size and
   crc32c, its data files' names and sizes, and its regions -- compressed to
   *claims*: "I stored what my coordinate ``c`` on the mesh of layout ``i``
   holds" (:func:`claims_of`), with only the tensors where that is not so
   listed box by box.

Rank 0 turns the summaries into the version-3 manifest
(:func:`manifest_from_summaries`): each layout's claims become one rule (the
writer of each mesh coordinate), the rest is listed; then it checks what it
can without the chunk records -- that every tensor's regions tile it, that no
two writers name the same file -- and commits.  Its work and memory grow
with tensors plus writers, not with chunks.  A reader checks each index file
against the manifest again (:func:`~.index.attach_indexes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from shardkit.checkpoint.formats.crc32c import crc32c
from shardkit.checkpoint.formats.native.headers import header_record_json
from shardkit.checkpoint.formats.native.index import index_document, index_file_name
from shardkit.checkpoint.formats.native.manifest import INDEXED_VERSION, IndexRecord, Manifest, TensorRecord
from shardkit.checkpoint.formats.native.references import REFERENCES_VERSION, referenced_dirs
from shardkit.checkpoint.formats.native.regions import (
    Regions,
    Rule,
    chunks_problem,
    coordinate_boxes,
    regions_problem,
    rule_problem,
)
from shardkit.checkpoint.formats.native.writer import WrittenFile
from shardkit.checkpoint.geometry.boxes import Box
from shardkit.checkpoint.geometry.placements import Spec
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CheckpointError

__all__ = ["Layout", "Claim", "WriterSummary", "claims_of", "write_index", "manifest_from_summaries"]

Layout = tuple[tuple[int, ...], tuple[Spec, ...], tuple[str, ...]]  # (mesh shape, specs, fqns saved so)
Claim = tuple[int, tuple[int, ...]]                                 # (layout index, mesh coordinate)


@dataclass(frozen=True)
class WriterSummary:
    """What one writer tells the committing rank about its part of a version-3 save."""

    writer: int
    index: str | None                 # its index file (None: it stored nothing)
    record: IndexRecord | None        # the index file's size and crc32c
    files: dict[str, int] = field(default_factory=dict)   # its data files (and references): name -> size
    claims: tuple[Claim, ...] = ()
    listed: dict[str, tuple[Box, ...]] = field(default_factory=dict)  # regions no claim gives

    def to_json(self) -> dict[str, Any]:
        return {"writer": self.writer, "index": self.index,
                "record": None if self.record is None else [self.record.size, self.record.crc32c],
                "files": self.files, "claims": [[i, list(c)] for i, c in self.claims],
                "listed": {fqn: [[list(b[0]), list(b[1])] for b in boxes] for fqn, boxes in self.listed.items()}}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "WriterSummary":
        """Inverse of :meth:`to_json` (sent between ranks; the manifest built from it is validated again)."""
        record = doc["record"]
        return cls(doc["writer"], doc["index"], None if record is None else IndexRecord(*record, doc["writer"]),
                   dict(doc["files"]), tuple((i, tuple(c)) for i, c in doc["claims"]),
                   {fqn: tuple((tuple(o), tuple(s)) for o, s in boxes) for fqn, boxes in doc["listed"].items()})


def claims_of(layouts: Sequence[Layout], coords: Sequence[tuple[int, ...] | None],
              shapes: Mapping[str, tuple[int, ...]], regions: Mapping[str, Sequence[Box]]
              ) -> tuple[tuple[Claim, ...], dict[str, tuple[Box, ...]]]:
    """A writer's ``regions`` (fqn -> the boxes it stored) as claims plus what is listed.

    ``coords[i]``: the writer's coordinate on the mesh of ``layouts[i]`` (``None``: not on it).  The
    writer claims a layout when, for at least one of its tensors, it stored exactly what its coordinate
    holds; the tensors of that layout where it did not (a box another rank wrote, say) are listed, as
    is every region outside a claimed layout."""
    claims: list[Claim] = []
    listed: dict[str, tuple[Box, ...]] = {}
    in_layouts: set[str] = set()
    for i, ((mesh, specs, fqns), coord) in enumerate(zip(layouts, coords)):
        fqns = tuple(f for f in fqns if f in shapes)
        in_layouts.update(fqns)
        held = {f: coordinate_boxes(shapes[f], mesh, coord, specs) for f in fqns} if coord is not None else {}
        same = {f for f in held if set(regions.get(f, ())) == set(held[f])}
        if any(held[f] for f in same):
            claims.append((i, tuple(coord)))
            listed.update((f, tuple(regions.get(f, ()))) for f in fqns if f not in same)
        else:
            listed.update((f, tuple(regions[f])) for f in fqns if regions.get(f))
    listed.update((f, tuple(boxes)) for f, boxes in regions.items() if f not in in_layouts and boxes)
    return tuple(claims), listed


def write_index(storage: Storage, token: str, writer: int, files: Sequence[WrittenFile],
                regions: Mapping[str, Sequence[Box]]) -> tuple[str, IndexRecord]:
    """Write ``writer``'s index file of ``files`` after checking that their chunks tile exactly its
    ``regions`` (what the manifest will say it stored); return its name and record."""
    name = index_file_name(token, writer)
    records: dict[str, list[dict[str, Any]]] = {}
    boxes: dict[str, list[tuple[int, Box]]] = {}
    for f in files:
        for fqn, rec in f.chunks:
            records.setdefault(fqn, []).append(rec.to_json())
            boxes.setdefault(fqn, []).append((writer, rec.box))
    for fqn in sorted(set(boxes) | set(regions)):
        if _row_slabs(regions.get(fqn, ()), boxes.get(fqn, [])):
            continue
        problem = chunks_problem({writer: tuple(regions.get(fqn, ()))}, boxes.get(fqn, []), (writer,))
        if problem:
            raise CheckpointError(f"{storage.where(name)}: writer {writer}'s chunks of {fqn!r} do not tile the "
                                  f"regions it was assigned: {problem}; nothing was committed")
    data = index_document(writer, {f.name: f.size for f in files},
                          {f.name: header_record_json(f.header) for f in files if f.header is not None}, records)
    storage.put_atomic(name, data)
    return name, IndexRecord(len(data), crc32c(data), writer)


def _row_slabs(regions: Sequence[Box], chunks: Sequence[tuple[int, Box]]) -> bool:
    """Whether ``chunks`` cut one region into consecutive slabs along dim 0, in order -- how a save cuts a
    box at its chunk size, checked in one pass (else :func:`~.regions.chunks_problem` decides)."""
    if len(regions) != 1 or not chunks:
        return False
    if len(chunks) == 1 and chunks[0][1] == tuple(regions[0]):
        return True  # the region whole (a scalar among them)
    if not regions[0][1]:
        return False
    (offsets, shape), row = regions[0], regions[0][0][0]
    for _, (o, s) in chunks:
        if o[0] != row or o[1:] != offsets[1:] or s[1:] != shape[1:] or s[0] <= 0:
            return False
        row += s[0]
    return row == offsets[0] + shape[0]


def _grids(layouts: Sequence[Layout], summaries: Sequence[WriterSummary]) -> tuple[list[list[int]], set[int]]:
    """Each layout's writer per mesh coordinate (row-major) from the claims, replicas filled in with the
    writer of the copy that was stored; and the layouts two writers claimed the same coordinate of."""
    grids = [[-1] * math.prod(mesh) for mesh, _, _ in layouts]
    clashes: set[int] = set()
    for s in summaries:
        for i, coord in s.claims:
            mesh = layouts[i][0]
            at = sum(c * math.prod(mesh[d + 1:]) for d, c in enumerate(coord))
            if grids[i][at] >= 0:
                clashes.add(i)
            grids[i][at] = s.writer
    for i, (mesh, specs, _) in enumerate(layouts):
        sharding = [d for d, spec in enumerate(specs) if spec[0] != "replicate"]
        stored: dict[tuple[int, ...], set[int]] = {}
        coords = [tuple((at // math.prod(mesh[d + 1:])) % mesh[d] for d in range(len(mesh)))
                  for at in range(len(grids[i]))]
        for c, writer in zip(coords, grids[i]):
            if writer >= 0:
                stored.setdefault(tuple(c[d] for d in sharding), set()).add(writer)
        for at, c in enumerate(coords):
            found = stored.get(tuple(c[d] for d in sharding), set())
            if grids[i][at] < 0 and len(found) == 1:
                grids[i][at] = next(iter(found))
    return grids, clashes


def manifest_from_summaries(tensors: Mapping[str, tuple[str, tuple[int, ...]]], layouts: Sequence[Layout],
                            summaries: Sequence[WriterSummary], *, values: Mapping[str, Any],
                            meta: Mapping[str, Any] | None, writer_info: Mapping[str, Any],
                            aliases: Mapping[str, str], where: str) -> tuple[Manifest, set[str]]:
    """Rank 0's part: the version-3 manifest of ``tensors`` (fqn -> dtype code, shape) from the writers'
    summaries, and every file it keeps (data and index files).  Refuses, naming the tensor or file,
    regions that do not tile a tensor and a file two writers name."""
    grids, clashes = _grids(layouts, summaries)
    layout_of = {f: i for i, (_, _, fqns) in enumerate(layouts) for f in fqns}
    listed: dict[str, list[tuple[int, Box]]] = {}
    for s in summaries:
        for fqn, boxes in s.listed.items():
            listed.setdefault(fqn, []).extend((s.writer, b) for b in boxes)
    rules: dict[Rule, int] = {}
    regions: dict[str, int | Regions] = {}
    for fqn, (_, shape) in tensors.items():
        i = layout_of.get(fqn)
        if i is not None and i not in clashes and fqn not in listed:
            rule = (layouts[i][0], layouts[i][1], tuple(grids[i]))
            regions[fqn] = rules.setdefault(rule, len(rules))
            problem = rule_problem(shape, rule)
        else:
            found = listed.get(fqn, [])
            if i is not None:  # what the claimants of its layout stored, and did not list
                mesh, specs, _ = layouts[i]
                found += [(s.writer, box) for s in summaries if fqn not in s.listed
                          for j, c in s.claims if j == i for box in coordinate_boxes(shape, mesh, c, specs)]
            regions[fqn] = tuple(found)
            problem = regions_problem(shape, regions[fqn])
        if problem:
            raise CheckpointError(f"{where}: the writers' regions of {fqn!r} do not tile it: {problem}; nothing "
                                  f"was committed")
    indexes: dict[str, IndexRecord] = {}
    kept: set[str] = set()
    for s in summaries:
        if s.index is not None and s.record is not None:
            indexes[s.index] = s.record
        for name in s.files:
            if name in kept:
                raise CheckpointError(f"{where}: two writers name the data file {name}; nothing was committed")
            kept.add(name)
    references = referenced_dirs(kept)
    manifest = Manifest(tensors={fqn: TensorRecord(code, shape, ()) for fqn, (code, shape) in tensors.items()},
                        values=dict(values), meta=dict(meta or {}), writer=dict(writer_info),
                        version=REFERENCES_VERSION if references else INDEXED_VERSION, aliases=dict(aliases),
                        rules=tuple(rules), regions=regions, indexes=indexes, complete=False, references=references)
    return manifest, kept | set(indexes)
