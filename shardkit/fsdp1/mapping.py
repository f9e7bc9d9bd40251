"""Every FSDP1 constructor argument, mapped onto ``fully_shard``'s.

One function per argument family, each a pure decision that tests can check
without a process group, plus the mesh construction that needs one.  When an
FSDP1 meaning cannot hold on the shardkit core, :func:`warn_once` says so
once per process (never silently).  ``docs/migration.md`` is the prose
version of this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardkit.errors import ConfigurationError, UnsupportedMeshError
from shardkit.fsdp1.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from shardkit.wrap import (
    warn_once,  # one once-per-process registry for wrap policies and FSDP1
)

__all__ = ["StrategyLayout", "strategy_layout", "as_enum", "mixed_precision_fields", "offload_params",
           "build_mesh", "compute_device", "warn_once", "reshard_after_forward", "DIM_NAMES"]

DIM_NAMES = ("replicate", "shard")


def as_enum(value: Any, enum: type[Enum], argument: str) -> Any:
    """Accept our enum members and torch's (matched by member name)."""
    if value is None or isinstance(value, enum):
        return value
    name = getattr(value, "name", None)
    if isinstance(value, Enum) and name in enum.__members__:
        return enum[name]
    raise ConfigurationError(f"{argument}={value!r} is not a {enum.__name__}; "
                             f"use one of {', '.join(enum.__members__)}")


# --------------------------------------------------------------------------
# sharding_strategy -> mesh shape + reshard_after_forward


@dataclass(frozen=True)
class StrategyLayout:
    """The mesh shape and resharding one strategy asks for.

    ``replicate`` is ``None`` for a 1-D mesh; otherwise the mesh is
    ``(replicate, shard)`` with dim names :data:`DIM_NAMES`.
    """

    replicate: int | None
    shard: int
    reshard_after_forward: bool

    @property
    def shape(self) -> tuple[int, ...]:
        """The ``init_device_mesh`` shape: ``(shard,)`` or ``(replicate, shard)``."""
        return (self.shard,) if self.replicate is None else (self.replicate, self.shard)


def strategy_layout(strategy: ShardingStrategy | None, world_size: int,
                    local_world_size: int | None = None) -> StrategyLayout:
    """FULL_SHARD and SHARD_GRAD_OP shard over all ranks (ZeRO-3 / ZeRO-2);
    NO_SHARD is a ``(world, 1)`` mesh (replicas all-reduce, nothing is
    sharded); the hybrid strategies shard within a node (``local_world_size``
    ranks, torchrun's ``LOCAL_WORLD_SIZE``) and replicate across nodes."""
    strategy = as_enum(strategy, ShardingStrategy, "sharding_strategy") or ShardingStrategy.FULL_SHARD
    if strategy is ShardingStrategy.FULL_SHARD:
        return StrategyLayout(None, world_size, True)
    if strategy is ShardingStrategy.SHARD_GRAD_OP:
        return StrategyLayout(None, world_size, False)
    if strategy is ShardingStrategy.NO_SHARD:
        # The "unsharded" copy is a local copy on a (W, 1) mesh; freeing it
        # after forward costs no communication and saves a parameter's memory.
        return StrategyLayout(world_size, 1, True)
    local = local_world_size or world_size
    if local <= 0 or world_size % local:
        raise ConfigurationError(
            f"{strategy.name} shards within a node of {local} ranks, which does not divide the "
            f"world size {world_size}; pass device_mesh=init_device_mesh(device, (nodes, per_node), "
            f"mesh_dim_names={DIM_NAMES}) or process_group=(shard_group, replicate_group)")
    return StrategyLayout(world_size // local, local, strategy is ShardingStrategy.HYBRID_SHARD)


def reshard_after_forward(strategy: ShardingStrategy | None) -> bool:
    """FSDP1 frees unsharded parameters after forward except for the ZeRO-2 strategies."""
    strategy = as_enum(strategy, ShardingStrategy, "sharding_strategy") or ShardingStrategy.FULL_SHARD
    return strategy not in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


def is_hybrid(strategy: ShardingStrategy | None) -> bool:
    """Whether ``strategy`` needs a 2-D ``(replicate, shard)`` mesh."""
    return strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


# --------------------------------------------------------------------------
# mixed_precision / cpu_offload / backward_prefetch / state_dict_type


def mixed_precision_fields(mp: MixedPrecision | Any | None, *, is_root: bool) -> dict[str, Any] | None:
    """The ``MixedPrecisionPolicy`` fields for one unit, or ``None`` for none.

    FSDP1's root casts its forward inputs when ``cast_root_forward_inputs``
    (default), other units when ``cast_forward_inputs``.  FSDP1 reduces in
    ``param_dtype`` when ``reduce_dtype`` is unset, which is also the core's
    behaviour (gradients are computed in ``param_dtype``).  Outputs are not
    cast (FSDP1 has no output dtype).  Objects of torch's ``MixedPrecision``
    are read by field.
    """
    if mp is None:
        return None
    if getattr(mp, "keep_low_precision_grads", False):
        warn_once("keep_low_precision_grads",
                  "MixedPrecision(keep_low_precision_grads=True): shardkit hands the optimizer "
                  "gradients in the sharded parameters' dtype (they are reduced in reduce_dtype)")
    cast = mp.cast_root_forward_inputs if is_root else mp.cast_forward_inputs
    return {"param_dtype": mp.param_dtype, "reduce_dtype": mp.reduce_dtype, "output_dtype": None,
            "cast_forward_inputs": bool(cast)}


def offload_params(cpu_offload: CPUOffload | Any | None) -> bool:
    """Whether ``cpu_offload`` (ours or torch's ``CPUOffload``) asks for the core's ``CPUOffloadPolicy``."""
    return bool(cpu_offload is not None and getattr(cpu_offload, "offload_params", False))


def check_backward_prefetch(value: Any) -> BackwardPrefetch | None:
    """``backward_prefetch`` as our enum (or ``None``).  The core gathers the
    next unit in the pre-backward hook of the current one, before its
    gradients are computed: that is ``BACKWARD_PRE``.  It has no hook after a
    unit's gradient computation that could issue the all-gather there, so
    ``BACKWARD_POST`` warns once and runs as ``BACKWARD_PRE``."""
    value = as_enum(value, BackwardPrefetch, "backward_prefetch")
    if value is BackwardPrefetch.BACKWARD_POST:
        warn_once("backward_post", "backward_prefetch=BACKWARD_POST is not available on shardkit; "
                  "the next unit is prefetched before the current gradient computation (BACKWARD_PRE)")
    return value


def check_state_dict_type(value: Any) -> StateDictType:
    """``state_dict_type`` as our enum.  ``LOCAL_STATE_DICT`` meant FSDP1's
    flat-parameter shards, which per-parameter sharding does not have; it is
    served as the sharded state dict (which also reloads at any world size)
    and warns once so that nobody relies on the flat layout."""
    value = as_enum(value, StateDictType, "state_dict_type")
    if value is StateDictType.LOCAL_STATE_DICT:
        warn_once("local_state_dict", "LOCAL_STATE_DICT (FSDP1's flat-parameter shards) has no "
                  "equivalent with per-parameter sharding; shardkit returns the sharded state dict "
                  "(DTensor values), which loads at any world size")
    return value


# --------------------------------------------------------------------------
# process_group / device_mesh / device_id -> DeviceMesh


def compute_device(device_id: int | torch.device | None) -> torch.device:
    """The device FSDP1 would compute on: ``device_id``, else the current CUDA
    device when one exists, else the CPU.  A CUDA ``device_id`` on a machine
    without CUDA falls back to the CPU with a warning."""
    if device_id is not None:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if device.type == "cuda" and not torch.cuda.is_available():
            warn_once("device_id_cpu", f"device_id={device_id!r} names a CUDA device but none is "
                      "available; shardkit computes on the CPU")
            return torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_mesh(strategy: ShardingStrategy | None, device: torch.device, *, process_group: Any = None,
               device_mesh: DeviceMesh | None = None, cache: dict[tuple, DeviceMesh] | None = None) -> DeviceMesh:
    """The ``fully_shard`` mesh for one FSDP1 unit.

    ``cache`` (per (strategy layout, groups, device)) lets all units of one
    ``FullyShardedDataParallel`` call share one mesh; building stays
    collective-safe because every rank builds the same meshes in the same
    order.  The caller owns the cache and keeps it for one call only: meshes
    live on with the model that uses them, never in a process-wide table that
    would hand meshes over destroyed process groups to a later model.  Separate
    calls (manual nesting) therefore build their own mesh each; pass one
    ``device_mesh=`` to all of them to share it.
    """
    cache = {} if cache is None else cache
    strategy = as_enum(strategy, ShardingStrategy, "sharding_strategy") or ShardingStrategy.FULL_SHARD
    if not dist.is_initialized():
        raise ConfigurationError("FullyShardedDataParallel needs an initialized process group; call "
                                 "torch.distributed.init_process_group() (torchrun sets the environment)")
    if device_mesh is not None and process_group is not None:
        raise ConfigurationError("pass either process_group or device_mesh to FullyShardedDataParallel, "
                                 "not both")
    if device_mesh is not None:
        return _mesh_from_device_mesh(strategy, device_mesh, cache)
    if isinstance(process_group, tuple):
        return _mesh_from_group_pair(strategy, process_group, device.type, cache)
    group = process_group or dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", len(ranks)))
    layout = strategy_layout(strategy, len(ranks), min(local, len(ranks)))
    key = ("layout", layout.shape, ranks, device.type)
    if key in cache:
        return cache[key]
    if len(ranks) == dist.get_world_size():
        names = DIM_NAMES if layout.replicate is not None else ("shard",)
        mesh = init_device_mesh(device.type, layout.shape, mesh_dim_names=names)
    elif layout.replicate is None:
        mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("shard",))
    else:
        raise UnsupportedMeshError(
            f"{strategy.name} with a process_group of {len(ranks)} of {dist.get_world_size()} ranks: "
            "pass device_mesh=... (a 2-D (replicate, shard) mesh) or, for hybrid sharding, "
            "process_group=(shard_group, replicate_group)")
    cache[key] = mesh
    return mesh


def _mesh_from_device_mesh(strategy: ShardingStrategy, mesh: DeviceMesh, cache: dict[tuple, DeviceMesh]) -> DeviceMesh:
    if is_hybrid(strategy):
        if mesh.ndim != 2:
            raise UnsupportedMeshError(f"{strategy.name} needs a 2-D (replicate, shard) device_mesh, "
                                       f"got shape {tuple(mesh.shape)}")
        return mesh if mesh.mesh_dim_names is not None else _named(mesh, cache)
    if mesh.ndim != 1:
        raise UnsupportedMeshError(f"{strategy.name} needs a 1-D device_mesh, got shape {tuple(mesh.shape)}; "
                                   "use HYBRID_SHARD for a 2-D mesh")
    if strategy is ShardingStrategy.NO_SHARD:
        ranks = mesh.mesh.flatten().tolist()
        if len(ranks) != dist.get_world_size():
            raise UnsupportedMeshError("NO_SHARD with a device_mesh over part of the world is not "
                                       "supported; use the whole world or HYBRID_SHARD")
        return build_mesh(strategy, torch.device(mesh.device_type), cache=cache)
    return mesh


def _named(mesh: DeviceMesh, cache: dict[tuple, DeviceMesh]) -> DeviceMesh:
    """FSDP1 takes an unnamed 2-D device_mesh as (replicate, shard); fully_shard needs the
    names (an unnamed one is refused), so the same groups get them, without new groups."""
    key = ("named", tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), mesh.device_type)
    if key not in cache:
        cache[key] = DeviceMesh.from_group([mesh.get_group(0), mesh.get_group(1)], mesh.device_type,
                                           mesh=mesh.mesh, mesh_dim_names=DIM_NAMES)
    return cache[key]


def _mesh_from_group_pair(strategy: ShardingStrategy, groups: tuple, device_type: str,
                          cache: dict[tuple, DeviceMesh]) -> DeviceMesh:
    """FSDP1's ``process_group=(shard_group, replicate_group)`` for hybrid sharding."""
    if not is_hybrid(strategy) or len(groups) != 2:
        raise ConfigurationError("process_group may be a (shard_group, replicate_group) pair only with "
                                 "HYBRID_SHARD or _HYBRID_SHARD_ZERO2")
    shard_group, replicate_group = groups
    key = ("pair", tuple(dist.get_process_group_ranks(shard_group)),
           tuple(dist.get_process_group_ranks(replicate_group)), device_type)
    if key in cache:
        return cache[key]
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else None
    row = torch.tensor(dist.get_process_group_ranks(shard_group), device=device)
    rows = [torch.empty_like(row) for _ in range(replicate_group.size())]
    dist.all_gather(rows, row, group=replicate_group)
    mesh = DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=torch.stack(rows).cpu(),
                                 mesh_dim_names=DIM_NAMES)
    cache[key] = mesh
    return mesh
