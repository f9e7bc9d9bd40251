"""torch.distributed.checkpoint (DCP) directories: read safely, write for ``dcp.load``.

A DCP checkpoint is a directory of ``__<rank>_<n>.distcp`` payload files plus
one pickled ``.metadata``.  The metadata maps every flattened key to its saved
chunks (``TensorStorageMetadata``) and every chunk to a byte range in a payload
file (``storage_data``).  Each tensor chunk is, by default, a ``torch.save`` blob
of that chunk.

Reading: ``.metadata`` is raw pickle, which executes whatever it names, so we
read it with an unpickler that only constructs DCP's own metadata dataclasses,
``torch.Size``, dtypes/layouts and a few harmless builtins; any other global
raises :class:`~shardkit.errors.UnsafeCheckpoint`.  Payload blobs are decoded
with ``torch.load(weights_only=True)``.  This module is the only place in
shardkit that imports :mod:`pickle`, and only for that restricted reader.

Writing: payloads are ``torch.save`` blobs (bounded: a tensor larger than the
block size is written as several dim-0 chunks, which DCP supports natively),
and the ``.metadata`` object is built from torch's public DCP classes and
handed to torch's own ``FsspecWriter.finish`` to be serialized and committed.
"""

from __future__ import annotations

import io
import pickle  # restricted metadata reader only; see _MetadataUnpickler
import re
import threading
from typing import Any, Callable, Mapping, Sequence

import torch

from shardkit.checkpoint.codec import as_bytes
from shardkit.checkpoint.formats.base import CheckpointInfo, CheckpointReader, ReadRequest, StoredChunk, TensorEntry
from shardkit.checkpoint.formats.dcp_payload import locate_rows
from shardkit.checkpoint.offline_blocks import (copy_rows_into, is_dir, iter_row_blocks, object_path, row_range,
                                                rows_per_block)
from shardkit.checkpoint.storage import Storage
from shardkit.errors import IncompatibleStateDict, InvalidManifest, UnsafeCheckpoint, UnsupportedFormat

__all__ = ["DcpReader", "detect", "open_reader", "read_dcp_metadata", "write_dcp"]

METADATA_NAME = ".metadata"
_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_META: {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    # older torch kept TensorProperties next to ShardedTensor
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties", "MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}
_TRANSFORM_ZSTD = re.compile(r"^stream\.zstd/1$")


class _MetadataUnpickler(pickle.Unpickler):
    """Constructs only DCP metadata classes and torch sizes/dtypes; refuses everything else."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - pickle hook
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            if module.startswith("torch.distributed._shard"):
                module = _DCP_META
                name = name.lstrip("_") if name != "MEM_FORMAT_ENCODING" else "_MEM_FORMAT_ENCODING"
            return getattr(__import__(module, fromlist=[name]), name)
        raise UnsafeCheckpoint(
            f"DCP metadata asks to construct {module}.{name}, which is not a DCP metadata class; "
            "refusing to unpickle it (the file may be malicious or from an unsupported torch)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("DCP metadata contains a persistent id; refusing to unpickle it")


def read_dcp_metadata(data: bytes, where: str = METADATA_NAME) -> Any:
    """Decode a DCP ``.metadata`` blob with the restricted unpickler."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # any malformed pickle stream
        raise InvalidManifest(f"{where}: not a readable DCP metadata file ({type(exc).__name__}: {exc})") from exc
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise InvalidManifest(f"{where}: DCP metadata holds {type(metadata).__name__}, not Metadata")
    return metadata


def detect(storage: Storage) -> bool:
    return is_dir(storage) and storage.exists(METADATA_NAME)


def open_reader(storage: Storage) -> "DcpReader":
    return DcpReader(storage)


def _json_safe(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v, where) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise UnsupportedFormat(f"{where}: non-tensor value of type {type(value).__name__} cannot be carried as JSON")


def _nest_param_groups(values: dict[str, Any]) -> dict[str, Any]:
    """DCP flattens ``optim.param_groups`` into ``optim.param_groups.<i>.<key>``; rebuild the list."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    out: dict[str, Any] = {}
    for key, value in values.items():
        m = re.match(r"^(.*param_groups)\.(\d+)\.([^.]+)$", key)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
        else:
            out[key] = value
    for prefix, by_index in groups.items():
        out[prefix] = [by_index[i] for i in sorted(by_index)]
    return out


class DcpReader(CheckpointReader):
    """A DCP directory; each chunk's torch.save blob is fetched with one ranged read and decoded."""

    def __init__(self, storage: Storage) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        super().__init__()
        self.storage = storage
        url = storage.url
        self._md = read_dcp_metadata(storage.read_bytes(METADATA_NAME), storage.where(METADATA_NAME))
        where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for index, info in (self._md.storage_data or {}).items():
            offset = None if index.offset is None else tuple(int(o) for o in index.offset)
            where[(index.fqn, offset)] = info
        self._where = where
        self._entries: dict[str, TensorEntry] = {}
        self._value_keys: list[str] = []
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
                self._entries[fqn] = TensorEntry(fqn, md.properties.dtype, shape, tuple(chunks))
            elif isinstance(md, BytesStorageMetadata):
                self._value_keys.append(fqn)
            else:
                raise InvalidManifest(f"{url}: entry {fqn!r} has unknown metadata {type(md).__name__}")
        self._values: dict[str, Any] | None = None
        self._local = threading.local()  # per-thread cache of the last decoded chunk
        self._lock = threading.Lock()
        self._layouts: dict[tuple[str, tuple[int, ...]], Any] = {}
        self.info = CheckpointInfo("dcp", url, meta={"dcp_version": self._md.version} if self._md.version else {})

    def tensors(self) -> Mapping[str, TensorEntry]:
        return self._entries

    def _blob(self, info: Any) -> io.BytesIO:
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
        return io.BytesIO(data)

    def _decode(self, info: Any, where: str) -> Any:
        try:
            return torch.load(self._blob(info), map_location="cpu", weights_only=True)
        except (UnsafeCheckpoint, InvalidManifest, UnsupportedFormat):
            raise
        except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds for bad bytes
            msg = (str(exc).splitlines() or [type(exc).__name__])[0]
            if "weights_only" in str(exc) or "Unsupported global" in str(exc):
                raise UnsafeCheckpoint(f"{where}: payload needs unsafe unpickling ({msg})") from None
            raise InvalidManifest(f"{where}: payload is not a readable torch.save blob ({msg})") from None

    def values(self) -> Mapping[str, Any]:
        if self._values is None:
            raw = {}
            for key in self._value_keys:
                info = self._where.get((key, None))
                if info is None:
                    raise InvalidManifest(f"{self.info.url}: no storage entry for value {key!r}")
                where = f"{self.info.url} [{key}]"
                raw[key] = _json_safe(self._decode(info, where), where)
            self._values = _nest_param_groups(raw)
        return self._values

    def chunk_tensor(self, entry: TensorEntry, index: int) -> torch.Tensor:
        """Decode stored chunk ``index`` of ``entry`` (cached: the last one stays for the next request)."""
        chunk = entry.chunks[index]
        cache = getattr(self._local, "cache", None)
        if cache is not None and cache[0] is chunk.locator:
            return cache[1]
        self._local.cache = None
        where = f"{self.info.url} [{entry.fqn} @ {list(chunk.offsets)}]"
        info = chunk.locator
        head = self.storage.read_bytes(str(info.relative_path), int(info.offset), int(info.offset) + 9)
        if head[:4] != b"PK\x03\x04" and head[8:9] == b"{" and not getattr(info, "transform_descriptors", None):
            tensor = self._safetensors_item(entry.fqn, info, where)
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
        from shardkit.checkpoint.codec import code_to_dtype, parse_safetensors_header

        name, base = str(info.relative_path), int(info.offset)
        size = self.storage.size(name) - base
        header = parse_safetensors_header(self.storage.read_bytes(name, base, base + min(size, 1 << 16)), size,
                                          where, lambda n: self.storage.read_bytes(name, base, base + n))
        e = header.entries.get(fqn)
        if e is None:
            raise InvalidManifest(f"{where}: the safetensors payload holds no tensor {fqn!r}")
        raw = bytearray(self.storage.read_bytes(name, base + e.start, base + e.end))
        out = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return out.view(code_to_dtype(e.dtype)).reshape(e.shape)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        for r in requests:
            entry = self._entries.get(r.fqn)
            if (entry is None or not 0 <= r.chunk < len(entry.chunks) or r.out.dtype != entry.dtype
                    or tuple(r.out.shape) != tuple(r.box[1])):
                raise IncompatibleStateDict(f"{r.fqn!r}: request does not match {self.info.url}")
        for r in requests:
            entry = self._entries[r.fqn]
            offsets = entry.chunks[r.chunk].offsets
            r0, r1 = row_range(offsets, r.box)
            layout = self._row_layout(entry, r.chunk)
            if layout is not None:  # read just these rows' bytes
                full_width = tuple(r.box[1][1:]) == tuple(entry.chunks[r.chunk].shape[1:])
                rows = r.out if full_width and r.out.is_contiguous() else torch.empty(
                    (r1 - r0,) + tuple(entry.chunks[r.chunk].shape[1:]), dtype=entry.dtype)
                self.storage.read_into(layout.file, layout.data_start + r0 * layout.row_bytes, as_bytes(rows))
                if rows is not r.out:
                    copy_rows_into(rows, offsets, r.box, r.out)
            else:
                tensor = self.chunk_tensor(entry, r.chunk)
                copy_rows_into(tensor if tensor.dim() == 0 else tensor[r0:r1], offsets, r.box, r.out)
            self.stats.add(read=r.out.numel() * r.out.element_size(), requests=1)

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


# --------------------------------------------------------------------------
# writing


def _flatten_values(values: dict[str, Any]) -> dict[str, Any]:
    """Flatten list-of-dict values the way DCP's ``flatten_state_dict`` does (``a.0.lr``)."""
    out: dict[str, Any] = {}

    def visit(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{key}.{k}", v)
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            for i, v in enumerate(value):
                visit(f"{key}.{i}", v)
        else:
            out[key] = value

    for key, value in values.items():
        visit(key, value)
    return out


def write_dcp(dst: Storage, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], values: Mapping[str, Any],
              fetch: Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor], *, block_bytes: int,
              on_bytes: Callable[[int], None] = lambda n: None) -> None:
    """Write a DCP directory that ``torch.distributed.checkpoint.load`` reads.

    ``fetch(fqn, offsets, shape)`` returns that box of the tensor; each tensor is
    written in dim-0 blocks of at most ``block_bytes`` (one DCP chunk each) into
    ``__0_0.distcp``.  ``.metadata`` (the commit) is written last, by torch's
    own ``FsspecWriter.finish``.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.storage import WriteResult

    data_name = "__0_0.distcp"

    def produce(out: Any) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
        state_md: dict[str, Any] = {}
        results: list[Any] = []
        planner_data: dict[str, tuple[Any, ...]] = {}
        pos = 0

        def put(blob: bytes) -> tuple[int, int]:
            nonlocal pos
            out.write(blob)
            start, pos = pos, pos + len(blob)
            return start, len(blob)

        for key, value in _flatten_values(values).items():
            buf = io.BytesIO()
            torch.save(value, buf)
            start, length = put(buf.getvalue())
            state_md[key] = BytesStorageMetadata()
            results.append(WriteResult(index=MetadataIndex(key), size_in_bytes=length,
                                       storage_data=_StorageInfo(data_name, start, length)))
            planner_data[key] = object_path(key)
        for fqn, dtype, shape in tensors:
            chunks = []
            if not shape or shape[0] == 0:
                blocks = [(0, shape[0] if shape else 0)]
            else:
                blocks = list(iter_row_blocks(shape[0], rows_per_block(dtype, shape, block_bytes)))
            for r0, r1 in blocks:
                offsets = (r0,) + (0,) * (len(shape) - 1) if shape else ()
                box = (r1 - r0,) + tuple(shape[1:]) if shape else ()
                tensor = fetch(fqn, offsets, box).contiguous()
                if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                    tensor = tensor.clone()  # torch.save writes the whole storage, not just the view
                buf = io.BytesIO()
                torch.save(tensor, buf)
                payload = tensor.numel() * tensor.element_size()
                del tensor
                start, length = put(buf.getvalue())
                on_bytes(payload)
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(box)))
                results.append(WriteResult(index=MetadataIndex(fqn, torch.Size(offsets)), size_in_bytes=length,
                                           storage_data=_StorageInfo(data_name, start, length)))
            state_md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
                                                  chunks=chunks)
            planner_data[fqn] = object_path(fqn)
        return state_md, results, planner_data

    state_md, results, planner_data = dst.write_stream(data_name, produce, fsync=False)
    metadata = Metadata(state_dict_metadata=state_md, planner_data=planner_data)
    writer = FsspecWriter(dst.url, sync_files=False, **dst.storage_options)
    dst._retry(f"committing {dst.where(METADATA_NAME)}", lambda: writer.finish(metadata, [results]))
