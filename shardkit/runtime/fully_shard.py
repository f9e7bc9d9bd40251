"""``fully_shard``: shard a module's parameters across a mesh, in place.

The module keeps its identity, its FQNs and its state-dict keys; its class
becomes ``FSDP<Name>(FSDPModule, Name)``, so it is still an instance of the
original class and gains the :class:`FSDPModule` methods.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.errors import (
    AlreadyShardedError,
    ConfigurationError,
    ShardedTwiceError,
    UnshardableParameterError,
    UnsupportedShardingError,
)
from shardkit.runtime.compile import keep_state_dict_keys_clean, unwrap_compiled
from shardkit.runtime.fsdp_module import FSDPModule, apply_reshard_after_forward, states_of, swap_class
from shardkit.runtime.mesh_info import (
    MeshInfo,
    default_mesh,
    device_from_mesh,
    mesh_info_for,
    normalize_reshard_after_forward,
)
from shardkit.runtime.module_state import STATE_ATTR, ShardState, state_of
from shardkit.runtime.param_group import ParamGroup
from shardkit.runtime.placement_fn import ShardPlacementResult, group_by_mesh, resolve_placements
from shardkit.runtime.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, as_shardkit_policies
from shardkit.runtime.sharded_param import ParamModuleInfo, ShardedParam
from shardkit.runtime.spmd_mesh import DataParallelMeshDims, spmd_mesh_info

# Original Parameter -> (the class of the module whose fully_shard call owns it,
# a weak reference to the module that registers the sharded copy, and its name
# there).  Never a reference to the sharded parameter itself: a tensor with a
# weak reference cannot be swapped (``torch.utils.swap_tensors``, which
# ``module.to(dtype)`` uses when swapping on conversion is on).
# Keys are held weakly and by identity, so an entry lives exactly as long as its
# Parameter: a second call that reaches the same (tied) Parameter through another
# module is caught at once, and a freed original is never confused with a new
# one that happens to reuse its id().
_CLAIMED: WeakIdKeyDictionary = WeakIdKeyDictionary()

__all__ = ["fully_shard", "check_shardable", "shard_modules", "param_groups_of", "sharded_params_of"]


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | Replicate | ShardPlacementResult | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shard ``module``'s parameters (those not already owned by a sharded
    submodule) into one group: one all-gather before its compute, one
    reduce-scatter of its gradients.

    Apply bottom-up (each block, then the root): each call is one unit of
    memory and communication, so finer groups lower peak memory at the cost
    of more, smaller collectives.  See ``docs/api.md`` for every argument's
    memory/communication trade-off.

    Args:
        module: the module, or a list of modules to shard as one group (e.g.
            modules sharing a tied weight).
        mesh: 1-D (FSDP, placements ``(Shard(0),)``) or 2-D ``(replicate,
            shard)`` (HSDP, ``(Replicate(), Shard(0))``).  Default: a 1-D
            mesh over the whole default process group.  The device comes from
            the mesh.  Parameters that tensor parallelism made DTensors on
            ``world["tp"]`` need the data-parallel sub-mesh of the same named
            world mesh (``world["dp"]``, or ``world["dp_replicate", "dp_shard"]``);
            they become DTensors on the composed mesh (``tensor_parallel``).
        reshard_after_forward: ``True`` frees the unsharded parameters after
            forward and all-gathers again in backward (least memory);
            ``False`` keeps them until backward (no backward all-gather);
            an ``int`` k keeps a 1/k slice and all-gathers over k ranks in
            backward; ``None`` is ``True`` except for the root, which keeps them.
        shard_placement_fn: ``param -> Shard(k) | None`` to shard a parameter
            on another dim (which must divide evenly); ``None`` means ``Shard(0)``.
        mp_policy: compute/reduce/output dtypes (:class:`MixedPrecisionPolicy`).
        offload_policy: :class:`CPUOffloadPolicy` keeps shards, grads and the
            optimizer step on the CPU.
        ignored_params: parameters left alone: not sharded, not moved, not reduced.
        dp_mesh_dims: torch's SPMD-mesh form; not supported (an error says what to pass instead).

    Returns:
        the same module (or list), now also an :class:`FSDPModule`.
    """
    # torch.compile(block) wraps the block: shard (and hook) the block itself
    modules = tuple(unwrap_compiled(m) for m in (module if isinstance(module, (list, tuple)) else (module,)))
    mp_policy, offload_policy = check_shardable(modules, mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh()
    mesh_info = _data_parallel_mesh_info(mesh, dp_mesh_dims, reshard_after_forward)
    shard_modules(modules, mesh_info, device_from_mesh(mesh), shard_placement_fn=shard_placement_fn,
                  mp_policy=mp_policy, offload_policy=offload_policy, ignored_params=ignored_params,
                  reshard_after_forward=reshard_after_forward)
    return module


def shard_modules(modules: tuple[nn.Module, ...], mesh_info: MeshInfo, device: torch.device, *,
                  shard_placement_fn: Callable[[nn.Parameter], Any] | None, mp_policy: MixedPrecisionPolicy,
                  offload_policy: OffloadPolicy, ignored_params: set[nn.Parameter] | None,
                  reshard_after_forward: bool | int | None, module_class: type = FSDPModule) -> None:
    """The body of ``fully_shard`` and ``replicate``: one state over ``modules``
    with one group per mesh, and each module's class swapped to
    ``module_class`` (an :class:`FSDPModule`) mixed into its own."""
    ignored = set(ignored_params or ())
    managed = _managed_modules(modules)
    params = _managed_params(modules, managed, ignored)
    _move_buffers(managed, device)
    infos = _module_infos(managed, params)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    pin = offload and offload_policy.pin_memory
    placements = resolve_placements(shard_placement_fn, params, mesh_info)
    sharded = [ShardedParam(p, infos[id(p)], info, device, dim, offload, pin)
               for p, (info, dim) in zip(params, placements)]
    by_mesh = [(info, members, _reshard_for(info, reshard_after_forward))
               for info, members in group_by_mesh(sharded, [info for info, _ in placements])]
    for p, sp in zip(params, sharded):  # only now: a parameter that cannot be sharded leaves the module untouched
        sp.info.register(sp.sharded_param)
        _CLAIMED[p] = (type(modules[0]).__name__, weakref.ref(sp.info.module), sp.info.name)

    state = ShardState(modules, device, mp_policy, auto_reshard_after_forward=reshard_after_forward is None)
    for group_info, members, reshard in by_mesh:
        group = ParamGroup(members, modules, group_info, device, mp_policy, state.comm)
        apply_reshard_after_forward(group, reshard)
        state.groups.append(group)
    for m in modules:
        m.__dict__[STATE_ATTR] = state
        swap_class(m, module_class)
        keep_state_dict_keys_clean(m)


def _reshard_for(mesh_info: MeshInfo, reshard_after_forward: bool | int | None) -> bool | int:
    """A group's ``reshard_after_forward``.  A replicate-only group keeps its
    parameters after forward, as torch's does: resharding would only drop a
    local copy that backward needs again."""
    if mesh_info.shard_group is None:
        return False
    reshard = normalize_reshard_after_forward(reshard_after_forward, mesh_info.shard_size)
    return True if reshard is None else reshard


def _data_parallel_mesh_info(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None,
                             reshard_after_forward: bool | int | None) -> MeshInfo:
    if dp_mesh_dims is None:
        return mesh_info_for(mesh)
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise ConfigurationError(
            f"dp_mesh_dims must be a DataParallelMeshDims(shard=..., replicate=...), got {dp_mesh_dims!r}"
        )
    info = spmd_mesh_info(mesh, dp_mesh_dims)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool) \
            and info.shard_group is not None:
        raise UnsupportedShardingError(
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims); "
            "pass True or False"
        )
    return info


# torch's ``contract`` accessor: ``fully_shard.state(module)`` is the module's
# sharding state (shared by the modules of one call), or None if it has none.
fully_shard.state = state_of  # type: ignore[attr-defined]


# --------------------------------------------------------------------- checks


def check_shardable(modules: tuple[nn.Module, ...], mp_policy: Any,
                    offload_policy: Any) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The checks of ``fully_shard``'s arguments that ``replicate`` shares; the policies as shardkit's."""
    _check_modules(modules)
    return as_shardkit_policies(mp_policy, offload_policy)


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    if not modules:
        raise ConfigurationError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ConfigurationError(f"fully_shard takes nn.Module(s), got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ConfigurationError(
                f"fully_shard does not support containers that do not implement forward: {m}\n"
                f"A {type(m).__name__} has no forward, so its hooks would never run; shard each of its "
                "modules, or the module that calls them"
            )
        if state_of(m) is not None or isinstance(m, FSDPModule):
            raise ShardedTwiceError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"fully_shard has already been applied to the following module:\n{m}\n"
                "Apply fully_shard once per module (bottom-up: each block, then the root) and change "
                "settings with the FSDPModule set_* methods instead"
            )
        if _torch_composable_state(m) is not None:
            raise AlreadyShardedError(
                f"this {type(m).__name__} is already managed by torch.distributed's own composable API "
                "(fully_shard or replicate); use one sharding library per model"
            )


def _torch_composable_state(module: nn.Module) -> Any:
    try:
        from torch.distributed._composable_state import _get_module_state
    except ImportError:  # pragma: no cover - older torch
        return None
    return _get_module_state(module)


# ------------------------------------------------------------- managed states


def _managed_modules(roots: tuple[nn.Module, ...]) -> list[nn.Module]:
    """Modules under ``roots``, not descending into modules sharded earlier."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if m not in roots and state_of(m) is not None:
            return
        out.append(m)
        for child in m.children():
            visit(child)

    for root in roots:
        visit(root)
    return out


def _managed_params(roots: tuple[nn.Module, ...], modules: list[nn.Module],
                    ignored: set[nn.Parameter]) -> list[nn.Parameter]:
    params, seen = [], set()
    for m in modules:
        for name, p in m._parameters.items():
            if p is None or id(p) in seen or p in ignored:
                continue
            claim = _CLAIMED.get(p)
            if claim is not None:
                # torch finds this at the first forward; here it is found at once, before anything
                # is changed, in torch's words (and its ValueError), naming the earlier group's copy
                owner, earlier_module, earlier_name = claim
                here = _fqn_of(roots, m, name) or name
                raise UnshardableParameterError(
                    f"Parameter '{_fqn_of(roots, earlier_module(), earlier_name) or here}' is shared with a "
                    "parameter already managed by another FSDP group. For shared/tied parameters, use "
                    "fully_shard([module_a, "
                    f"module_b]) to place them in the same FSDP group. Here it is '{here}', already in the "
                    f"group of an earlier fully_shard({owner}) call; sharding their common parent also works"
                )
            seen.add(id(p))
            params.append(p)
    return params


def _fqn_of(roots: tuple[nn.Module, ...], module: nn.Module | None, name: str) -> str | None:
    """Where parameter ``name`` of ``module`` sits under the module(s) given to ``fully_shard``, if anywhere."""
    if module is not None:
        for root in roots:
            for prefix, sub in root.named_modules(remove_duplicate=False):
                if sub is module:
                    return f"{prefix}.{name}" if prefix else name
    return None


def _module_infos(modules: list[nn.Module], params: list[nn.Parameter]) -> dict[int, ParamModuleInfo]:
    wanted = {id(p) for p in params}
    infos: dict[int, ParamModuleInfo] = {}
    for m in modules:
        for name, p in m._parameters.items():
            if p is None or id(p) not in wanted:
                continue
            if id(p) in infos:
                infos[id(p)].shared.append((m, name))
            else:
                infos[id(p)] = ParamModuleInfo(m, name)
    return infos


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    for m in modules:
        for name, buf in m._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                m._buffers[name] = buf.to(device)


# ------------------------------------------------------- for layers built on top


def param_groups_of(module: nn.Module) -> list[ParamGroup]:
    """The communication groups created by ``fully_shard(module)`` (empty if none)."""
    state = state_of(module)
    return list(state.groups) if state is not None else []


def sharded_params_of(module: nn.Module, recurse: bool = True) -> list[ShardedParam]:
    """Every :class:`ShardedParam` under ``module`` (its own groups, and its
    sharded submodules' when ``recurse``)."""
    return [p for state in states_of(module, recurse) for g in state.groups for p in g.params]
