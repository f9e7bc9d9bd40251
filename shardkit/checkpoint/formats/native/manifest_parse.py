"""Reading a native manifest back: :func:`parse_manifest` and the checks of its every record.

:func:`parse_manifest` trusts nothing: it bounds the document, checks every
type, refuses unknown (future) versions, refuses file names that leave the
checkpoint, checks every chunk lies inside its tensor and its file, that raw
chunk lengths match shape x dtype, that checksum lists have one entry per
block, that the chunks of every tensor tile it exactly, and that every alias
names a stored tensor (so no chains and no cycles) and no key is two things.
After it returns, readers can plan and read without further checks except
the checksums (and each data file's header, :mod:`.headers`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from shardkit.checkpoint.formats.crc32c import unpack_crcs
from shardkit.checkpoint.formats.dtypes import code_itemsize
from shardkit.checkpoint.formats.native.fields import (
    MAX_NDIM,
    expect_object,
    int_field,
    ints_field,
    json_object,
    list_field,
)
from shardkit.checkpoint.formats.native.headers import parse_header_record
from shardkit.checkpoint.formats.native.manifest import (
    CODECS,
    FORMAT_NAME,
    INDEXED_VERSION,
    STRIPS_VERSION,
    VERSION,
    ChunkRecord,
    FileRecord,
    IndexRecord,
    Manifest,
    TensorRecord,
    crc_count,
)
from shardkit.checkpoint.formats.native.references import (
    DIGEST_NAME,
    REFERENCES_VERSION,
    check_file_name,
    parse_digest,
    parse_references,
    referenced_dirs,
)
from shardkit.checkpoint.formats.native.regions import (
    Regions,
    Rule,
    regions_problem,
    rule_boxes,
    rule_problem,
)
from shardkit.checkpoint.geometry.boxes import check_cover
from shardkit.errors import InvalidManifest, UnsupportedVersion

__all__ = ["parse_manifest", "parse_chunk", "MAX_RULE_BOXES", "MAX_REGION_BOXES"]

_MAX_KEY = 4096  # the longest alias key


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and fully validate manifest bytes read from ``where`` (a URL, for messages)."""
    doc = json_object(data, where)
    if doc.get("format") != FORMAT_NAME:
        raise InvalidManifest(f"{where} is not a shardkit manifest (format {doc.get('format')!r})")
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise InvalidManifest(f"{where} has an invalid version {version!r}")
    if version > VERSION:
        raise UnsupportedVersion(f"{where} was written by format version {version}; this shardkit reads up to "
                                 f"version {VERSION}. Upgrade shardkit to load it.")
    indexed = _parse_indexed(doc, where) if version == INDEXED_VERSION or (
        version >= REFERENCES_VERSION and "indexes" in doc) else {}
    references = parse_references(doc.get("references", []), where)
    files: dict[str, FileRecord] = {}
    for name, info in expect_object(doc.get("files", {}), f"{where}: files").items():
        check_file_name(name, f"{where}: files", version)
        info = expect_object(info, f"{where}: files[{name!r}]")
        size = int_field(info.get("size"), f"{where}: size of {name}")
        files[name] = FileRecord(size, int_field(info.get("writer", 0), f"{where}: writer of {name}", 0, 1 << 31),
                                 parse_header_record(info.get("header"), size, f"{where}: files[{name!r}]"))
    tensors: dict[str, TensorRecord] = indexed.pop("tensors", {})
    for fqn, info in expect_object(doc.get("tensors", {}), f"{where}: tensors").items() if not indexed else ():
        tensors[fqn] = _parse_tensor(fqn, expect_object(info, f"{where}: tensor {fqn!r}"), files, where, version)
    unlisted = set(referenced_dirs(files)) - set(references)
    if unlisted:
        raise InvalidManifest(f"{where}: files reference {sorted(unlisted)[:3]}, which 'references' does not list")
    values = expect_object(doc.get("values", {}), f"{where}: values")
    clash = set(values) & set(tensors)
    if clash:
        raise InvalidManifest(f"{where}: keys {sorted(clash)[:5]} are both tensors and values")
    aliases = _parse_aliases(expect_object(doc.get("aliases", {}), f"{where}: aliases"), tensors, values, where)
    meta = expect_object(doc.get("meta", {}), f"{where}: meta")
    writer = expect_object(doc.get("writer", {}), f"{where}: writer")
    return Manifest(tensors=tensors, values=values, files=files, meta=meta, writer=writer, version=version,
                    aliases=aliases, references=references, **indexed)


def _parse_indexed(doc: dict, where: str) -> dict[str, Any]:
    """A version-3 manifest's tensors (no chunks yet: :mod:`.index` attaches them), regions, rules and
    index files, as :class:`Manifest` fields."""
    rules = tuple(_parse_rule(expect_object(r, f"{where}: rule {i}"), f"{where}: rule {i}")
                  for i, r in enumerate(list_field(doc.get("rules", []), f"{where}: rules")))
    indexes: dict[str, IndexRecord] = {}
    for name, info in expect_object(doc.get("indexes", {}), f"{where}: indexes").items():
        at = f"{where}: index {name!r}"
        info = expect_object(info, at)
        indexes[check_file_name(name, at, 1)] = IndexRecord(int_field(info.get("size"), f"{at} size"),
                                               unpack_crcs(info.get("crc32c"), 1, at)[0],
                                               int_field(info.get("writer"), f"{at} writer", 0, 1 << 31))
    writers = {i.writer for i in indexes.values()}
    for i, (_, _, grid) in enumerate(rules):
        missing = set(grid) - writers - {-1}
        if missing:
            raise InvalidManifest(f"{where}: rule {i} names writers {sorted(missing)[:5]}, which have no index file")
    expanded: dict[tuple[tuple[int, ...], int], int] = {}  # (shape, rule) -> boxes it expands to
    total = 0
    tensors: dict[str, TensorRecord] = {}
    regions: dict[str, int | Regions] = {}
    for fqn, info in expect_object(doc.get("tensors", {}), f"{where}: tensors").items():
        at = f"{where}: tensor {fqn!r}"
        info = expect_object(info, at)
        code = info.get("dtype")
        shape = ints_field(info.get("shape"), f"{at} shape")
        if math.prod(shape) * code_itemsize(code, at) >= 1 << 62:
            raise InvalidManifest(f"{at} has an absurd shape {list(shape)}")
        tensors[fqn] = TensorRecord(code, shape, ())
        if "rule" in info:
            found = regions[fqn] = int_field(info["rule"], f"{at} rule", 0, len(rules) - 1)
            if any(spec[0] != "replicate" and spec[1] >= len(shape) for spec in rules[found][1]):
                raise InvalidManifest(f"{at}: rule {found} shards a dimension a {len(shape)}-D tensor lacks")
            if (shape, found) not in expanded:
                expanded[(shape, found)] = rule_boxes(rules[found])
                total += expanded[(shape, found)]
                if total > MAX_REGION_BOXES:
                    raise InvalidManifest(f"{where}: the rules give more than {MAX_REGION_BOXES} boxes in all")
            problem = rule_problem(shape, rules[found])
        else:
            found = regions[fqn] = tuple(
                (int_field(r[0], f"{at} region writer", 0, 1 << 31),
                 (ints_field(r[1], f"{at} region offsets", len(shape)),
                  ints_field(r[2], f"{at} region shape", len(shape))))
                for r in (list_field(r, f"{at} region", 3) for r in list_field(info.get("regions"), f"{at} regions")))
            missing = {w for w, _ in found} - writers
            problem = regions_problem(shape, found) or (
                f"writers {sorted(missing)[:5]} have regions but no index file" if missing else None)
        if problem:
            raise InvalidManifest(f"{at}: writer regions: {problem}")
    return {"tensors": tensors, "rules": rules, "regions": regions, "indexes": indexes, "complete": not tensors}


_SPEC_ARGS = {"replicate": 0, "shard": 1, "strided": 2}
MAX_RULE_BOXES = 1 << 18    # boxes one rule may give a tensor (coordinates x strided pieces)
MAX_REGION_BOXES = 1 << 21  # boxes a manifest's rules may expand to in all, each (shape, rule) counted once


def _parse_rule(info: dict, at: str) -> Rule:
    mesh = ints_field(info.get("mesh"), f"{at} mesh")
    if not mesh or math.prod(mesh) > 1 << 24 or 0 in mesh:
        raise InvalidManifest(f"{at}: mesh {list(mesh)} must be 1 to 64 positive sizes of at most 2**24 ranks")
    specs = []
    for spec in list_field(info.get("placements"), f"{at} placements", len(mesh)):
        spec = list_field(spec, f"{at} placement")
        if (not spec or not isinstance(spec[0], str) or spec[0] not in _SPEC_ARGS
                or len(spec) != 1 + _SPEC_ARGS[spec[0]]):
            raise InvalidManifest(f"{at}: placement {spec!r:.100} is not [replicate], [shard, dim] or "
                                  f"[strided, dim, split_factor]")
        specs.append((spec[0], *(int_field(v, f"{at} placement", 0 if j == 0 else 1, MAX_NDIM if j == 0 else 1 << 24)
                                 for j, v in enumerate(spec[1:]))))
    boxes = rule_boxes((mesh, tuple(specs), ()))
    if boxes > MAX_RULE_BOXES:
        raise InvalidManifest(f"{at}: mesh {list(mesh)} with its split factors gives {boxes} boxes per tensor, more "
                              f"than the {MAX_RULE_BOXES} a reader accepts")
    writers = tuple(int_field(w, f"{at} writer", -1, 1 << 31)
                    for w in list_field(info.get("writers"), f"{at} writers", math.prod(mesh)))
    return mesh, tuple(specs), writers


def _parse_aliases(doc: dict, tensors: Mapping[str, TensorRecord], values: Mapping[str, Any],
                   where: str) -> dict[str, str]:
    """Each alias is a key of its own (a string, not a tensor or value key) naming a *stored* tensor:
    an alias of an alias (a chain, or a cycle) is refused, so one lookup always reaches the data."""
    aliases: dict[str, str] = {}
    for alias, target in doc.items():
        at = f"{where}: alias {alias[:200]!r}"
        if not alias or len(alias) > _MAX_KEY:
            raise InvalidManifest(f"{at}: a key must be a string of 1 to {_MAX_KEY} characters")
        if alias in tensors or alias in values:
            raise InvalidManifest(f"{at} is also a stored {'tensor' if alias in tensors else 'value'}")
        if not isinstance(target, str) or target not in tensors:
            kind = "another alias" if isinstance(target, str) and target in doc else "no stored tensor"
            raise InvalidManifest(f"{at} points at {target!r:.200}, which is {kind}; an alias must name a tensor "
                                  f"the manifest stores")
        aliases[alias] = target
    return aliases


def _strips(value: Any, shape: tuple[int, ...], codec: str, version: int, where: str) -> tuple[int, int] | None:
    """A chunk's ``strips`` field: absent, or ``[dim, width]`` cutting a non-empty raw chunk along one of its
    dims after the first (version 2 on)."""
    if value is None:
        return None
    if version < STRIPS_VERSION:
        raise InvalidManifest(f"{where}: 'strips' needs format version {STRIPS_VERSION}, the manifest says {version}")
    if not isinstance(value, list) or len(value) != 2:
        raise InvalidManifest(f"{where}: strips must be [dim, width], got {value!r:.200}")
    dim = int_field(value[0], f"{where} strips dim", 1, max(1, len(shape) - 1))
    if len(shape) < 2 or codec != "raw" or math.prod(shape) == 0:
        raise InvalidManifest(f"{where}: only a non-empty raw chunk of two or more dims can be stored as strips")
    return dim, int_field(value[1], f"{where} strips width", 1, shape[dim])


def parse_chunk(c: dict, cat: str, shape: tuple[int, ...], code: str, files: Mapping[str, FileRecord],
                version: int) -> ChunkRecord:
    """One chunk record of a tensor of ``shape`` and dtype ``code``, checked against ``files`` (name -> record)."""
    size = code_itemsize(code, cat)
    offsets = ints_field(c.get("offsets"), f"{cat} offsets", len(shape))
    cshape = ints_field(c.get("shape"), f"{cat} shape", len(shape))
    if any(o + s > n for o, s, n in zip(offsets, cshape, shape)):
        raise InvalidManifest(f"{cat}: offsets {list(offsets)} + shape {list(cshape)} exceed the tensor's "
                              f"shape {list(shape)}")
    file = check_file_name(c.get("file"), cat, version)
    if file not in files:
        raise InvalidManifest(f"{cat} names file {file!r}, which the manifest's file list does not hold")
    key = c.get("key")
    if not isinstance(key, str) or len(key) > 4096:
        raise InvalidManifest(f"{cat}: key must be a string")
    codec = c.get("codec")
    if codec not in CODECS:
        raise InvalidManifest(f"{cat}: unknown codec {codec!r} (known: {list(CODECS)})")
    start = int_field(c.get("start"), f"{cat} start")
    nbytes = int_field(c.get("nbytes"), f"{cat} nbytes")
    raw = math.prod(cshape) * size
    if codec == "raw" and nbytes != raw:
        raise InvalidManifest(f"{cat}: {nbytes} stored bytes, shape {list(cshape)} x {code} needs {raw}")
    if start + nbytes > files[file].size:
        raise InvalidManifest(f"{cat}: bytes [{start}, {start + nbytes}) lie beyond the end of {file} "
                              f"({files[file].size} bytes)")
    block = int_field(c.get("block"), f"{cat} block", 1)
    strips = _strips(c.get("strips"), cshape, codec, version, cat)
    crcs = tuple(unpack_crcs(c.get("crc32c"), crc_count((offsets, cshape), nbytes, block, strips), cat))
    return ChunkRecord(offsets, cshape, file, key, start, nbytes, codec, block, crcs, strips,
                       parse_digest(c.get(DIGEST_NAME), cat))


def _parse_tensor(fqn: str, info: dict, files: Mapping[str, FileRecord], where: str,
                  version: int) -> TensorRecord:
    at = f"{where}: tensor {fqn!r}"
    code = info.get("dtype")
    size = code_itemsize(code, at)
    shape = ints_field(info.get("shape"), f"{at} shape")
    if math.prod(shape) * size >= 1 << 62:
        raise InvalidManifest(f"{at} has an absurd shape {list(shape)}")
    raw_chunks = info.get("chunks")
    if not isinstance(raw_chunks, list):
        raise InvalidManifest(f"{at}: chunks must be a list")
    chunks = [parse_chunk(expect_object(c, f"{at} chunk {i}"), f"{at} chunk {i}", shape, code, files, version)
              for i, c in enumerate(raw_chunks)]
    problem = check_cover(shape, [c.box for c in chunks])
    if problem:
        raise InvalidManifest(f"{at}: {problem}")
    return TensorRecord(code, shape, tuple(chunks))
