"""What a ``shard_placement_fn`` may return, and the groups that follows from it.

torch 2.13 lets the function return ``None`` (``Shard(0)``), a ``Shard(d)``,
or a ``ShardPlacementResult(placement, mesh_info)`` that puts one parameter
on a mesh of its own (e.g. experts sharded over an expert-data-parallel
mesh).  shardkit also accepts ``Replicate()``: the parameter is kept whole on
every rank of the (1-D) mesh and its gradient is all-reduced and averaged,
as under DDP.

Parameters on different meshes need different collectives, so a
``fully_shard`` call makes one :class:`ParamGroup` per distinct pair of
(shard group, replicate group), in the order their first parameter appears,
as torch does; with no per-parameter mesh that is the single group of old.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from shardkit.errors import ConfigurationError, UnsupportedMeshError
from shardkit.runtime.mesh_info import MeshInfo, mesh_info_for, replicate_mesh_info

try:  # torch's own class, so a shard_placement_fn written for torch runs unchanged
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # pragma: no cover - torch before 2.13
    from dataclasses import dataclass

    @dataclass
    class ShardPlacementResult:  # type: ignore[no-redef]
        """A parameter's FSDP placement and the mesh it is sharded over (torch 2.13's class)."""

        placement: Shard | None
        mesh_info: Any

__all__ = ["ShardPlacementResult", "resolve_placements", "group_by_mesh"]


def resolve_placements(fn: Callable[[nn.Parameter], Any] | None, params: list[nn.Parameter],
                       default: MeshInfo) -> list[tuple[MeshInfo, int]]:
    """``(mesh info, shard dim)`` of each parameter."""
    if fn is None:
        return [(default, 0)] * len(params)
    # id(torch mesh info) -> (that object, ours): its parameters share one group.  The entry holds
    # the object, so a result built per call cannot be freed and its id() reused by another mesh's.
    converted: dict[int, tuple[Any, MeshInfo]] = {}
    return [_resolve(fn(p), default, converted) for p in params]


def _resolve(result: Any, default: MeshInfo, converted: dict[int, tuple[Any, MeshInfo]]) -> tuple[MeshInfo, int]:
    if result is None:
        return default, 0
    if isinstance(result, Shard):
        return default, result.dim
    if isinstance(result, Replicate):
        if default.spmd is not None or default.mesh.ndim != 1:
            raise ConfigurationError(
                f"shard_placement_fn returned Replicate(), which shardkit supports on a 1-D mesh only, but "
                f"fully_shard's mesh is {tuple(default.mesh.shape)}{' (dp_mesh_dims)' if default.spmd else ''}; "
                "return a ShardPlacementResult with a mesh of its own instead"
            )
        return converted.setdefault(id(default), (default, replicate_mesh_info(default.mesh)))[1], 0
    if isinstance(result, ShardPlacementResult):
        info = result.mesh_info
        if id(info) not in converted:
            converted[id(info)] = (info, info if isinstance(info, MeshInfo) else _from_torch_mesh_info(info))
        return converted[id(info)][1], 0 if result.placement is None else result.placement.dim
    raise ConfigurationError(
        f"Invalid shard_placement_fn result: {result}; return None, Shard(dim), Replicate() or "
        "ShardPlacementResult(placement, mesh_info)"
    )


def _from_torch_mesh_info(info: Any) -> MeshInfo:
    """torch's FSDPMeshInfo / HSDPMeshInfo / DDPMeshInfo as ours."""
    mesh = getattr(info, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise ConfigurationError(
            f"ShardPlacementResult.mesh_info must be an FSDPMeshInfo(mesh, shard_mesh_dim=...), got {info!r}"
        )
    shard_dim, replicate_dim = getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None)
    if shard_dim is None and mesh.ndim == 1:
        return replicate_mesh_info(mesh)
    if (mesh.ndim, shard_dim, replicate_dim) in ((1, 0, None), (2, 1, 0)):
        return mesh_info_for(mesh)
    raise UnsupportedMeshError(
        f"ShardPlacementResult.mesh_info puts the shard on dim {shard_dim} and the replicas on dim "
        f"{replicate_dim} of a {mesh.ndim}-D mesh; use a 1-D mesh (shard_mesh_dim=0) or a 2-D "
        "(replicate, shard) mesh (replicate_mesh_dim=0, shard_mesh_dim=1)"
    )


def group_by_mesh(items: list[Any], infos: list[MeshInfo]) -> list[tuple[MeshInfo, list[Any]]]:
    """``items`` split by the process groups of their mesh infos, in first-seen order."""
    groups: dict[tuple[Any, Any], tuple[MeshInfo, list[Any]]] = {}
    for item, info in zip(items, infos):
        groups.setdefault((info.shard_group, info.replicate_group), (info, []))[1].append(item)
    return list(groups.values())
