"""The pickles a torch_checkpointing step folder holds, read without running them.

Two kinds of pickle sit in a step folder, and raw ``pickle.loads`` would run
whatever either names:

* ``metadata.pkl`` is ``pickle.dumps(DistributedMetadata.to_dict())``: dicts,
  lists, tuples, strings, numbers and ``None``, and nothing else (the library
  turns its own classes -- ``DTensorShardingMetadata``, ``DeviceMeshSpec``,
  ``ShardSpec``, ``LayoutInfo`` -- into dicts before pickling).  So
  :func:`load_metadata_pickle` admits no global at all.
* each item file (``model_0.pt``) is a ``torch.save`` archive of that rank's
  item: its ``data.pkl`` rebuilds DTensors through
  ``torch._tensor._rebuild_from_type_v2`` and ``_rebuild_wrapper_subclass``,
  with a ``DTensorSpec`` holding the ``DeviceMesh`` (its ``_MeshLayout`` and
  rank map), the placements (``Shard``, ``Replicate``, ``_StridedShard``) and
  a ``TensorMeta``.  :func:`load_item_pickle` maps exactly those names (see
  :data:`ALLOWED_GLOBALS`) to inert stand-ins: a tensor becomes a
  :class:`TensorRef` (which storage record, dtype, offset, shape, strides) and
  no byte of tensor data is read; a DTensor becomes a :class:`DTensorRef`
  around its local tensor's reference; the mesh and spec objects keep their
  pickled fields as data and do nothing.

Any other global, an extension code, or a persistent id that is not a
``torch.save`` storage is refused with :class:`~shardkit.errors.UnsafeCheckpoint`
naming the file and what it named, before anything it names is looked up.
"""

from __future__ import annotations

import io
import pickle  # restricted readers only: every global goes through find_class below
import pickletools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardkit.checkpoint.formats.torchsave.reader import STORAGE_TYPES
from shardkit.errors import InvalidManifest, UnsafeCheckpoint

__all__ = ["TensorRef", "DTensorRef", "StandIn", "ALLOWED_GLOBALS", "load_metadata_pickle", "load_item_pickle"]

_REFUSED_OPS = {"EXT1", "EXT2", "EXT4"}  # the copyreg extension registry names callables by number


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a torch.save archive, not read: record ``archive/data/<record>`` holds its storage."""

    record: str
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class DTensorRef:
    """A DTensor as pickled: its local tensor (a :class:`TensorRef`) and its global shape and dtype."""

    local: TensorRef
    shape: tuple[int, ...]
    dtype: torch.dtype


class StandIn:
    """An allowlisted torch.distributed object rebuilt as data: the arguments and state the pickle gives."""

    def __new__(cls, *args: Any) -> "StandIn":
        self = object.__new__(cls)
        self.args = args
        self.state = None
        return self

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _stand_in(name: str) -> type[StandIn]:
    return type(name.rsplit(".", 1)[1], (StandIn,), {"__module__": __name__, "pickled_as": name})


class _Ordered(dict):
    """``collections.OrderedDict`` as a plain dict; the ``_metadata`` attribute a module state dict
    carries (per-module versions) is dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _Storage:
    record: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _Wrapper:
    """What ``_rebuild_wrapper_subclass`` makes: the subclass's global dtype and shape, no data yet."""

    cls: Any
    dtype: torch.dtype
    shape: tuple[int, ...]


class _TypeMarker:
    def __init__(self, name: str) -> None:
        self.name = name


_DTENSOR = _TypeMarker("torch.distributed.tensor.DTensor")
_PLAIN_TENSOR_TYPES = (_TypeMarker("torch.Tensor"), _TypeMarker("torch.nn.parameter.Parameter"))


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise ValueError(f"{what} {value!r} is not a tuple of non-negative ints")
    return tuple(value)


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not isinstance(storage, _Storage) or not isinstance(storage_offset, int) or storage_offset < 0:
        raise ValueError("a tensor rebuilt from something other than a storage record")
    return TensorRef(storage.record, storage.dtype, storage.numel, storage_offset, _ints(size, "size"),
                     _ints(stride, "stride"))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, *rest: Any) -> _Wrapper:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"wrapper subclass with dtype {dtype!r}")
    return _Wrapper(cls, dtype, _ints(size, "size"))


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func not in (_rebuild_tensor_v2, _rebuild_wrapper_subclass, _rebuild_parameter):
        raise ValueError("a tensor rebuilt by an unexpected function")
    made = func(*args)
    if isinstance(made, _Wrapper):
        # the state is the subclass's __dict__, or (__dict__, slots) as pickle's own
        parts = state if isinstance(state, tuple) else (state,)
        fields = {k: v for part in parts if isinstance(part, dict) for k, v in part.items()}
        local = fields.get("_local_tensor")
        if new_type is not _DTENSOR or made.cls is not _DTENSOR or not isinstance(local, TensorRef):
            raise ValueError("a tensor subclass other than DTensor, or a DTensor without its local tensor")
        return DTensorRef(local, made.shape, made.dtype)
    if new_type not in _PLAIN_TENSOR_TYPES:
        raise ValueError("a tensor rebuilt as an unexpected type")
    return made  # a plain tensor with Python attributes: the attributes are dropped


def _layout(name: Any) -> str:
    if name != "torch.strided":
        raise ValueError(f"tensor layout {name!r} (only strided tensors are stored by torch_checkpointing)")
    return name


def _device(*args: Any) -> str:
    return str(args[0]) if args else "cpu"


def _size(dims: Any = ()) -> tuple[int, ...]:
    return _ints(dims, "torch.Size")


_DTENSOR_CLASSES = (
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
    "torch.distributed.tensor.placement_types.Shard",
    "torch.distributed.tensor.placement_types.Replicate",
    "torch.distributed.tensor.placement_types._StridedShard",
)

# "module.name" -> what the item pickles' find_class returns for it (dtypes and storage types are added below)
ALLOWED_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": _Ordered,
    "torch.Size": _size,
    "torch.device": _device,
    "torch.serialization._get_layout": _layout,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    _DTENSOR.name: _DTENSOR,
    **{marker.name: marker for marker in _PLAIN_TENSOR_TYPES},
    **{name: _stand_in(name) for name in _DTENSOR_CLASSES},
    **{f"torch.{storage}": _StorageType(dtype) for dtype, storage in STORAGE_TYPES.items()},
}


def _refuse_extension_codes(data: bytes, where: str) -> None:
    try:
        for op, _, _ in pickletools.genops(data):
            if op.name in _REFUSED_OPS:
                raise UnsafeCheckpoint(f"{where}: refusing to unpickle it: it names a callable by extension code "
                                       f"({op.name}), which torch_checkpointing never writes")
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed stream: the load below says what is wrong
        raise InvalidManifest(f"{where}: not a readable pickle ({type(exc).__name__}: {exc})") from None


class _Restricted(pickle.Unpickler):
    """Looks up only ``allowed`` names; every other global is refused, naming the file and the global."""

    def __init__(self, data: bytes, where: str, allowed: dict[str, Any], hint: str,
                 storage: Callable[[Any], Any] | None) -> None:
        super().__init__(io.BytesIO(data))
        self._where, self._allowed, self._hint, self._storage = where, allowed, hint, storage

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - pickle hook
        key = f"{module}.{name}"
        if key in self._allowed:
            return self._allowed[key]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"{self._where}: refusing to unpickle it: it names {key}, and loading it could run "
                               f"code the file names; {self._hint}")

    def persistent_load(self, pid: Any) -> Any:
        if self._storage is None:
            raise UnsafeCheckpoint(f"{self._where}: refusing to unpickle it: it holds a persistent id {pid!r}, "
                                   f"which {self._hint}")
        return self._storage(pid)


def _load(data: bytes, where: str, allowed: dict[str, Any], hint: str,
          storage: Callable[[Any], Any] | None) -> Any:
    _refuse_extension_codes(data, where)
    try:
        return _Restricted(data, where, allowed, hint, storage).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed stream or unexpected shape of an allowed call
        raise InvalidManifest(f"{where}: not a readable torch_checkpointing pickle ({type(exc).__name__}: "
                              f"{exc})") from None


def load_metadata_pickle(data: bytes, where: str) -> Any:
    """``metadata.pkl``: plain containers, strings and numbers; any global or persistent id is refused."""
    return _load(data, where, {}, "torch_checkpointing's metadata.pkl holds plain dicts, lists and numbers only",
                 None)


def _item_storage(pid: Any) -> _Storage:
    if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage" or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str) or not isinstance(pid[4], int) or pid[4] < 0):
        raise ValueError(f"persistent id {pid!r} is not a torch.save storage record")
    return _Storage(pid[2], pid[1].dtype, pid[4])


def load_item_pickle(data: bytes, where: str) -> Any:
    """An item file's ``data.pkl``: tensors as :class:`TensorRef`, DTensors as :class:`DTensorRef`, torch's
    mesh, spec and placement objects as :class:`StandIn` s; every other global is refused."""
    return _load(data, where, ALLOWED_GLOBALS,
                 "shardkit reads what torch_checkpointing writes (tensors, DTensors with their mesh and Shard/"
                 "Replicate/_StridedShard placements, plain values) and nothing else", _item_storage)
