"""``replicate``: data parallelism without sharding, on the ``fully_shard`` machinery.

torch 2.13's ``torch.distributed._composable.replicate_with_fsdp.replicate``:
DDP semantics (every rank holds every parameter, as a ``Replicate()`` DTensor
on the replicate mesh; gradients are all-reduced and averaged in one
collective per module group at the end of its backward), with
``fully_shard``'s hooks, mixed precision, CPU offload, ``FSDPModule``
methods and state dicts.  Apply it bottom-up like ``fully_shard``: each call
is one all-reduce unit.  A parameter that tensor parallelism made a DTensor
on ``world["tp"]`` is replicated over ``world["dp"]`` and lives on the
composed mesh with placements ``(Replicate(), *TP's)``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.errors import ComposableConflictError, UnsupportedMeshError
from shardkit.runtime.compile import unwrap_compiled
from shardkit.runtime.fsdp_module import FSDPModule
from shardkit.runtime.fully_shard import check_shardable, shard_modules
from shardkit.runtime.mesh_info import default_mesh, device_from_mesh, replicate_mesh_info
from shardkit.runtime.module_state import state_of
from shardkit.runtime.policies import MixedPrecisionPolicy, OffloadPolicy
from shardkit.runtime.spmd_mesh import DataParallelMeshDims, spmd_mesh_info

__all__ = ["ReplicateModule", "replicate"]


class ReplicateModule(FSDPModule):
    """Methods a replicated module gains (``type(m)`` is ``Replicate<Name>``)."""

    _orig_cls_mro_index = 3


def replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module | list[nn.Module]:
    """Replicate ``module``'s parameters over ``mesh`` and average their gradients.

    Args:
        module: the module, or a list of modules forming one all-reduce group.
        mesh: a 1-D mesh of the replicas.  Default: every rank of the default
            process group (dim name ``"replicate"``).  With ``dp_mesh_dims``:
            the full SPMD mesh its parameters are DTensors on.
        mp_policy, offload_policy, ignored_params: as for ``fully_shard``.
        dp_mesh_dims: ``DataParallelMeshDims(replicate=...)`` naming the
            replicate dims of the full SPMD mesh (no shard dims).

    Returns:
        the same module (or list), now also a :class:`ReplicateModule`.
    """
    modules = tuple(unwrap_compiled(m) for m in (module if isinstance(module, (list, tuple)) else (module,)))
    for m in modules:
        if state_of(m) is not None and not isinstance(m, ReplicateModule):
            raise ComposableConflictError(
                "Cannot apply `replicate()` on a Module already managed by `fully_shard`; use one of "
                "the two per module"
            )
    mp_policy, offload_policy = check_shardable(modules, mp_policy, offload_policy)
    if mesh is None:
        mesh = default_mesh(mesh_dim_names=("replicate",))
    if dp_mesh_dims is not None:
        mesh_info = spmd_mesh_info(mesh, dp_mesh_dims)
        if mesh_info.shard_group is not None:
            raise UnsupportedMeshError(
                "replicate() with dp_mesh_dims requires replicate-only dims (no shard dims). "
                "Use fully_shard() for sharding."
            )
    else:
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            raise UnsupportedMeshError(
                f"replicate expects a 1D DeviceMesh but got {mesh}; pass the replicas' 1-D mesh, e.g. "
                "world['dp'] (tensor parallelism keeps world['tp'])"
            )
        mesh_info = replicate_mesh_info(mesh)
    shard_modules(modules, mesh_info, device_from_mesh(mesh), shard_placement_fn=None, mp_policy=mp_policy,
                  offload_policy=offload_policy, ignored_params=ignored_params, reshard_after_forward=False,
                  module_class=ReplicateModule)
    return module

