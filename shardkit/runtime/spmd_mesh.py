"""The full SPMD mesh: ``fully_shard(module, mesh=world, dp_mesh_dims=...)``.

Note [the full SPMD mesh]
    Instead of slicing the data-parallel sub-mesh off a world mesh, a user may
    make every parameter a DTensor on the *whole* mesh (``distribute_tensor``,
    ``distribute_module``), ``Replicate()`` on the data-parallel dims, and name
    those dims in ``DataParallelMeshDims(shard=..., replicate=...)``.  FSDP
    then shards each parameter's local tensor over the ``shard`` dims (several
    names are flattened into one dim) and reduces its gradient over ``shard``
    and ``replicate``, exactly as for a TP parameter on a sub-mesh (Note
    [composing FSDP with TP]); only the description differs:

        placements on dp shard dim i  = _StridedShard(d, split_factor=n)  if the dims right of i cut dim d
                                        into n pieces, else Shard(d)
        every other dim               = the parameter's own placement

    The gradient keeps autograd's placement on the dp dims (typically
    ``Partial`` when the batch is ``Shard(0)`` over dp): FSDP's reduce-scatter
    and all-reduce are that reduction, so redistributing first would reduce
    twice.  The layout is torch's own, so both implementations produce the
    same DTensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardkit.errors import UnshardableParameterError, UnsupportedMeshError
from shardkit.runtime.mesh_info import MeshInfo, mesh_info_for, replicate_mesh_info
from shardkit.runtime.tensor_parallel import TPLayout

try:  # torch's own class, so code written for torch passes the same object
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # pragma: no cover - torch before 2.13 has no SPMD form; the same fields
    @dataclass
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """Which named dims of the full mesh are data parallel (torch 2.13's class)."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self) -> None:
            if self.shard is None and self.replicate is None:
                raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

        @property
        def shard_names(self) -> tuple[str, ...]:
            return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            r = self.replicate
            return () if r is None else (r,) if isinstance(r, str) else tuple(r)

__all__ = ["DataParallelMeshDims", "SpmdDims", "spmd_mesh_info", "spmd_layout"]


@dataclass(frozen=True)
class SpmdDims:
    """Where the data-parallel dims sit in the full mesh the parameters live on."""

    mesh: DeviceMesh
    dims: DataParallelMeshDims
    shard_indices: tuple[int, ...]
    replicate_indices: tuple[int, ...]


def _check_names(mesh: DeviceMesh, dims: DataParallelMeshDims) -> None:
    if dims.shard is None and dims.replicate is None:
        raise UnsupportedMeshError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise UnsupportedMeshError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided; build it with "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp')) and name those dims in DataParallelMeshDims"
        )
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in mesh.mesh_dim_names:
            raise UnsupportedMeshError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}; "
                "DataParallelMeshDims names dims of the mesh passed to fully_shard"
            )


def spmd_mesh_info(mesh: DeviceMesh, dims: DataParallelMeshDims) -> MeshInfo:
    """The data-parallel groups named by ``dims`` in the full mesh ``mesh``:
    FSDP (shard only), HSDP (both) or replicate-only, as torch builds them."""
    _check_names(mesh, dims)
    names = mesh.mesh_dim_names

    def submesh(selected: tuple[str, ...]) -> DeviceMesh:
        if len(selected) == 1:
            return mesh[selected[0]]
        return mesh[selected]._flatten("_".join(selected))  # one group over the named dims, as torch does

    spmd = SpmdDims(mesh, dims, tuple(names.index(n) for n in dims.shard_names),
                    tuple(names.index(n) for n in dims.replicate_names))
    if not dims.shard_names:
        return replicate_mesh_info(submesh(dims.replicate_names), spmd)
    if not dims.replicate_names:
        dp_mesh = submesh(dims.shard_names)
    else:
        dp_mesh = DeviceMesh._concatenate([submesh(dims.replicate_names), submesh(dims.shard_names)])
    info = mesh_info_for(dp_mesh)
    return MeshInfo(*(getattr(info, f) for f in ("mesh", "shard_group", "shard_size", "shard_rank",
                                                 "replicate_group", "replicate_size", "replicate_rank")), spmd)


def spmd_layout(param: nn.Parameter, mesh_info: MeshInfo, shard_dim: int, name: str) -> TPLayout:
    """The sharded layout of a DTensor parameter on the full SPMD mesh (see the Note)."""
    spmd: SpmdDims = mesh_info.spmd
    if not isinstance(param, DTensor):
        raise UnshardableParameterError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
            f"(e.g. via distribute_module). Got plain tensor for parameter '{name}'."
        )
    spec = param._spec
    if spec.mesh is not spmd.mesh:
        raise UnsupportedMeshError(
            "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got different "
            f"mesh objects (parameter '{name}' lives on {spec.mesh.mesh_dim_names}); distribute every "
            "parameter on the mesh object you pass as mesh="
        )
    dim_names = spmd.mesh.mesh_dim_names
    for kind, indices in (("shard", spmd.shard_indices), ("replicate", spmd.replicate_indices)):
        for idx in indices:
            if not isinstance(spec.placements[idx], Replicate):
                raise UnshardableParameterError(
                    f"Expected Replicate() on DP {kind} dim '{dim_names[idx]}' (index {idx}) but got "
                    f"{spec.placements[idx]} for parameter '{name}'; data parallelism owns that dim"
                )
    placements = list(spec.placements)
    for idx in spmd.shard_indices:
        split = math.prod(spmd.mesh.size(j) for j in range(idx + 1, spmd.mesh.ndim)
                          if isinstance(spec.placements[j], (Shard, _StridedShard))
                          and spec.placements[j].dim == shard_dim)
        placements[idx] = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    mesh, placements = _flatten_shard_dims(mesh_info, placements)
    return TPLayout(spec, mesh, tuple(placements), frozenset(spmd.shard_indices + spmd.replicate_indices))


def _flatten_shard_dims(mesh_info: MeshInfo, placements: list[Placement]) -> tuple[DeviceMesh, list[Placement]]:
    """With several dp shard dims, describe the shard on the one flattened dp dim
    (preceded by the replicate dim for HSDP), so the DTensor has one Shard axis for dp."""
    spmd: SpmdDims = mesh_info.spmd
    if len(spmd.shard_indices) <= 1:
        return spmd.mesh, placements
    hsdp = mesh_info.shard_group is not None and mesh_info.replicate_group is not None
    submeshes: list[DeviceMesh] = []
    out: list[Placement] = []
    for i, name in enumerate(spmd.mesh.mesh_dim_names):
        if i in spmd.shard_indices:
            if i == spmd.shard_indices[0]:
                submeshes.append(mesh_info.mesh)
                out.extend((Replicate(), placements[i]) if hsdp else (placements[i],))
        elif i in spmd.replicate_indices and hsdp:
            continue  # the flattened HSDP mesh above holds it
        else:
            submeshes.append(spmd.mesh[name])
            out.append(placements[i])
    return DeviceMesh._concatenate(submeshes), out
