"""One rank's hot copy on disk: a single data file and a manifest, written by this rank alone.

A hot copy is written every step and read back only by the same layout on the same number of ranks
(:mod:`.copies` checks the structure), so it needs none of a durable checkpoint's machinery -- no chunking,
no shared plan, no writer pool, no index.  What it keeps are the guarantees:

* **Checked before trusted.**  ``manifest.json`` records every tensor's dtype, shape, offset and crc32c in
  ``state.bin``, and ends with the crc32c of its own body; :func:`read_copy` refuses a copy whose manifest,
  file size or any tensor's bytes do not match, naming the file and key.
* **Published atomically.**  Both files are written and fsynced in a staging directory beside the target
  (``.<copy name>.partial-<pid>-<random>``, which retention recognises as a killed writer's), the manifest
  last; one ``rename`` then makes the copy appear whole.  A target that already holds a copy is never
  replaced (the rename fails on a non-empty directory).

Layout: the tensors' bytes back to back in ``state.bin``, each at a 64-byte aligned offset, so a reader
maps the whole file and views every tensor in place (:func:`read_flat`), or reads each tensor straight into
the tensor it restores, checking every piece's crc32c while it is still in the cache
(:meth:`PendingCopy.fill`: one pass over the bytes, the floor of a recovery from the node's own copy).  The
checksums are computed by the writer, off the training thread (the hot save runs in the background).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from shardkit.checkpoint.formats.crc32c import crc32c
from shardkit.checkpoint.formats.dtypes import code_to_dtype, dtype_to_code
from shardkit.checkpoint.io.local_files import map_file, publish_directory, read_whole, remove_files
from shardkit.checkpoint.io.piece_reads import PieceReader
from shardkit.checkpoint.io.rounds import aligned
from shardkit.errors import CorruptCheckpoint

__all__ = ["DATA_NAME", "MANIFEST_NAME", "FlatCopy", "PendingCopy", "Entry", "write_flat", "read_manifest",
           "parse_manifest", "entries_of", "checked_tensor", "read_flat", "open_pending", "remove_flat"]

DATA_NAME = "state.bin"
MANIFEST_NAME = "manifest.json"  # the commit file: a copy without it is not a copy (transfer's commit_last)
LAYOUT = "shardkit-hot-copy-1"
FILL_PIECE = 1 << 20  # one read straight into a target, checksummed while it is still in the cache


@dataclass
class FlatCopy:
    """A copy read and checked: each tensor a view into one buffer, the JSON values as stored."""

    path: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]


def write_flat(path: str, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any],
               meta: Mapping[str, Any]) -> int:
    """Write ``tensors`` (CPU) and ``values`` (JSON-encoded) as a copy at ``path`` (see the module docstring);
    the bytes of ``state.bin``.  Raises :class:`~shardkit.errors.StorageError` naming the path when the disk
    refuses, or when ``path`` already holds a copy."""
    entries, pieces, offset = [], [], 0
    for key, t in tensors.items():
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
        n = raw.numel()
        entries.append([key, dtype_to_code(t.dtype), list(t.shape), offset, n, crc32c(raw)])
        pieces.append(raw.numpy())
        end = aligned(offset + n)
        if end > offset + n:
            pieces.append(bytes(end - offset - n))
        offset = end
    body = json.dumps({"layout": LAYOUT, "meta": dict(meta), "size": offset, "tensors": entries,
                       "values": dict(values)}, allow_nan=False, separators=(",", ":")).encode("utf-8")
    seal = f"\n{crc32c(body):08x}\n".encode("ascii")
    publish_directory(path, [(DATA_NAME, pieces), (MANIFEST_NAME, [body, seal])])  # the manifest last
    return offset


def read_manifest(path: str) -> dict[str, Any]:
    """The checked manifest of the copy at ``path``.  Raises :class:`~shardkit.errors.CorruptCheckpoint`
    when it is missing, damaged (its crc32c) or not a hot copy's."""
    where = os.path.join(path, MANIFEST_NAME)
    try:
        raw = read_whole(where)
    except OSError as exc:
        raise CorruptCheckpoint(f"{where}: not a readable hot-tier copy ({type(exc).__name__}: {exc})") from None
    return parse_manifest(raw, where)


def parse_manifest(raw: Any, where: str) -> dict[str, Any]:
    """A manifest's bytes (read from ``where``, or received from the rank that holds it) checked and decoded.
    Raises :class:`~shardkit.errors.CorruptCheckpoint` naming ``where`` when they are damaged (their crc32c)
    or not a hot copy's."""
    try:
        body, _, tail = bytes(raw).rstrip(b"\n").rpartition(b"\n")
        if not body or int(tail, 16) != crc32c(body):
            raise ValueError("its checksum does not match its contents")
        manifest = json.loads(body.decode("utf-8"))
        if not isinstance(manifest, dict) or manifest.get("layout") != LAYOUT:
            raise ValueError(f"not a hot copy's manifest (layout {LAYOUT} expected)")
        if not isinstance(manifest.get("meta"), dict) or not isinstance(manifest.get("values"), dict) \
                or not isinstance(manifest.get("tensors"), list) or not isinstance(manifest.get("size"), int):
            raise ValueError("a field is missing or of the wrong type")
    except ValueError as exc:  # UnicodeDecodeError and json's errors among them
        raise CorruptCheckpoint(f"{where}: not a readable hot-tier copy ({type(exc).__name__}: {exc})") from None
    return manifest


@dataclass(frozen=True)
class Entry:
    """One tensor of a manifest, its fields checked against the data file's size."""

    key: str
    dtype: torch.dtype
    shape: list[int]
    offset: int
    nbytes: int
    crc: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def entries_of(manifest: dict[str, Any], path: str) -> list[Entry]:
    """The manifest's tensors in file order.  Raises :class:`~shardkit.errors.CorruptCheckpoint` naming the
    copy at ``path`` for an entry that does not fit the file or its shape."""
    size, where, found = manifest["size"], os.path.join(path, DATA_NAME), []
    for entry in manifest["tensors"]:
        try:
            key, dtype_name, shape, offset, n, crc = entry
            dtype = code_to_dtype(dtype_name, where)
            numel = 1
            for d in shape:
                numel *= int(d)
            if offset % 64 or offset < 0 or offset + n > size or n != numel * dtype.itemsize:
                raise ValueError(f"offset {offset}, {n} bytes do not fit the file or the shape {shape}")
        except (TypeError, ValueError) as exc:
            raise CorruptCheckpoint(f"{path}/{MANIFEST_NAME}: bad tensor entry {entry!r:.120}: {exc}") from None
        found.append(Entry(str(key), dtype, [int(d) for d in shape], offset, n, int(crc)))
    return sorted(found, key=lambda e: e.offset)


def checked_tensor(entry: Entry, buffer: torch.Tensor, where: str) -> torch.Tensor:
    """``entry``'s tensor as a view into ``buffer`` (the data file's bytes) once its crc32c matches.  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` naming ``where`` and the key when it does not."""
    raw = buffer[entry.offset:entry.end]
    if crc32c(raw) != entry.crc:
        raise CorruptCheckpoint(f"{where}: the bytes of {entry.key!r} do not match their checksum (crc32c): a "
                                f"damaged copy")
    return raw.view(entry.dtype).reshape(entry.shape)


def read_flat(path: str, manifest: dict[str, Any] | None = None) -> FlatCopy:
    """Map ``state.bin`` and check every tensor's crc32c against the manifest (each tensor a read-only view).  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` naming the file (and key) for any mismatch."""
    manifest = read_manifest(path) if manifest is None else manifest
    entries = entries_of(manifest, path)
    where = os.path.join(path, DATA_NAME)
    buffer = map_file(where, manifest["size"])  # read-only: checked here, then copied into the targets
    tensors = {e.key: checked_tensor(e, buffer, where) for e in entries}
    return FlatCopy(path, manifest["meta"], tensors, manifest["values"])


@dataclass
class PendingCopy:
    """A copy whose manifest was read and checked, and whose small tensors (``small``: the input state) were
    read and checked, but whose large ones were not read yet: :meth:`fill` reads each straight into its
    target.  ``tensors`` holds the small ones; ``entries`` every tensor's entry by key."""

    path: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    entries: dict[str, Entry]
    size: int
    remote: bool = False  # a peer's copy: its bytes arrive over the process group (:mod:`.fetch`), not read here
    problem: str | None = None  # a peer's copy: why its bytes did not check out as they arrived

    def fill(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Read each of ``targets``' tensors (by key, this copy's dtype and shape) from ``state.bin`` into
        it and check its crc32c, piece by piece as each lands.  Raises
        :class:`~shardkit.errors.CorruptCheckpoint` naming the file and key on a mismatch -- by then the
        targets read before it were written, so the caller must treat them as touched.  A peer's copy
        arrived into the targets already: only its ``problem`` is raised."""
        if self.remote:
            if self.problem is not None:
                raise CorruptCheckpoint(self.problem)
            return
        _read_entries(self.path, self.size, sorted(((self.entries[key], t) for key, t in targets.items()),
                                                   key=lambda et: et[0].offset))


def _read_entries(path: str, size: int, jobs: list[tuple[Entry, torch.Tensor]]) -> None:
    """Each entry's bytes of the copy at ``path`` read into its tensor, checked (see :func:`_fill_one`), through
    one descriptor (:class:`~shardkit.checkpoint.io.piece_reads.PieceReader`: a copy lives in a plain local
    directory, and the storage layer's per-request work, paid per 1 MiB piece, cost a recovery tens of ms)."""
    where = os.path.join(path, DATA_NAME)
    try:
        with PieceReader(where) as data:
            found = data.size
            if found != size:
                raise CorruptCheckpoint(f"{where} holds {found} bytes; {size} were written")
            for entry, target in jobs:
                _fill_one(data, entry, target, where)
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read {where}: {exc}") from None


def _fill_one(data: PieceReader, entry: Entry, target: torch.Tensor, where: str) -> None:
    """``entry``'s bytes read into ``target`` (directly when it is a contiguous CPU tensor, else through one
    buffer), their crc32c checked piece by piece as they land, while still in the cache."""
    direct = target.device.type == "cpu" and target.is_contiguous()
    into = target.detach() if direct else torch.empty(entry.shape, dtype=entry.dtype)
    raw = into.reshape(-1).view(torch.uint8)
    view = memoryview(raw.numpy()).cast("B") if entry.nbytes else memoryview(b"")
    crc = 0
    for start in range(0, entry.nbytes, FILL_PIECE):
        end = min(start + FILL_PIECE, entry.nbytes)
        data.read_into(view[start:end], entry.offset + start)
        crc = crc32c(raw[start:end], crc)
    if crc != entry.crc:
        raise CorruptCheckpoint(f"{where}: the bytes of {entry.key!r} do not match their checksum (crc32c): a "
                                f"damaged copy")
    if not direct:
        with torch.no_grad():
            target.copy_(into)


def open_pending(path: str, manifest: dict[str, Any], small: Callable[[str], bool]) -> PendingCopy:
    """The copy at ``path`` (its checked ``manifest``) with the tensors whose key ``small(key)`` accepts
    read and checked now, the others left for :meth:`PendingCopy.fill`.  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` naming the file (and key) for any mismatch."""
    entries = entries_of(manifest, path)
    tensors = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in entries if small(e.key)}
    _read_entries(path, manifest["size"], [(e, tensors[e.key]) for e in entries if e.key in tensors])
    return PendingCopy(path, manifest["meta"], tensors, manifest["values"], {e.key: e for e in entries},
                       manifest["size"])


def remove_flat(path: str) -> list[str]:
    """Remove the files of the copy at ``path`` (the manifest first, so it stops being a copy at once) and
    the directory when nothing else is left; the names it left (not a copy's) are returned."""
    return remove_files(path, [MANIFEST_NAME, DATA_NAME])
