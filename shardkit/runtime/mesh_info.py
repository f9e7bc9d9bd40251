"""Which ranks shard a parameter, which replicate it, and on what device.

A ``fully_shard`` mesh is either 1-D (FSDP: every rank holds a dim-0 slice)
or 2-D ``(replicate, shard)`` (HSDP: slices within each row, rows are
replicas).  A ``(W, 1)`` mesh is therefore NO_SHARD / DDP: the shard groups
have one rank, so all-gather and reduce-scatter become local copies and only
the all-reduce over the replicate dim communicates.  Everything the
collectives need is resolved once here into a :class:`MeshInfo`.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardkit.errors import ConfigurationError, UnnamedMeshDimsError, UnsupportedMeshError
from shardkit.held_groups import release_at_exit

__all__ = ["MeshInfo", "PostForwardGroup", "default_mesh", "device_from_mesh", "mesh_info_for",
           "post_forward_group", "replicate_mesh_info"]


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel layout of one ``fully_shard`` call (or of the
    parameters of that call a ``shard_placement_fn`` put on a mesh of their own).

    A replicate-only layout (``replicate()``, ``Replicate()`` from a
    ``shard_placement_fn``, ``dp_mesh_dims`` naming replicate dims only) has
    no shard group: one shard rank, so all-gather and reduce-scatter are local
    copies and the gradient is all-reduced over ``replicate_group``."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup | None  # None when replicate-only
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None  # None on a 1-D FSDP mesh
    replicate_size: int
    replicate_rank: int
    spmd: Any = None  # a SpmdDims when the parameters are DTensors on the full SPMD mesh (dp_mesh_dims)

    @property
    def placements(self) -> tuple[Placement, ...]:
        """Placements of a dim-0 sharded parameter on this mesh."""
        return self.placements_for(0)

    def placements_for(self, shard_dim: int) -> tuple[Placement, ...]:
        return self.data_parallel_placements(Shard(shard_dim))

    def data_parallel_placements(self, fsdp: Placement) -> tuple[Placement, ...]:
        """This mesh's placements of a parameter FSDP cuts with ``fsdp``."""
        if self.shard_group is None:
            return (Replicate(),) * self.mesh.ndim
        return (fsdp,) if self.mesh.ndim == 1 else (Replicate(), fsdp)

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_group is not None and self.replicate_size > 1

    @property
    def data_parallel_size(self) -> int:
        """How many ranks contribute a gradient: the default divide factor."""
        return self.shard_size * self.replicate_size


@dataclass(frozen=True)
class PostForwardGroup:
    """The smaller group that holds the parameters between forward and backward
    when ``reshard_after_forward`` is an int ``k``: consecutive runs of ``k``
    ranks inside each shard group."""

    group: dist.ProcessGroup
    size: int
    rank: int


# Meshes and groups built here are reused by every later ``fully_shard`` call,
# but only while the default process group they were built under lives: the
# cache is keyed (weakly) by that group object, so after
# ``destroy_process_group()`` and a new ``init_process_group()`` in the same
# process nothing over the dead groups is ever handed out again.  A mesh holds
# its groups, the default one included, so the cache is also emptied at exit,
# before the interpreter finalizes (see shardkit.held_groups).
_per_default_group: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
release_at_exit(_per_default_group.clear)


def _cache() -> dict[tuple, Any]:
    """The cache of the current default process group."""
    return _per_default_group.setdefault(dist.group.WORLD, {})


def default_mesh(mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A 1-D mesh over the whole default process group, on the accelerator
    when the backend drives one (NCCL), else on the CPU (``replicate`` names
    its dim ``"replicate"``, as torch does)."""
    if not dist.is_initialized():
        raise ConfigurationError(
            "fully_shard needs an initialized process group; call "
            "torch.distributed.init_process_group() (torchrun sets the environment) "
            "or pass mesh=init_device_mesh(...)"
        )
    backend = str(dist.get_backend()).lower()
    device_type = "cuda" if ("nccl" in backend and torch.cuda.is_available()) else "cpu"
    cache, key = _cache(), ("default_mesh", device_type, mesh_dim_names)
    if key not in cache:
        cache[key] = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=mesh_dim_names)
    return cache[key]


def device_from_mesh(mesh: DeviceMesh) -> torch.device:
    """The device compute happens on: the CPU, or the current accelerator."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    """Resolve the shard and replicate groups of a 1-D or 2-D mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise UnsupportedMeshError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
            "build one with init_device_mesh('cpu', (world_size,))"
        )
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return MeshInfo(mesh, group, group.size(), mesh.get_local_rank(0), None, 1, 0)
    if mesh.ndim != 2:
        raise UnsupportedMeshError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: a 1-D mesh (FSDP) or a 2-D "
            f"(replicate, shard) mesh (HSDP), not a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; "
            "flatten the data-parallel dims into one or two and pass that sub-mesh, e.g. "
            "mesh['dp_replicate', 'dp_shard']"
        )
    if mesh.mesh_dim_names is None:
        # An unnamed 2-D mesh is as often a whole (dp, tp) world mesh passed by mistake as
        # an HSDP mesh; torch refuses it rather than silently replicate over one of its
        # dims, and so do we.
        raise UnnamedMeshDimsError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified: the first dim "
            "replicates and the second shards, e.g. init_device_mesh(device_type, (replicas, "
            f"shards), mesh_dim_names=('replicate', 'shard')); got an unnamed mesh of shape {tuple(mesh.shape)}"
        )
    shard_group, replicate_group = mesh.get_group(1), mesh.get_group(0)
    return MeshInfo(mesh, shard_group, shard_group.size(), mesh.get_local_rank(1),
                    replicate_group, replicate_group.size(), mesh.get_local_rank(0))


def replicate_mesh_info(mesh: DeviceMesh, spmd: Any = None) -> MeshInfo:
    """A 1-D mesh whose ranks all hold the whole parameter (DDP)."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise UnsupportedMeshError(
            f"replicating parameters needs a 1-D DeviceMesh of the replicas, got {mesh!r}; pass e.g. "
            "init_device_mesh('cpu', (world_size,), mesh_dim_names=('replicate',))"
        )
    group = mesh.get_group(0)
    return MeshInfo(mesh, None, 1, 0, group, group.size(), mesh.get_local_rank(0), spmd)


def normalize_reshard_after_forward(value: bool | int | None, shard_size: int) -> bool | int | None:
    """Map ``True``/``False``/``None``/``int`` onto ``True``/``False``/``None``
    or an int ``k`` with ``1 < k < shard_size`` that divides ``shard_size``."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ConfigurationError(
            f"reshard_after_forward must be True, False, None or an int, got {value!r}"
        )
    if value < 1 or shard_size % value != 0:
        raise ConfigurationError(
            f"reshard_after_forward={value} must divide the shard group size {shard_size}; "
            f"use one of {[k for k in range(1, shard_size + 1) if shard_size % k == 0]}"
        )
    if value == 1:
        warnings.warn("reshard_after_forward=1 keeps whole parameters after forward; "
                      "it is the same as reshard_after_forward=False", stacklevel=3)
        return False
    if value == shard_size:
        return True
    return value


def post_forward_group(mesh_info: MeshInfo, k: int) -> PostForwardGroup:
    """The group of ``k`` consecutive shard ranks this rank belongs to.

    Every rank of the default group must make the same calls (process-group
    creation is collective); ``fully_shard`` calls are, by contract."""
    rows = mesh_info.mesh.mesh.reshape(-1, k).tolist()
    cache, key = _cache(), ("post_forward", tuple(tuple(row) for row in rows))
    if key not in cache:
        cache[key], _ = dist.new_subgroups_by_enumeration([list(row) for row in key[1]])
    return PostForwardGroup(cache[key], k, mesh_info.shard_rank % k)
