"""torch_checkpointing step folders (``metadata.pkl`` + ``<item>_<rank>.pt``), read without running a pickle.

torch_checkpointing (Meta's library, torchtitan 0.3's second backend) saves a
step as one folder: ``metadata.pkl`` (which rank holds which box of every
tensor, :mod:`.metadata`) and one ``torch.save`` file per item and rank
holding that rank's part of the item (its DTensors' local tensors, plain
tensors, plain values).  The metadata exists when an item was saved with a
resharder (``ItemSpec(resharder=DefaultResharder())``, as torchtitan saves
its model and optimizer).

What the reader serves, keyed as shardkit keys a training state: item
``model`` under ``model.``, ``optimizer`` under ``optim.`` (so ``load``
fills an optimizer from ``get_state_dict``'s layout), every other item under
its own name; nested paths joined by ``.``.  A tensor's stored chunks are the
pieces each source rank holds (replicas of one box listed once, from the
lowest rank), so ``reshard``, ``convert`` and ``load`` at any world size read
each box from the rank file that has it.  Values (``param_groups``, a
``train_state``) come from rank 0's files.  An item saved without a resharder
has no metadata and one file per rank that cannot be told apart as shards:
it is read from rank 0's file, tensors whole, and the reader says so.

Nothing is unpickled with ``pickle``'s or ``torch.load``'s defaults: both
kinds of pickle go through :mod:`.allowlist`, and a tensor is located, not
loaded: its storage record's offset in the zip archive and its strides give
the bytes of any box, fetched with one ranged read per box (bytes read are
the box's span within the local tensor).  Each record's CRC-32 is checked
once before any of its bytes is served (:mod:`~shardkit.checkpoint.formats.torchsave.zip_records`).

A step folder left incomplete is refused: a ``tmp_<name>`` folder (the
library renames it when every rank has written) or a rank file the metadata
names but the folder lacks.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import CheckpointInfo, CheckpointReader, ReadRequest, StoredChunk, TensorEntry
from shardkit.checkpoint.formats.torch_checkpointing.allowlist import (
    DTensorRef,
    TensorRef,
    load_item_pickle,
    load_metadata_pickle,
)
from shardkit.checkpoint.formats.torch_checkpointing.handler import METADATA_NAME
from shardkit.checkpoint.formats.torch_checkpointing.metadata import (
    Sharding,
    StepMetadata,
    local_extent,
    parse_metadata,
    pieces_of,
    spec_text,
)
from shardkit.checkpoint.formats.torchsave.zip_records import (
    CheckedOnce,
    ZipRecord,
    carries_checksums,
    check_record,
    data_start,
    list_records,
)
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import flatten
from shardkit.errors import ConfigurationError, InvalidManifest, UnsupportedFormat

__all__ = ["TorchCheckpointingReader", "detect", "open_reader", "METADATA_NAME", "TEMP_PREFIX"]

log = logging.getLogger(__name__)

TEMP_PREFIX = "tmp_"  # torch_checkpointing writes into tmp_<name> and renames it once every rank has written
_RANK_FILE = re.compile(r"^(.+)_(\d+)\.pt$")
_RENAMED = {"model": "model", "optimizer": "optim"}


def detect(storage: Storage) -> bool:
    """A folder with a ``metadata.pkl`` that starts like a pickle (protocol 2 or later)."""
    try:
        return (storage.is_dir() and storage.exists(METADATA_NAME)
                and storage.read_bytes(METADATA_NAME, 0, 1) == b"\x80")
    except OSError:
        return False


def open_reader(storage: Storage) -> "TorchCheckpointingReader":
    return TorchCheckpointingReader(storage)


@dataclass(frozen=True)
class _Where:
    """A stored chunk: ``key`` (the nested path, joined) in rank file ``file``, whose local tensor has
    ``local_shape``; the chunk is the local box at ``local_offsets``."""

    file: str
    key: str
    local_shape: tuple[int, ...] | None  # None: not implied by the metadata (explicit pieces)
    local_offsets: tuple[int, ...]


class _ItemFile:
    """One rank's item file: its zip records and its ``data.pkl``, unpickled through the allowlist."""

    def __init__(self, storage: Storage, name: str) -> None:
        where = storage.where(name)
        self.name, self.where = name, where
        self._data_at: dict[str, int] = {}
        size = storage.size(name)
        self.records = {r.name: r for r in list_records(storage, name, 0, size, where)}
        self.size = size
        self.crc = carries_checksums(list(self.records.values()))
        pickles = [r for n, r in self.records.items() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1 or not pickles[0].stored:
            raise InvalidManifest(f"{where}: not a torch.save archive (no single stored <archive>/data.pkl record)")
        self.prefix = pickles[0].name[:-len("data.pkl")]
        if self.crc:
            check_record(storage, name, 0, size, pickles[0], where)
        at = data_start(storage, name, 0, pickles[0], where)
        self.obj = load_item_pickle(storage.read_bytes(name, at, at + pickles[0].size), where)
        self.refs: dict[str, TensorRef] = {}
        self.values: dict[str, Any] = {}
        self.tensors: dict[str, TensorRef | DTensorRef] = {}
        self._flatten()

    def _flatten(self) -> None:
        """Tensors (references) and JSON values by the item's own key: ``flatten``'s rules, with each reference
        standing as a meta tensor while it walks."""
        found: dict[int, TensorRef | DTensorRef] = {}

        def plain(value: Any) -> Any:
            if isinstance(value, dict):
                return {str(k): plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            if isinstance(value, (TensorRef, DTensorRef)):
                meta = torch.empty(0, device="meta")
                found[id(meta)] = value
                return meta
            return value

        try:
            flat = flatten(plain(self.obj) if isinstance(self.obj, dict) else {"": plain(self.obj)})
        except ConfigurationError as exc:
            raise UnsupportedFormat(f"{self.where}: {exc}") from None
        self.values = flat.values
        self.tensors = {k: found[id(t)] for k, t in flat.tensors.items()}
        self.refs = {k: (v.local if isinstance(v, DTensorRef) else v) for k, v in self.tensors.items()}

    def data_at(self, storage: Storage, ref: TensorRef) -> int:
        """Where the bytes of ``ref``'s storage record start in the file (its local header read once)."""
        rec = self.record(ref)
        at = self._data_at.get(rec.name)
        if at is None:
            at = self._data_at[rec.name] = data_start(storage, self.name, 0, rec, self.where)
        return at

    def record(self, ref: TensorRef) -> ZipRecord:
        rec = self.records.get(f"{self.prefix}data/{ref.record}")
        if rec is None or not rec.stored:
            raise InvalidManifest(f"{self.where}: storage record {ref.record!r} is missing or compressed")
        return rec


class TorchCheckpointingReader(CheckpointReader):
    """A torch_checkpointing step folder; see the module docstring."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.storage = storage
        url = storage.url
        name = url.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(TEMP_PREFIX):
            raise InvalidManifest(f"{url}: an unfinished torch_checkpointing save (it writes into {TEMP_PREFIX}<step> "
                                  "and renames the folder once every rank has written); use a finished step")
        where = storage.where(METADATA_NAME)
        self._md: StepMetadata = parse_metadata(load_metadata_pickle(storage.read_bytes(METADATA_NAME), where), where)
        names = set(storage.listdir())
        expected = sorted({f for item in self._md.items.values() for f in item.files.values()})
        missing = [f for f in expected if f.split("/", 1)[0] not in names or not storage.exists(f)]
        if missing:
            raise InvalidManifest(f"{url}: the metadata names {len(missing)} rank file(s) the folder lacks "
                                  f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): an incomplete "
                                  "or damaged save")
        # items saved without a resharder: no metadata, one <item>_<rank>.pt per rank
        ranked: dict[str, set[int]] = {}
        for n in names:
            m = _RANK_FILE.match(n)
            if m and n not in expected:
                ranked.setdefault(m.group(1), set()).add(int(m.group(2)))
        self._plain_items = sorted(i for i in ranked if i not in self._md.items)
        for item in self._plain_items:
            if 0 not in ranked[item]:
                raise InvalidManifest(f"{url}: item {item!r} has rank files {sorted(ranked[item])} but no rank 0's")
        self._files: dict[str, _ItemFile] = {}
        self._lock = threading.Lock()
        self._checked = CheckedOnce()
        self._entries: dict[str, TensorEntry] | None = None
        self._values: dict[str, Any] | None = None
        self.notes = [f"item {item!r} was saved without a resharder (one file per rank, no metadata): read from "
                      "rank 0's file" for item in self._plain_items]
        for note in self.notes:
            log.info("%s: %s", storage.url, note)
        self.info = CheckpointInfo("torch_checkpointing", url, world_size=self._md.world_size,
                                   layouts=self._layouts())

    # ------------------------------------------------------------------ naming
    def _prefix(self, item: str) -> str:
        items = set(self._md.items) | set(self._plain_items)
        renamed = _RENAMED.get(item, item)
        return item if renamed != item and renamed in items else renamed

    def _key(self, item: str, path: Sequence[Any]) -> str:
        return ".".join([self._prefix(item), *(str(p) for p in path if p != "")])

    def _layouts(self) -> tuple[dict[str, Any], ...]:
        groups: dict[tuple, list[str]] = {}
        for item, layout in self._md.items.items():
            for path, shardings in layout.paths.items():
                s = shardings[0][0]
                if s.explicit is None:
                    groups.setdefault((s.mesh_shape, s.dim_names or (), tuple(map(spec_text, s.specs))), []).append(
                        self._key(item, path))
        return tuple({"mesh": {"shape": list(m), "dim_names": list(d)}, "placements": list(p), "tensors": t}
                     for (m, d, p), t in groups.items())

    def file(self, name: str) -> _ItemFile:
        """Rank file ``name``, opened (``data.pkl`` checked and unpickled) once."""
        with self._lock:
            found = self._files.get(name)
            if found is None:
                found = self._files[name] = _ItemFile(self.storage, name)
            return found

    # ------------------------------------------------------------------ entries
    def tensors(self) -> Mapping[str, TensorEntry]:
        if self._entries is None:
            entries: dict[str, TensorEntry] = {}
            for item, layout in self._md.items.items():
                for path, shardings in layout.paths.items():
                    key = self._key(item, path)
                    entries[key] = self._entry(key, ".".join(str(p) for p in path), shardings, layout.files)
            for item in self._plain_items:
                name = f"{item}_0.pt"
                for k, ref in self.file(name).tensors.items():
                    if isinstance(ref, DTensorRef):
                        raise UnsupportedFormat(f"{self.storage.where(name)}: item {item!r} holds DTensors but was "
                                                "saved without a resharder, so no metadata says how they are laid "
                                                "out; save it with ItemSpec(resharder=DefaultResharder())")
                    shape = ref.shape
                    key = self._key(item, [k])
                    entries[key] = TensorEntry(key, ref.dtype, shape, (StoredChunk(
                        (0,) * len(shape), shape, _Where(name, k, shape, (0,) * len(shape))),))
            self._entries = entries
        return self._entries

    def _entry(self, key: str, local_key: str, shardings: list[tuple[Sharding, tuple[int, ...]]],
               files: Mapping[int, str]) -> TensorEntry:
        first = shardings[0][0]
        chunks: list[StoredChunk] = []
        seen: set[tuple] = set()
        for sharding, ranks in shardings:
            if sharding.shape != first.shape or sharding.dtype != first.dtype:
                raise InvalidManifest(f"{self.storage.where(METADATA_NAME)}: {key!r} is recorded with two shapes "
                                      "or dtypes")
            for rank in sorted(ranks):
                pieces = pieces_of(sharding, rank)
                local_shape = local_extent(sharding, rank)
                for (goffs, gshape), (loffs, _) in pieces:
                    if (goffs, gshape) in seen or math.prod(gshape) == 0:
                        continue
                    seen.add((goffs, gshape))
                    chunks.append(StoredChunk(goffs, gshape, _Where(files[rank], local_key, local_shape, loffs)))
        return TensorEntry(key, first.dtype, first.shape, tuple(chunks))

    def values(self) -> Mapping[str, Any]:
        if self._values is None:
            values: dict[str, Any] = {}
            for item in [*self._md.items, *self._plain_items]:
                layout = self._md.items.get(item)
                name = layout.files[0] if layout is not None else f"{item}_0.pt"
                values.update({self._key(item, [k]): v for k, v in self.file(name).values.items()})
            self._values = values
        return self._values

    # ------------------------------------------------------------------ reading
    def locate(self, entry: TensorEntry, index: int) -> tuple[_ItemFile, TensorRef]:
        """The rank file and the tensor of stored chunk ``index``, checked against the metadata."""
        where: _Where = entry.chunks[index].locator
        f = self.file(where.file)
        ref = f.refs.get(where.key)
        if ref is None:
            raise InvalidManifest(f"{f.where}: holds no tensor {where.key!r}, which the metadata places there")
        if ref.dtype != entry.dtype or (where.local_shape is not None and ref.shape != where.local_shape):
            raise InvalidManifest(f"{f.where} [{where.key}]: holds {ref.dtype} {list(ref.shape)}, the metadata says "
                                  f"this rank's part is {entry.dtype} {list(where.local_shape or ref.shape)}")
        span = 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride)) if all(ref.shape) else 0
        if ref.storage_offset + span > ref.storage_numel or f.record(ref).size < ref.storage_numel * ref.dtype.itemsize:
            raise InvalidManifest(f"{f.where} [{where.key}]: its tensor reaches past its storage record")
        return f, ref

    def _check_record(self, f: _ItemFile, name: str, ref: TensorRef) -> None:
        rec = f.record(ref)
        if f.crc:
            self._checked.ensure((name, rec.name), lambda: check_record(self.storage, name, 0, f.size, rec,
                                                                        f"{f.where} [{ref.record}]"))

    def prepare(self, requests: Sequence[ReadRequest]) -> None:
        """Open every rank file the requests need and check each tensor against the metadata, writing no
        ``out``: what ``load`` checks on every rank before any rank writes a target."""
        for r, entry in zip(requests, self.check_requests(requests)):
            self.locate(entry, r.chunk)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        entries = self.check_requests(requests)
        located = [self.locate(entry, r.chunk) for r, entry in zip(requests, entries)]
        for r, entry, (f, ref) in zip(requests, entries, located):  # every record checked before any out is written
            self._check_record(f, entry.chunks[r.chunk].locator.file, ref)
        for r, entry, (f, ref) in zip(requests, entries, located):
            where: _Where = entry.chunks[r.chunk].locator
            chunk = entry.chunks[r.chunk]
            item = ref.dtype.itemsize
            n = math.prod(r.box[1])
            if n:
                start = [lo + b - g for lo, b, g in zip(where.local_offsets, r.box[0], chunk.offsets)]
                first = ref.storage_offset + sum(i * s for i, s in zip(start, ref.stride))
                span = 1 + sum((k - 1) * s for k, s in zip(r.box[1], ref.stride))
                buf = torch.empty(span * item, dtype=torch.uint8)
                self.storage.read_into(where.file, f.data_at(self.storage, ref) + first * item, buf)
                r.out.copy_(buf.view(ref.dtype).as_strided(r.box[1], ref.stride))
                self.stats.add(read=span * item, needed=n * item, requests=1)

    def check_chunk(self, entry: TensorEntry, index: int) -> tuple[tuple[str, str], int]:
        """Check stored chunk ``index`` of ``entry`` against the metadata and its record's CRC-32 (``verify``);
        return ``(file, record)`` and the record's size."""
        f, ref = self.locate(entry, index)
        name = entry.chunks[index].locator.file
        self._check_record(f, name, ref)
        rec = f.record(ref)
        return (name, rec.name), rec.size

    def archives(self) -> list[str]:
        """Every rank file the checkpoint is read from."""
        names = {f for item in self._md.items.values() for f in item.files.values()}
        return sorted(names | {f"{item}_0.pt" for item in self._plain_items})
