"""torch.distributed.checkpoint (DCP) directories read safely (:mod:`.writer` writes them for ``dcp.load``).

A DCP checkpoint is a directory of ``__<rank>_<n>.distcp`` payload files plus
one pickled ``.metadata``.  The metadata maps every flattened key to its saved
chunks (``TensorStorageMetadata``) and every chunk to a byte range in a payload
file (``storage_data``).  Each tensor chunk is, by default, a ``torch.save`` blob
of that chunk.

Reading: ``.metadata`` is raw pickle, which executes whatever it names; it is
read by the restricted unpickler of :mod:`.metadata` (DCP's metadata
classes, ``torch.Size``, dtypes/layouts, nothing else).  Every file name it
holds is checked at open.  Payload rows are read by byte ranges where the
blob allows (:mod:`.payload`), otherwise decoded with
``torch.load(weights_only=True)``.  Either way a payload's zip records are
checked against their CRC-32s before any of its bytes is served (streamed
once per payload for ranged reads, in memory for a decoded blob; see
:mod:`~shardkit.checkpoint.formats.torchsave.zip_records` for why not while reading).

Neither reading nor writing imports ``torch.distributed.checkpoint`` (see
:mod:`.metadata` for why).
"""

from __future__ import annotations

import io
import re
import threading
from typing import Any, Collection, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import (
    CheckpointInfo,
    CheckpointReader,
    ReadRequest,
    StoredChunk,
    TensorEntry,
)
from shardkit.checkpoint.formats.dcp.handler import METADATA_NAME
from shardkit.checkpoint.formats.dcp.metadata import (
    BytesStorageMetadata,
    TensorStorageMetadata,
    read_dcp_metadata,
)
from shardkit.checkpoint.formats.dcp.payload import locate_rows, payload_meta
from shardkit.checkpoint.formats.dcp.values import DcpValues, value_groups
from shardkit.checkpoint.formats.dtypes import as_bytes, code_to_dtype
from shardkit.checkpoint.formats.safetensors import read_safetensors_header
from shardkit.checkpoint.formats.torchsave.mapped import refusal
from shardkit.checkpoint.formats.torchsave.zip_records import (
    CheckedOnce,
    check_zip_bytes,
    check_zip_records,
)
from shardkit.checkpoint.geometry.rows import (
    copy_box,
    copy_rows_into,
    row_range,
)
from shardkit.checkpoint.io.names import check_name
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import to_json_value
from shardkit.errors import (
    InvalidManifest,
    ShardkitError,
    UnsafeCheckpoint,
    UnsupportedFormat,
)

__all__ = ["DcpReader", "detect", "open_reader", "read_dcp_metadata", "METADATA_NAME"]

_TRANSFORM_ZSTD = re.compile(r"^stream\.zstd/1$")


def detect(storage: Storage) -> bool:
    return storage.is_dir() and storage.exists(METADATA_NAME)


def open_reader(storage: Storage) -> "DcpReader":
    return DcpReader(storage)


# top-level names a bare checkpoint keeps beside its model keys (torchtitan: optimizer, lr_scheduler, dataloader,
# train_state; shardkit's own input and extra state); everything else at the top of such a checkpoint is the model
_BESIDE_THE_MODEL = ("optimizer", "optim", "lr_scheduler", "dataloader", "train_state", "extra", "data", "rng")
# path parts that say a key nests a whole training state, not a model's parameter
_NESTED_STATE = ("model", "optim", "optimizer", "state", "param_groups")


def shardkit_names(keys: Sequence[str], tensor_keys: Collection[str]) -> dict[str, str]:
    """Stored key -> shardkit key.

    A DCP with tensors under ``model`` or ``optim`` (shardkit's own,
    accelerate's ``{"model": ...}``, DCP's ``get_state_dict`` saved as ``{"model":
    ..., "optim": ...}``) keeps its keys.  So does one whose other keys nest a
    model or optimizer deeper (``{"app": AppState}``, torch's recipe): what is
    model there is the user's to say (``--rename``).  One whose tensors sit
    only at the top level of a bare ``model.state_dict()`` (``dcp.save(
    model.state_dict())``, torchtitan's model keys beside ``optimizer``,
    ``lr_scheduler``, ``dataloader``, ``train_state``) is read as ``model.*``,
    as a bare torch.save file is.  ``optimizer.*`` is read as ``optim.*``
    (unless both are there), so ``load`` fills an optimizer from it.
    """
    tops = {k.split(".", 1)[0] for k in keys}
    outside = [k for k in tensor_keys if k.split(".", 1)[0] not in _BESIDE_THE_MODEL]
    bare = ("model" not in tops and bool(outside)
            and not any(part in _NESTED_STATE for k in outside for part in k.split(".")))
    out = {}
    for k in keys:
        top = k.split(".", 1)[0]
        if top == "optimizer" and "optim" not in tops:
            out[k] = "optim" + k[len("optimizer"):]
        else:
            out[k] = f"model.{k}" if bare and top not in _BESIDE_THE_MODEL else k
    return out


_PAYLOAD_NAME = re.compile(r"^__(\d+)_\d+\.distcp$")


def _writer_count(infos: Collection[Any]) -> int | None:
    """How many ranks wrote the checkpoint: DCP's writer names each payload ``__<rank>_<n>.distcp``, so the
    distinct ranks are the world that saved it (``None`` when a file is named otherwise: a custom writer)."""
    ranks = set()
    for info in infos:
        m = _PAYLOAD_NAME.match(str(getattr(info, "relative_path", "")).rsplit("/", 1)[-1])
        if m is None:
            return None
        ranks.add(int(m.group(1)))
    return len(ranks) or None


class DcpReader(CheckpointReader):
    """A DCP directory; each chunk's torch.save blob is fetched with one ranged read and decoded."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.storage = storage
        url = storage.url
        self._md = read_dcp_metadata(storage.read_bytes(METADATA_NAME), storage.where(METADATA_NAME))
        where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for index, info in (self._md.storage_data or {}).items():
            check_name(str(getattr(info, "relative_path", None)), storage.where(METADATA_NAME))
            offset = None if index.offset is None else tuple(int(o) for o in index.offset)
            where[(index.fqn, offset)] = info
        self._where = where
        self._entries: dict[str, TensorEntry] = {}
        self._value_keys: list[str] = []
        self._ours = shardkit_names(list(self._md.state_dict_metadata), [
            k for k, md in self._md.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)])
        self._theirs = {ours: theirs for theirs, ours in self._ours.items()}
        for fqn, md in self._md.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                shape = tuple(int(s) for s in md.size)
                chunks = []
                for c in md.chunks:
                    offsets, sizes = tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)
                    if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
                        raise InvalidManifest(f"{url}: chunk {offsets}+{sizes} of {fqn!r} lies outside {shape}")
                    info = where.get((fqn, offsets))
                    if info is None:
                        raise InvalidManifest(f"{url}: no storage entry for chunk {offsets} of {fqn!r}")
                    chunks.append(StoredChunk(offsets, sizes, info))
                self._entries[self._ours[fqn]] = TensorEntry(self._ours[fqn], md.properties.dtype, shape, tuple(chunks))
            elif isinstance(md, BytesStorageMetadata):
                self._value_keys.append(fqn)
            else:
                raise InvalidManifest(f"{url}: entry {fqn!r} has unknown metadata {type(md).__name__}")
        self._values: DcpValues | None = None
        self._local = threading.local()  # per-thread cache of the last decoded chunk
        self._lock = threading.Lock()
        self._layouts: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._checked = CheckedOnce()  # payloads whose CRC-32s were checked (ranged reads)
        self.info = CheckpointInfo("dcp", url, world_size=_writer_count(where.values()),
                                   meta={"dcp_version": self._md.version} if self._md.version else {})

    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def _blob(self, info: Any, where: str) -> io.BytesIO:
        """The payload's bytes (transforms undone), its zip records' CRC-32s checked."""
        path = str(info.relative_path)
        start, length = int(info.offset), int(info.length)
        data = self.storage.read_bytes(path, start, start + length)
        if len(data) != length:
            raise InvalidManifest(f"{self.storage.where(path)}: {length} bytes expected at offset {start}, the file "
                                  f"holds {len(data)} (truncated)")
        for desc in reversed(list(getattr(info, "transform_descriptors", None) or ())):
            if not _TRANSFORM_ZSTD.match(desc):
                raise UnsupportedFormat(f"{self.storage.where(path)}: DCP stream transform {desc!r} is not supported")
            import zstandard

            data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
        if data[:4] == b"PK\x03\x04":
            check_zip_bytes(data, where)
        return io.BytesIO(data)

    def _decode(self, info: Any, where: str) -> Any:
        try:
            return torch.load(self._blob(info, where), map_location="cpu", weights_only=True)
        except ShardkitError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds for bad bytes
            refused = refusal(exc)
            if refused:
                raise UnsafeCheckpoint(f"{where}: payload needs unsafe unpickling ({refused}); refusing") from None
            msg = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise InvalidManifest(f"{where}: payload is not a readable torch.save blob ({msg})") from None

    def values(self) -> DcpValues:
        """Every value's key; each is decoded when asked for (see :mod:`.values`: one written as pickle
        bytes, as torchtitan's data loader position is, raises only when asked for by key)."""
        if self._values is None:
            for key in self._value_keys:
                if (key, None) not in self._where:
                    raise InvalidManifest(f"{self.info.url}: no storage entry for value {key!r}")
            self._values = DcpValues(value_groups(self._value_keys, self._ours), self._ours, self._value,
                                     to_json_value, self._value_where, self.info.url)
        return self._values

    def unreadable_values(self) -> dict[str, str]:
        """Key -> why, for each value shardkit leaves unread (pickle bytes it does not run): what
        ``inspect`` can say beside the key's name.  Decodes every value."""
        return self.values().unreadable()

    def _value_where(self, key: str) -> str:
        return f"{self.storage.where(str(self._where[(key, None)].relative_path))} [{key}]"

    def _value(self, key: str) -> Any:
        """The decoded payload of stored value ``key``: its CRC-32s checked, through torch.load's allowlist."""
        return self._decode(self._where[(key, None)], self._value_where(key))

    def chunk_tensor(self, entry: TensorEntry, index: int) -> torch.Tensor:
        """Decode stored chunk ``index`` of ``entry`` (cached: the last one stays for the next request)."""
        chunk = entry.chunks[index]
        cache = getattr(self._local, "cache", None)
        if cache is not None and cache[0] is chunk.locator:
            return cache[1]
        self._local.cache = None
        info = chunk.locator
        where = f"{self.storage.where(str(info.relative_path))} [{entry.fqn} @ {list(chunk.offsets)}]"
        head = self.storage.read_bytes(str(info.relative_path), int(info.offset), int(info.offset) + 9)
        if head[:4] != b"PK\x03\x04" and head[8:9] == b"{" and not getattr(info, "transform_descriptors", None):
            tensor = self._safetensors_item(self._theirs[entry.fqn], info, where)
        else:
            tensor = self._decode(info, where)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != chunk.shape:
            raise InvalidManifest(f"{where}: decodes to {getattr(tensor, 'shape', type(tensor))}, expected "
                                  f"{chunk.shape}")
        if tensor.dtype != entry.dtype:
            raise InvalidManifest(f"{where}: chunk is {tensor.dtype}, expected {entry.dtype}")
        self._local.cache = (chunk.locator, tensor)
        return tensor

    def _safetensors_item(self, fqn: str, info: Any, where: str) -> torch.Tensor:
        """A tensor of a DCP file saved with ``SerializationFormat.SAFETENSORS``: the items of one file
        form one safetensors blob starting at the recorded offset, keyed by fqn (torch 2.13's own
        ``FileSystemReader`` cannot read these back; we can)."""
        name, base = str(info.relative_path), int(info.offset)
        header = read_safetensors_header(self.storage, name, base=base, where=where)
        e = header.entries.get(fqn)
        if e is None:
            raise InvalidManifest(f"{where}: the safetensors payload holds no tensor {fqn!r}")
        raw = bytearray(self.storage.read_bytes(name, base + e.start, base + e.end))
        out = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return out.view(code_to_dtype(e.dtype)).reshape(e.shape)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        entries = self.check_requests(requests)
        layouts = [self._row_layout(entry, r.chunk) for r, entry in zip(requests, entries)]
        for r, entry, layout in zip(requests, entries, layouts):
            if layout is not None:  # rows are read by range: check the whole payload first (once)
                self._check_payload(entry, r.chunk)
        for r, entry, layout in zip(requests, entries, layouts):
            offsets = entry.chunks[r.chunk].offsets
            r0, r1 = row_range(offsets, r.box)
            if layout is not None:  # read just these rows' bytes
                full_width = tuple(r.box[1][1:]) == tuple(entry.chunks[r.chunk].shape[1:])
                rows = r.out if full_width and r.out.is_contiguous() else torch.empty(
                    (r1 - r0,) + tuple(entry.chunks[r.chunk].shape[1:]), dtype=entry.dtype)
                self.storage.read_into(layout.file, layout.data_start + r0 * layout.row_bytes, as_bytes(rows))
                if rows is not r.out:
                    copy_rows_into(rows, offsets, r.box, r.out)
            else:
                copy_box(self.chunk_tensor(entry, r.chunk), offsets, r.box, r.out)
            self.stats.add(read=r.out.numel() * r.out.element_size(), requests=1)

    def _check_payload(self, entry: TensorEntry, index: int) -> None:
        """Stream the payload of stored chunk ``index`` and check its records' CRC-32s, once per payload."""
        info = entry.chunks[index].locator
        name, start, length = str(info.relative_path), int(info.offset), int(info.length)
        where = f"{self.storage.where(name)} [{entry.fqn} @ {list(entry.chunks[index].offsets)}]"
        self._checked.ensure((name, start), lambda: check_zip_records(self.storage, name, start, length, where))

    def check_chunk(self, entry: TensorEntry, index: int) -> int:
        """Check stored chunk ``index`` of ``entry`` without decoding it whole; return the bytes read.

        A torch.save payload is a zip archive whose records carry CRC-32s: every
        record is streamed through ranged reads and its CRC checked, then the
        pickled header is loaded onto the meta device to compare shape and
        dtype with the metadata.  Other payloads (zstd transforms, safetensors
        serialization) have no checksum and are decoded instead.
        Raises a :class:`~shardkit.errors.ShardkitError` naming the chunk.
        """
        chunk = entry.chunks[index]
        info = chunk.locator
        name, start, length = str(info.relative_path), int(info.offset), int(info.length)
        where = f"{self.storage.where(name)} [{entry.fqn} @ {list(chunk.offsets)}]"
        head = self.storage.read_bytes(name, start, start + 4)
        if head != b"PK\x03\x04" or getattr(info, "transform_descriptors", None):
            t = self.chunk_tensor(entry, index)
            self._local.cache = None
            return t.numel() * t.element_size()
        check_zip_records(self.storage, name, start, length, where)
        meta = payload_meta(self.storage, name, start, length, where)
        if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != chunk.shape or meta.dtype != entry.dtype:
            raise InvalidManifest(f"{where}: holds {getattr(meta, 'dtype', type(meta).__name__)} "
                                  f"{tuple(getattr(meta, 'shape', ()))}, the metadata records {entry.dtype} "
                                  f"{chunk.shape}")
        return length

    def _row_layout(self, entry: TensorEntry, index: int) -> Any:
        """Where the rows of a stored chunk are (``None``: decode the chunk whole); computed once."""
        chunk = entry.chunks[index]
        key = (entry.fqn, chunk.offsets)
        with self._lock:
            if key in self._layouts:
                return self._layouts[key]
        info = chunk.locator
        head = self.storage.read_bytes(str(info.relative_path), int(info.offset), int(info.offset) + 4)
        layout = locate_rows(self.storage, info, chunk.shape, entry.dtype) if head == b"PK\x03\x04" else None
        with self._lock:
            self._layouts[key] = layout
        return layout

    def close(self) -> None:
        self._local = threading.local()
