"""A torch_checkpointing ``metadata.pkl`` as checked records: which rank holds which box of every tensor.

The file (version ``2.0``, what torch_checkpointing 0.1 writes) is
``{"metadata": {item: {"nested_path_to_metadata": {json path: [group]},
"rank_to_layout_info": {rank: layout | None}}}, "world_size": n, "version": "2.0"}``
where each group is ``{"sharding_metadata": {"type", "data"}, "ranks": (...)}``:
the ranks that share one sharding of that path.  Two sharding types exist:

* ``DTensorShardingMetadata``: global shape, dtype, the device mesh (shape and
  the global rank at each position) and one placement per mesh dim (``Shard``,
  ``StridedShard`` or ``Replicate``).  A rank's local tensor is what DTensor's
  own rule gives it at its mesh coordinate; :func:`pieces_of` asks
  :mod:`~shardkit.checkpoint.geometry.placements` (the same rule, with strided
  ranks holding several ranges) for the (global box, local box) pieces.  Plain
  tensors in a resharded item are recorded this way too, replicated on a 1-D
  mesh of every rank.
* ``default_tensor_v1``: explicit global offsets, local offsets and sizes of
  each piece a rank holds.

A layout of ``None`` means the default file ``<item>_<rank>.pt``.  Everything
here is checked (types, ranks inside the world, boxes inside the tensor, file
names inside the folder) before a reader uses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.checkpoint.geometry.boxes import Box
from shardkit.checkpoint.geometry.placements import Piece, Spec, held_pieces, local_shape
from shardkit.checkpoint.io.names import check_name
from shardkit.errors import InvalidManifest, UnsupportedFormat, UnsupportedVersion

__all__ = ["Sharding", "ItemLayout", "StepMetadata", "parse_metadata", "pieces_of", "local_extent", "default_file",
           "spec_text"]

SUPPORTED_VERSION = "2.0"


@dataclass(frozen=True)
class Sharding:
    """One sharding of a tensor: its global shape and dtype, and either a mesh with placements (``specs``)
    or explicit pieces (``explicit``, for ``default_tensor_v1``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh_shape: tuple[int, ...] = ()
    mesh_ranks: tuple[int, ...] = ()
    dim_names: tuple[str, ...] | None = None
    specs: tuple[Spec, ...] = ()
    explicit: tuple[Piece, ...] | None = None


@dataclass(frozen=True)
class ItemLayout:
    """One item's tensors (nested path -> [(sharding, ranks)]) and each rank's file."""

    paths: dict[tuple, list[tuple[Sharding, tuple[int, ...]]]]
    files: dict[int, str]


@dataclass(frozen=True)
class StepMetadata:
    world_size: int
    items: dict[str, ItemLayout]


def default_file(item: str, rank: int) -> str:
    """Where torch_checkpointing writes ``item`` of ``rank`` when no layout says otherwise."""
    return f"{item}_{rank}.pt"


def spec_text(spec: Spec) -> str:
    if spec[0] == "replicate":
        return "Replicate()"
    if spec[0] == "shard":
        return f"Shard({spec[1]})"
    return f"_StridedShard({spec[1]}, split_factor={spec[2]})"


def _coord(sharding: Sharding, rank: int) -> tuple[int, ...]:
    """``rank``'s coordinate on the mesh: its position in ``mesh_ranks``, unravelled row-major (as
    torch_checkpointing's ``DeviceMeshSpec.get_coordinate``)."""
    coord, rest = [], sharding.mesh_ranks.index(rank)
    for n in reversed(sharding.mesh_shape):
        coord.append(rest % n)
        rest //= n
    return tuple(reversed(coord))


def pieces_of(sharding: Sharding, rank: int) -> list[Piece]:
    """The (global box, local box) pieces ``rank`` holds of a tensor sharded as ``sharding``."""
    if sharding.explicit is not None:
        return list(sharding.explicit)
    return held_pieces(sharding.shape, sharding.mesh_shape, _coord(sharding, rank), sharding.specs)


def local_extent(sharding: Sharding, rank: int) -> tuple[int, ...] | None:
    """The shape of ``rank``'s local tensor (``None`` for explicit pieces, which do not imply it)."""
    if sharding.explicit is not None:
        return None
    return local_shape(sharding.shape, sharding.mesh_shape, _coord(sharding, rank), sharding.specs)


class _Bad(Exception):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Bad(what)


def _int_tuple(value: Any, what: str, minimum: int = 0) -> tuple[int, ...]:
    _need(isinstance(value, (list, tuple)) and all(type(v) is int and v >= minimum for v in value),
          f"{what} is {value!r}, not a list of integers >= {minimum}")
    return tuple(value)


def _dtype(value: Any) -> torch.dtype:
    found = getattr(torch, value[len("torch."):], None) if isinstance(value, str) and value.startswith("torch.") \
        else None
    _need(isinstance(found, torch.dtype), f"dtype {value!r} is not a torch dtype")
    return found


def _specs(placements: Any, ndim: int) -> tuple[Spec, ...]:
    _need(isinstance(placements, list), "placements are not a list")
    specs: list[Spec] = []
    for p in placements:
        _need(isinstance(p, dict), f"placement {p!r} is not a dict")
        kind = p.get("type")
        if kind == "Replicate":
            specs.append(("replicate",))
            continue
        _need(kind in ("Shard", "StridedShard"), f"placement type {kind!r} is not Shard, StridedShard or Replicate")
        dim = p.get("dim")
        _need(type(dim) is int and -ndim <= dim < ndim, f"placement {p!r} shards no dim of a {ndim}-D tensor")
        dim = dim + ndim if dim < 0 else dim
        if kind == "Shard":
            specs.append(("shard", dim))
        else:
            factor = p.get("split_factor")
            _need(type(factor) is int and factor >= 1, f"placement {p!r} has no split_factor >= 1")
            specs.append(("strided", dim, factor))
    return tuple(specs)


def _box_inside(box: Box, shape: tuple[int, ...]) -> bool:
    return len(box[0]) == len(shape) and all(o + n <= d for o, n, d in zip(box[0], box[1], shape))


def _sharding(packed: Any, world_size: int) -> Sharding:
    _need(isinstance(packed, dict) and isinstance(packed.get("data"), dict), "sharding metadata is not a dict")
    kind, data = packed.get("type"), packed["data"]
    shape = _int_tuple(data.get("global_shape"), "global_shape")
    dtype = _dtype(data.get("dtype"))
    if kind == "DTensorShardingMetadata":
        mesh = data.get("mesh_spec")
        _need(isinstance(mesh, dict), "mesh_spec is not a dict")
        mesh_shape = _int_tuple(mesh.get("mesh_shape"), "mesh_shape", 1)
        ranks = _int_tuple(mesh.get("mesh_data"), "mesh_data")
        _need(len(ranks) == math.prod(mesh_shape) and len(set(ranks)) == len(ranks)
              and all(r < world_size for r in ranks), f"mesh {mesh!r} does not list distinct ranks of the world")
        names = mesh.get("mesh_dim_names")
        _need(names is None or (isinstance(names, (list, tuple)) and len(names) == len(mesh_shape)),
              "mesh_dim_names do not match the mesh")
        specs = _specs(data.get("placements"), len(shape))
        _need(len(specs) == len(mesh_shape), "one placement per mesh dim is needed")
        return Sharding(shape, dtype, mesh_shape, ranks, tuple(names) if names else None, specs)
    if kind == "default_tensor_v1":
        parts = [data.get(k) for k in ("global_offsets", "local_offsets", "local_sizes")]
        _need(all(isinstance(p, list) for p in parts) and len({len(p) for p in parts}) == 1,
              "default_tensor_v1 offsets and sizes do not line up")
        pieces = []
        for g, lo, n in zip(*parts):
            g, lo, n = _int_tuple(g, "global offset"), _int_tuple(lo, "local offset"), _int_tuple(n, "local size")
            _need(_box_inside((g, n), shape), f"piece at {list(g)} of {list(n)} lies outside {list(shape)}")
            pieces.append(((g, n), (lo, n)))
        return Sharding(shape, dtype, explicit=tuple(pieces))
    raise UnsupportedFormat(f"sharding metadata of type {kind!r} (shardkit reads DTensorShardingMetadata and "
                            "default_tensor_v1)")


def _item(name: str, raw: Any, world_size: int, where: str) -> ItemLayout:
    _need(isinstance(raw, dict) and isinstance(raw.get("nested_path_to_metadata"), dict)
          and isinstance(raw.get("rank_to_layout_info"), dict), f"item {name!r} is not a metadata record")
    layouts = {int(r): v for r, v in raw["rank_to_layout_info"].items()}
    _need(set(layouts) == set(range(world_size)), f"item {name!r} lists files for ranks {sorted(layouts)}, not "
                                                   f"0..{world_size - 1}")
    files: dict[int, str] = {}
    for rank, layout in sorted(layouts.items()):
        if layout is None:
            files[rank] = default_file(name, rank)
            continue
        _need(isinstance(layout, dict) and isinstance(layout.get("serialization_format"), dict),
              f"the layout of item {name!r} rank {rank} is not a record")
        kind = layout["serialization_format"].get("type")
        if kind != "TorchSerialization":
            raise UnsupportedFormat(f"{where}: item {name!r} was written with {kind} (shardkit reads items written "
                                    "with torch_checkpointing's default TorchSerialization)")
        files[rank] = check_name(layout.get("file_path"), where)
    paths: dict[tuple, list[tuple[Sharding, tuple[int, ...]]]] = {}
    for text, groups in raw["nested_path_to_metadata"].items():
        try:
            path = tuple(json.loads(text))
        except (TypeError, ValueError):
            raise _Bad(f"nested path {text!r} is not JSON") from None
        _need(bool(path) and all(isinstance(p, (str, int)) for p in path), f"nested path {text!r} is not a path")
        _need(isinstance(groups, list) and bool(groups), f"path {text!r} lists no ranks")
        entries = []
        for group in groups:
            _need(isinstance(group, dict), f"a group of {text!r} is not a dict")
            ranks = _int_tuple(group.get("ranks"), "ranks")
            _need(all(r < world_size for r in ranks), f"{text!r} names ranks outside the world of {world_size}")
            sharding = _sharding(group.get("sharding_metadata"), world_size)
            _need(sharding.explicit is not None or set(ranks) <= set(sharding.mesh_ranks),
                  f"{text!r} names ranks {list(ranks)} that its mesh does not hold")
            entries.append((sharding, ranks))
        paths[path] = entries
    return ItemLayout(paths, files)


def parse_metadata(raw: Any, where: str) -> StepMetadata:
    """Check what ``metadata.pkl`` unpickled to and turn it into :class:`StepMetadata`."""
    if not isinstance(raw, dict):
        raise InvalidManifest(f"{where}: holds a {type(raw).__name__}, not torch_checkpointing metadata")
    version = raw.get("version", "1.0")
    if version != SUPPORTED_VERSION:
        raise UnsupportedVersion(f"{where}: metadata version {version!r}; shardkit reads torch_checkpointing's "
                                 f"version {SUPPORTED_VERSION!r} (what torch_checkpointing 0.1 writes)")
    try:
        world_size = raw.get("world_size")
        _need(type(world_size) is int and world_size >= 1, f"world_size is {world_size!r}")
        _need(isinstance(raw.get("metadata"), dict), "it holds no item metadata")
        items = {name: _item(name, item, world_size, where) for name, item in raw["metadata"].items()
                 if isinstance(name, str)}
        _need(len(items) == len(raw["metadata"]), "an item key is not a string")
    except _Bad as exc:
        raise InvalidManifest(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise InvalidManifest(f"{where}: malformed metadata ({exc})") from None
    files = [f for item in items.values() for f in item.files.values()]
    if len(set(files)) != len(files):
        raise InvalidManifest(f"{where}: two items or ranks share one file")
    return StepMetadata(world_size, items)
