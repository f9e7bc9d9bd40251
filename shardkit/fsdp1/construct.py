"""Building an FSDP1 model on ``fully_shard``: one *unit* at a time, bottom-up.

FSDP1 did three things per unit before flattening and sharding it, and so
does this module, in the same order and at the same granularity (so peak
memory is one unsharded unit, as in FSDP1):

1. materialize meta-device modules (``param_init_fn``, else ``reset_parameters``),
2. broadcast parameters and buffers from rank 0 (``sync_module_states``),
3. cast buffers to ``MixedPrecision.buffer_dtype``,

then call ``fully_shard`` with the mesh, ``reshard_after_forward`` and
policies :mod:`shardkit.fsdp1.mapping` derives from the FSDP1 arguments.
A unit's modules are its subtree minus units already sharded below it and
ignored modules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map

from shardkit.errors import AlreadyShardedError, ConfigurationError
from shardkit.fsdp1 import mapping
from shardkit.fsdp1.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from shardkit.runtime import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from shardkit.wrap import (
    CustomPolicy,
    WrapTarget,
    ignored_parameters,
    plan_auto_wrap,
    walk_modules,
)

__all__ = ["FSDP1Args", "construct", "unit_modules"]

_USE_ORIG_PARAMS_DEFAULT = object()


@dataclass(frozen=True)
class FSDP1Args:
    """The FSDP1 constructor arguments of one unit (``CustomPolicy`` may override per unit)."""

    process_group: Any = None
    sharding_strategy: ShardingStrategy | None = None
    cpu_offload: CPUOffload | None = None
    auto_wrap_policy: Any = None
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    mixed_precision: MixedPrecision | None = None
    ignored_modules: Iterable[nn.Module] | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    device_id: int | torch.device | None = None
    sync_module_states: bool = False
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: Any = _USE_ORIG_PARAMS_DEFAULT
    ignored_states: Any = None
    device_mesh: DeviceMesh | None = None

    @property
    def strategy(self) -> ShardingStrategy:
        """``sharding_strategy`` as our enum; unset means FSDP1's default, ``FULL_SHARD``."""
        value = mapping.as_enum(self.sharding_strategy, ShardingStrategy, "sharding_strategy")
        return value or ShardingStrategy.FULL_SHARD


# --------------------------------------------------------------------------
# which modules and parameters a unit manages


def resolve_ignored(root: nn.Module, args: FSDP1Args) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """``ignored_modules`` / ``ignored_states`` as (the ignored modules, every
    ignored parameter including those in the modules' subtrees).  The modules
    are kept as given: traversals stop at them, so nobody needs their
    subtrees spelled out (``plan_auto_wrap`` expands them for its policy)."""
    if args.ignored_modules is not None and args.ignored_states is not None:
        raise ConfigurationError("pass ignored_modules or ignored_states to FullyShardedDataParallel, "
                                 "not both (ignored_states accepts modules too)")
    items = list(args.ignored_states if args.ignored_states is not None else args.ignored_modules or ())
    params = [x for x in items if isinstance(x, nn.Parameter)]
    modules = [x for x in items if isinstance(x, nn.Module)]
    if len(params) + len(modules) != len(items) or (params and modules):
        raise ConfigurationError("ignored_states must be all nn.Parameters or all nn.Modules; "
                                 "ignored_modules must be nn.Modules")
    for m in modules:
        if isinstance(m, FSDPModule):
            raise ConfigurationError(f"ignored module {type(m).__name__} is already sharded; "
                                     "an ignored module cannot be an FSDP unit")
    return set(modules), set(params) | ignored_parameters(modules)


def unit_modules(unit: nn.Module, ignored_modules: set[nn.Module] | frozenset = frozenset()) -> list[nn.Module]:
    """``unit`` and its submodules, stopping at sharded submodules and ignored modules."""
    return walk_modules(unit, enter=lambda m: m not in ignored_modules and not isinstance(m, FSDPModule))


def _own_states(modules: list[nn.Module], ignored_params: set[nn.Parameter]) -> list[tuple[nn.Module, str, bool]]:
    """(module, name, is_param) for every parameter/buffer slot the unit manages."""
    out = []
    for m in modules:
        out += [(m, n, True) for n, p in m._parameters.items() if p is not None and p not in ignored_params]
        out += [(m, n, False) for n, b in m._buffers.items() if b is not None]
    return out


# --------------------------------------------------------------------------
# the three per-unit steps before sharding


def materialize_meta(modules: list[nn.Module], device: torch.device,
                     param_init_fn: Callable[[nn.Module], None] | None) -> bool:
    """FSDP1's deferred init: if any state is on the meta device, call
    ``param_init_fn`` on every module of the unit, or move each module with
    states to ``device`` (``to_empty``) and call its ``reset_parameters``.
    Returns whether anything was materialized."""
    is_meta = any(t.is_meta for m in modules
                  for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
    if not is_meta:
        return False
    with torch.no_grad():
        for m in modules:
            if param_init_fn is not None:
                param_init_fn(m)
                continue
            if not any(True for _ in [*m.parameters(recurse=False), *m.buffers(recurse=False)]):
                continue
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if not callable(reset):
                raise ConfigurationError(
                    f"{type(m).__name__} has parameters or buffers on the meta device but no "
                    "reset_parameters() to initialize them; pass param_init_fn=... to "
                    "FullyShardedDataParallel")
            reset()
    return True


def sync_module_states(modules: list[nn.Module], ignored_params: set[nn.Parameter], group: Any,
                       device: torch.device) -> None:
    """Broadcast the unit's parameters and buffers from the group's first rank
    (coalesced: one broadcast per dtype), before anything is sharded."""
    group = group if isinstance(group, dist.ProcessGroup) else None
    src = min(dist.get_process_group_ranks(group)) if group is not None else 0
    tensors = [getattr(m, n) for m, n, _ in _own_states(modules, ignored_params)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype in sorted(by_dtype, key=str):
            group_tensors = by_dtype[dtype]
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in group_tensors])
            dist.broadcast(flat, src=src, group=group)
            for t, piece in zip(group_tensors, flat.split([t.numel() for t in group_tensors])):
                t.copy_(piece.view_as(t))


def cast_buffers(modules: list[nn.Module], dtype: torch.dtype | None) -> None:
    """Cast floating buffers to ``buffer_dtype``; state dicts still report the
    original dtype (a state-dict hook casts back), as FSDP1 does."""
    if dtype is None:
        return
    for m in modules:
        original = {}
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                original[name] = buf.dtype
                m._buffers[name] = buf.to(dtype)
        if original:
            m._register_state_dict_hook(functools.partial(_restore_buffer_dtypes, original))


def _restore_buffer_dtypes(original: dict[str, torch.dtype], module: nn.Module, state_dict: dict,
                           prefix: str, local_metadata: Any) -> None:
    for name, dtype in original.items():
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor):
            state_dict[prefix + name] = value.to(dtype)


def _cast_floats(dtype: torch.dtype, store: dict, module: nn.Module, value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        store[module] = value.dtype
        return value.to(dtype)
    return value


def run_in_float32(module: nn.Module) -> None:
    """FSDP1's treatment of ``MixedPrecision._module_classes_to_ignore`` units:
    inputs cast to float32, outputs cast back to the input dtype."""
    seen_dtypes: dict[nn.Module, torch.dtype] = {}

    def pre(mod: nn.Module, args: Any) -> Any:
        return tree_map(functools.partial(_cast_floats, torch.float32, seen_dtypes, mod), args)

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        if mod in seen_dtypes:
            return tree_map(functools.partial(_cast_floats, seen_dtypes[mod], {}, mod), output)
        return output

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


# --------------------------------------------------------------------------
# one unit, and the whole tree


@dataclass
class Build:
    """What every unit of one ``FullyShardedDataParallel`` call shares."""

    device: torch.device
    ignored_modules: set[nn.Module]
    ignored_params: set[nn.Parameter]
    finish: Callable[[nn.Module, FSDP1Args], None]
    meshes: dict[tuple, DeviceMesh] = dataclasses.field(default_factory=dict)  # this call's only


def shard_unit(module: nn.Module, args: FSDP1Args, build: Build, *, is_root: bool) -> None:
    """Make ``module`` one FSDP1 unit: FSDP1's three per-unit steps on the
    modules it manages (not yet-sharded units below it, not ignored ones),
    then ``fully_shard`` with the mesh and policies its arguments map to,
    then ``build.finish`` (the FSDP1 class swap).

    Doing the steps per unit, right before that unit is sharded, keeps peak
    memory at one unsharded unit for meta-device models, as in FSDP1.
    """
    modules = unit_modules(module, build.ignored_modules)
    materialize_meta(modules, build.device, args.param_init_fn)
    if args.sync_module_states:
        sync_module_states(modules, build.ignored_params, args.process_group, build.device)
    mp = args.mixed_precision
    if mp is not None:
        cast_buffers(modules, mp.buffer_dtype)
    mesh = mapping.build_mesh(args.strategy, build.device, process_group=args.process_group,
                              device_mesh=args.device_mesh, cache=build.meshes)
    mp_fields = mapping.mixed_precision_fields(mp, is_root=is_root)
    # FSDP1 never frees the root's parameters after forward (backward needs
    # them at once); which unit is the root is only known at the first
    # forward, so the outermost call leaves it to the core (None).
    reshard = mapping.reshard_after_forward(args.strategy)
    fully_shard(module, mesh=mesh, reshard_after_forward=None if (is_root and reshard) else reshard,
                mp_policy=MixedPrecisionPolicy(**mp_fields) if mp_fields else MixedPrecisionPolicy(),
                offload_policy=CPUOffloadPolicy() if mapping.offload_params(args.cpu_offload) else OffloadPolicy(),
                ignored_params=build.ignored_params)
    build.finish(module, args)


def _warn_accepted_arguments(args: FSDP1Args) -> None:
    if args.use_orig_params is not _USE_ORIG_PARAMS_DEFAULT and not args.use_orig_params:
        mapping.warn_once("use_orig_params", "use_orig_params=False: shardkit always exposes the original "
                          "parameters (as DTensors), never flattened FlatParameters")
    mapping.check_backward_prefetch(args.backward_prefetch)


def _targets(root: nn.Module, args: FSDP1Args, ignored_modules: set[nn.Module]) -> list[WrapTarget]:
    """The policy's units, plus FSDP1's separate full-precision units for
    ``MixedPrecision._module_classes_to_ignore`` (e.g. batch norm)."""
    policy = args.auto_wrap_policy
    mp = args.mixed_precision
    classes = tuple(getattr(mp, "_module_classes_to_ignore", ()) or ()) if mp is not None else ()
    if policy is None or not classes:
        return plan_auto_wrap(root, policy, ignored_modules=ignored_modules)
    user = {t.module: t.overrides for t in plan_auto_wrap(root, policy, ignored_modules=ignored_modules)}

    def choose(m: nn.Module) -> bool | dict[str, Any]:
        if isinstance(m, classes):
            return {**user.get(m, {}), "mixed_precision": None}
        return user[m] if m in user else False

    targets = plan_auto_wrap(root, CustomPolicy(choose), ignored_modules=ignored_modules)
    for t in targets:
        if isinstance(t.module, classes):
            run_in_float32(t.module)
    return targets


def construct(root: nn.Module, args: FSDP1Args, finish: Callable[[nn.Module, FSDP1Args], None]) -> nn.Module:
    """Shard ``root`` FSDP1-style: the policy's units bottom-up, then ``root``.

    ``finish(module, unit_args)`` runs after each unit's ``fully_shard`` (the
    FSDP1 class swap lives with the class).
    """
    if isinstance(root, FSDPModule):
        raise AlreadyShardedError(f"this {type(root).__name__} is already sharded; apply "
                                  "FullyShardedDataParallel once per module")
    _warn_accepted_arguments(args)
    ignored_modules, ignored_params = resolve_ignored(root, args)
    build = Build(mapping.compute_device(args.device_id), ignored_modules, ignored_params, finish)
    for target in _targets(root, args, ignored_modules):
        unknown = set(target.overrides) - {f.name for f in dataclasses.fields(FSDP1Args)}
        if unknown:
            raise ConfigurationError(f"CustomPolicy returned unknown FullyShardedDataParallel arguments "
                                     f"{sorted(unknown)} for {target.name!r}")
        shard_unit(target.module, dataclasses.replace(args, **target.overrides), build, is_root=False)
    shard_unit(root, args, build, is_root=True)
    return root
