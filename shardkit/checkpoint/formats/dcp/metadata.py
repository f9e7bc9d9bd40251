"""DCP's ``.metadata``: read with a restricted unpickler into plain records, written opcode by opcode.

``.metadata`` is a pickle of a few of torch's DCP dataclasses (``Metadata``,
``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``MetadataIndex``,
``_StorageInfo`` ...).  Raw pickle executes whatever it names, so reading goes
through :class:`_MetadataUnpickler`, which maps exactly those class names to the
small record classes below and refuses every other global
(:class:`~shardkit.errors.UnsafeCheckpoint`).  Writing emits the protocol-2
opcodes ``pickle.dump`` would emit for torch's classes, so ``dcp.load`` reads
the file, without the pickle module.

Neither direction imports ``torch.distributed.checkpoint``: importing that
package costs about 50 MiB of resident memory by itself, a fifth of the
offline tools' whole allowance beside the interpreter, and the file format is
all we need from it.
"""

from __future__ import annotations

import builtins
import io
import pickle  # restricted reader only; see _MetadataUnpickler
from typing import Any, Mapping

import torch

from shardkit.checkpoint.formats.pickle_ops import Call, New, PickleTuple, encode
from shardkit.errors import InvalidManifest, UnsafeCheckpoint

__all__ = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
           "StorageInfo", "read_dcp_metadata", "encode_dcp_metadata"]

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


class _Record:
    """Attributes as pickle's BUILD sets them; class attributes give the defaults older files omit."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class Metadata(_Record):
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class TensorStorageMetadata(_Record):
    properties: Any = None
    size: Any = ()
    chunks: Any = ()


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    offsets: Any = ()
    sizes: Any = ()


class TensorProperties(_Record):
    dtype: Any = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):  # torch's __getstate__: (dtype, layout, requires_grad, memory_format, pin)
            self.dtype = state[0]
        else:
            self.__dict__.update(state)


class StorageMeta(_Record):
    pass


class StorageInfo(_Record):
    relative_path: Any = None
    offset: Any = 0
    length: Any = 0
    transform_descriptors: Any = None


class StoragePrefix(_Record):
    prefix: Any = None


class MetadataIndex(_Record):
    """A storage-data key: equal and hashed by ``(fqn, offset)`` like torch's (``index`` is a hint)."""

    fqn: Any = None
    offset: Any = None
    index: Any = None

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, MetadataIndex) and (self.fqn, self.offset) == (other.fqn, other.offset)

    def __hash__(self) -> int:
        return hash((self.fqn, None if self.offset is None else tuple(self.offset)))


def _memory_format(value: Any) -> Any:
    return value


_CLASSES: dict[tuple[str, str], Any] = {
    **{(_META, c.__name__): c for c in (Metadata, TensorStorageMetadata, BytesStorageMetadata,
                                        ChunkStorageMetadata, TensorProperties, StorageMeta, MetadataIndex)},
    (_META, "_MEM_FORMAT_ENCODING"): _memory_format,
    # older torch kept TensorProperties next to ShardedTensor
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): TensorProperties,
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): _memory_format,
    (_FS, "_StorageInfo"): StorageInfo,
    (_FS, "_StoragePrefix"): StoragePrefix,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): dict,
    **{("builtins", n): getattr(builtins, n) for n in ("set", "frozenset", "tuple", "list", "dict")},
}
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    """Constructs only DCP metadata records and torch sizes/dtypes/layouts; refuses everything else."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - pickle hook
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            from torch.serialization import _get_layout

            return _get_layout
        if module == "pathlib" and name in _PATHS:
            import pathlib

            return getattr(pathlib, name)
        found = _CLASSES.get((module, name))
        if found is not None:
            return found
        raise UnsafeCheckpoint(
            f"DCP metadata asks to construct {module}.{name}, which is not a DCP metadata class; "
            "refusing to unpickle it (the file may be malicious or from an unsupported torch)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("DCP metadata contains a persistent id; refusing to unpickle it")


def read_dcp_metadata(data: bytes, where: str = ".metadata") -> Metadata:
    """Decode a DCP ``.metadata`` blob with the restricted unpickler."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # any malformed pickle stream
        raise InvalidManifest(f"{where}: not a readable DCP metadata file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise InvalidManifest(f"{where}: DCP metadata holds {type(metadata).__name__}, not Metadata")
    return metadata


# --------------------------------------------------------------------------
# writing: the opcodes pickle.dump emits for torch's classes


def _size(shape: Any) -> Call:
    return Call("torch", "Size", (PickleTuple(int(n) for n in shape),))


def _index(fqn: str, offsets: Any) -> New:
    state = {"fqn": fqn, "index": None}
    if offsets is not None:
        state["offset"] = _size(offsets)
    return New(_META, "MetadataIndex", state)


def encode_dcp_metadata(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...], list[tuple[int, ...]],
                                                    list[tuple[int, ...]]]],
                        values: list[str], storage: Mapping[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
                        planner_data: Mapping[str, tuple[Any, ...]]) -> bytes:
    """The ``.metadata`` bytes of a DCP checkpoint, as torch's ``pickle.dump`` of ``Metadata`` spells them.

    ``tensors``: fqn -> (dtype, global shape, chunk offsets, chunk sizes);
    ``values``: fqns stored as bytes; ``storage``: (fqn, chunk offsets or
    ``None``) -> (file, offset, length); ``planner_data``: fqn -> nested path.
    """
    state_md: dict[str, Any] = {}
    for fqn, (dtype, shape, offsets, sizes) in tensors.items():
        props = New(_META, "TensorProperties", PickleTuple((dtype, Call("torch.serialization", "_get_layout",
                                                                      ("torch.strided",)),
                                                        False, Call(_META, "_MEM_FORMAT_ENCODING", (0,)), False)))
        chunks = [New(_META, "ChunkStorageMetadata", {"offsets": _size(o), "sizes": _size(s)})
                  for o, s in zip(offsets, sizes)]
        state_md[fqn] = New(_META, "TensorStorageMetadata", {"properties": props, "size": _size(shape),
                                                              "chunks": chunks})
    for fqn in values:
        state_md[fqn] = New(_META, "BytesStorageMetadata", None)
    storage_data = {_index(fqn, offsets): New(_FS, "_StorageInfo", {"relative_path": name, "offset": start,
                                                                      "length": length})
                    for (fqn, offsets), (name, start, length) in storage.items()}
    return encode(New(_META, "Metadata", {
        "state_dict_metadata": state_md,
        "planner_data": {k: PickleTuple(v) for k, v in planner_data.items()},
        "storage_data": storage_data, "storage_meta": None, "version": None}))
