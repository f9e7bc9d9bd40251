"""2-D meshes: sharding a parameter that tensor parallelism already made a DTensor.

Note [composing FSDP with TP]
    ``parallelize_module(block, world["tp"], plan)`` leaves each planned
    parameter a DTensor on the tp mesh: ``Shard(0)`` for a column-wise weight
    and bias, ``Shard(1)`` for a row-wise weight, ``Replicate()`` for a row-wise
    bias or a ``SequenceParallel`` norm.  ``fully_shard(block, mesh=world["dp"])``
    then shards the parameter's *TP-local* tensor over dp exactly as it shards
    a plain parameter (dim 0, padded to ``ceil(rows / dp)``), and describes
    the result on the concatenation of the two meshes::

        mesh       = (dp, tp)                    HSDP: (dp_replicate, dp_shard, tp)
        placements = (FSDP's, *TP's)             HSDP: (Replicate(), FSDP's, *TP's)
        FSDP's     = _StridedShard(d, split_factor=n)   if TP already cut dim d into n pieces
                   = Shard(d)                           otherwise

    ``_StridedShard`` records the order in which the rows were really cut:
    first into TP's ``n`` pieces, then each piece over dp.  A plain
    ``(Shard(0), Shard(0))`` would claim the opposite order and reassemble
    the rows wrongly.  It is the layout torch's own ``fully_shard`` produces,
    so state dicts, DCP checkpoints and ``clip_grad_norm_`` see the same
    DTensors from either implementation.

    The tp dim never enters FSDP's collectives: the all-gather over dp
    rebuilds the TP-local tensor, which is wrapped back into the parameter's
    original TP DTensor for compute (TP's collectives run inside the module,
    as they did before ``fully_shard``).  In backward the unsharded gradient
    is first brought to TP's placements (a ``Partial`` gradient, e.g. of a
    ``SequenceParallel`` norm, is all-reduced over tp there) and only its
    local tensor is reduce-scattered over dp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.errors import UnshardableParameterError, UnsupportedMeshError
from shardkit.held_groups import release_at_exit
from shardkit.runtime.mesh_info import MeshInfo

__all__ = ["TPLayout", "tp_layout", "compose_meshes", "make_spec", "contiguous_stride"]

# dp mesh -> tp mesh -> their concatenation, held as long as both meshes live, and emptied at exit
# before the interpreter finalizes: the meshes hold their groups (see shardkit.held_groups)
_COMPOSED: WeakIdKeyDictionary = WeakIdKeyDictionary()
release_at_exit(_COMPOSED.clear)


@dataclass(frozen=True)
class TPLayout:
    """How one TP parameter maps between its sharded and unsharded forms."""

    tp_spec: DTensorSpec                 # the parameter as tensor parallelism left it
    mesh: DeviceMesh                     # the composed (dp..., tp...) mesh of the shard
    placements: tuple[Placement, ...]    # FSDP's placements followed by TP's
    # mesh dims whose gradient placement is left as autograd made it, because
    # FSDP's own collectives reduce over them (the dp dims of a full SPMD mesh)
    dp_dims: frozenset[int] = frozenset()

    def unsharded(self, local: torch.Tensor) -> DTensor:
        """The all-gathered TP-local tensor as the TP DTensor the module computes with
        (in the compute dtype, which may differ from the parameter's)."""
        spec = self.tp_spec
        meta = spec.tensor_meta
        if meta is not None and meta.dtype != local.dtype:
            spec = replace(spec, tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The TP-local gradient to reduce over dp: first redistributed to TP's
        placements (a ``Partial`` gradient is reduced over tp here)."""
        wait = getattr(grad, "wait", None)
        if wait is not None and not isinstance(grad, DTensor):  # an AsyncCollectiveTensor
            grad = wait()
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(grad.placements[i] if i in self.dp_dims else p for i, p in enumerate(self.tp_spec.placements))
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        return grad._local_tensor


def contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(size):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))


def make_spec(mesh: DeviceMesh, placements: tuple[Placement, ...], size: torch.Size,
              dtype: torch.dtype) -> DTensorSpec:
    """The spec of a DTensor of global ``size`` (contiguous) on ``mesh``."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(size, contiguous_stride(size), dtype))


def compose_meshes(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, what: str) -> DeviceMesh:
    """The ``(dp..., tp...)`` mesh: both must be named sub-meshes of one world mesh
    over disjoint dims.  Built once per pair, so all parameters share it."""
    recipe = ("build one named world mesh, e.g. world = init_device_mesh('cuda', (dp, tp), "
              "mesh_dim_names=('dp', 'tp')), parallelize with world['tp'] and pass mesh=world['dp'] to fully_shard")
    if tp_mesh.mesh_dim_names is None:
        raise UnsupportedMeshError(f"{what} is a DTensor on a mesh without dim names; {recipe}")
    if dp_mesh.mesh_dim_names is None:
        raise UnsupportedMeshError(
            f"{what} is a DTensor on mesh {tp_mesh.mesh_dim_names}, but fully_shard's mesh has no dim names "
            f"(the default mesh spans every rank, tp ones included); {recipe}"
        )

    def build() -> DeviceMesh:
        try:
            return DeviceMesh._concatenate([dp_mesh, tp_mesh])
        except RuntimeError as exc:
            raise UnsupportedMeshError(
                f"{what} lives on mesh {tp_mesh.mesh_dim_names} {tuple(tp_mesh.shape)}, which cannot be combined "
                f"with the data-parallel mesh {dp_mesh.mesh_dim_names} {tuple(dp_mesh.shape)} ({exc}); slice both "
                "from one world mesh over different dims: mesh=world['dp'] and parallelize_module(..., world['tp'])"
            ) from None

    # keyed by identity: a mesh built again later compares equal to an old one
    # but has its own groups, and the composed mesh must use the new ones
    per_tp = _COMPOSED.setdefault(dp_mesh, WeakIdKeyDictionary())
    if tp_mesh not in per_tp:
        per_tp[tp_mesh] = build()
    return per_tp[tp_mesh]


def _is_shard(placement: Placement) -> bool:
    return isinstance(placement, (Shard, _StridedShard))


def tp_layout(param: DTensor, mesh_info: MeshInfo, shard_dim: int, what: str) -> TPLayout:
    """Compose FSDP's dim-``shard_dim`` shard over ``mesh_info`` with ``param``'s TP placements."""
    spec = param._spec
    tp_mesh = spec.mesh
    bad = [p for p in spec.placements if not (_is_shard(p) or isinstance(p, Replicate))]
    if bad:
        raise UnshardableParameterError(
            f"{what} is a DTensor with placements {tuple(spec.placements)}; fully_shard composes with Shard and "
            "Replicate tensor-parallel placements only; redistribute it to Replicate() first"
        )
    if set(tp_mesh.mesh_dim_names or ()) & set(mesh_info.mesh.mesh_dim_names or ()) or tp_mesh == mesh_info.mesh:
        raise UnsupportedMeshError(
            f"{what} is already a DTensor on the data-parallel mesh {mesh_info.mesh.mesh_dim_names}; "
            "fully_shard composes with a parameter's tensor-parallel mesh, which must be a different dim of "
            "the same world mesh (parallelize with world['tp'], shard with mesh=world['dp'])"
        )
    mesh = compose_meshes(mesh_info.mesh, tp_mesh, what)
    split = spec.num_shards_map[shard_dim]
    fsdp: Placement = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    return TPLayout(spec, mesh, (*mesh_info.data_parallel_placements(fsdp), *spec.placements))
