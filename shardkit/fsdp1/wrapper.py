"""``FullyShardedDataParallel``: FSDP1's class, built on ``fully_shard``.

``FullyShardedDataParallel(module, ...)`` shards ``module`` in place and
returns *the same module object*: there is no wrapper, so names, FQNs and
``state_dict()`` keys stay the original model's (no
``_fsdp_wrapped_module.`` prefix).  Each unit's class becomes a subclass of
both this class and the core's ``FSDP<Name>``, so it is an instance of its
original class, of ``FSDPModule`` and of ``FullyShardedDataParallel``, and it
has FSDP1's methods.  ``module.module`` is the module itself.

The statics (``state_dict_type``, ``summon_full_params``, the optimizer-state
functions, ...) accept any module holding FSDP1 units, as in FSDP1.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch
import torch.nn as nn

from shardkit.errors import ConfigurationError
from shardkit.fsdp1 import full_params, mapping, model_state, optim_state
from shardkit.fsdp1.api import BackwardPrefetch
from shardkit.fsdp1.construct import FSDP1Args, construct
from shardkit.runtime import FSDPModule
from shardkit.runtime.grad_norm import clip_grad_norm_

__all__ = ["FullyShardedDataParallel"]

ARGS_ATTR = "_fsdp1_args"


class FullyShardedDataParallel(FSDPModule, nn.Module):
    """FSDP1's ``FullyShardedDataParallel`` on the shardkit core.

    Takes FSDP1's constructor arguments (see ``docs/migration.md`` for what
    each one does here) and returns ``module`` itself, sharded in place.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not FullyShardedDataParallel:
            # A container building a new ``type(self)`` (e.g. slicing an
            # nn.Sequential): that new module is not sharded.
            original = cls.__dict__["_fsdp1_original_class"]
            obj = original.__new__(original)
            obj.__init__(*args, **kwargs)
            return obj
        bound = _SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        module = values.pop("module")
        if not isinstance(module, nn.Module):
            raise ConfigurationError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
        if values["use_orig_params"] is _DEFAULT:
            del values["use_orig_params"]  # not passed: FSDP1's default, nothing to warn about
        args = FSDP1Args(**values)
        construct(module, args, _finish_unit)
        _finish_root(module, args)
        return module

    def __init__(self, module: nn.Module, process_group: Any = None, sharding_strategy: Any = None,
                 cpu_offload: Any = None, auto_wrap_policy: Any = None,
                 backward_prefetch: Any = BackwardPrefetch.BACKWARD_PRE, mixed_precision: Any = None,
                 ignored_modules: Iterable[nn.Module] | None = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, device_id: Any = None,
                 sync_module_states: bool = False, forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = False, ignored_states: Any = None, device_mesh: Any = None) -> None:
        # Everything happened in __new__, which returned the sharded module.
        pass

    # ------------------------------------------------------------ properties

    @property
    def module(self) -> nn.Module:
        """The wrapped module: the module itself.  The model's own ``module``
        attribute or child, if it has one, wins, so its code keeps working."""
        if "module" in self.__dict__:
            return self.__dict__["module"]
        child = self.__dict__.get("_modules", {}).get("module")
        return child if child is not None else self

    @module.setter
    def module(self, value: Any) -> None:
        # nn.Module.__setattr__ files modules/parameters itself and sends plain values here
        self.__dict__["module"] = value

    @property
    def _fsdp_wrapped_module(self) -> nn.Module:
        return self

    def check_is_root(self) -> bool:
        """Whether no other FSDP1 unit contains this one (known once constructed)."""
        return bool(self.__dict__.get("_fsdp1_is_root", False))

    # ----------------------------------------------------------- the methods

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally, without communication, for every unit
        under this one; the first backward after the block reduces the sum."""
        units = [m for m in self.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients of this model to total norm ``max_norm``; return the
        total norm (before clipping).  Call on every rank.

        The runtime's :func:`shardkit.clip_grad_norm_` as is: it counts each
        gradient once over every mix an FSDP1 model produces (``DTensor``
        gradients on several meshes, replicas of ``NO_SHARD`` and HSDP units,
        whole gradients of ignored parameters)."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``nn.Module.apply`` with full parameters summoned (and written back)."""
        with full_params.summon_full_params(self, recurse=False, writeback=True):
            nn.Module.apply(self, fn)
        return self

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Refused: the core runs each unit's reduce-scatter itself and offers no
        hook to replace it; the error names the settings that cover the usual
        hooks (a low-precision reduction, a custom divide factor)."""
        raise ConfigurationError(
            "register_comm_hook has no equivalent on shardkit: gradients are reduce-scattered per unit "
            "in reduce_dtype; use MixedPrecision(reduce_dtype=...) or the core's "
            "set_gradient_divide_factor instead")

    # ------------------------------------------------------------- statics

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every FSDP1 unit in ``module``'s tree, or only the outermost ones."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return units
        inner = {id(sub) for u in units for sub in u.modules() if sub is not u}
        return [u for u in units if id(u) not in inner]

    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False) -> contextlib.AbstractContextManager:
        """Full parameters on the modules inside the block; see :mod:`shardkit.fsdp1.full_params`."""
        return full_params.summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)

    set_state_dict_type = staticmethod(model_state.set_state_dict_type)
    get_state_dict_type = staticmethod(model_state.get_state_dict_type)
    state_dict_type = staticmethod(model_state.state_dict_type)

    full_optim_state_dict = staticmethod(optim_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_state.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_state.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_state.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_state.rekey_optim_state_dict)
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)


_DEFAULT = object()  # tells an explicit use_orig_params=False from the default
_SIGNATURE = inspect.signature(FullyShardedDataParallel.__init__).replace(
    parameters=[p.replace(default=_DEFAULT) if p.name == "use_orig_params" else p
                for p in list(inspect.signature(FullyShardedDataParallel.__init__).parameters.values())[1:]])
FullyShardedDataParallel.__signature__ = _SIGNATURE.replace(  # type: ignore[attr-defined]
    parameters=list(inspect.signature(FullyShardedDataParallel.__init__).parameters.values())[1:])


# --------------------------------------------------------------------------
# the class swap and per-unit state


_classes: dict[type, type] = {}


def _fsdp1_class(core_cls: type) -> type:
    """``FSDP<Name>`` (the core's class) -> its FSDP1 subclass, built once per class."""
    cls = _classes.get(core_cls)
    if cls is None:
        original = next(b for b in core_cls.__bases__ if not issubclass(b, FSDPModule))
        cls = type(core_cls.__name__, (FullyShardedDataParallel, core_cls),
                   {"__module__": core_cls.__module__, "_fsdp1_original_class": original})
        _classes[core_cls] = cls
    return cls


def _finish_unit(module: nn.Module, args: FSDP1Args) -> None:
    module.__class__ = _fsdp1_class(type(module))
    module.__dict__[ARGS_ATTR] = args
    module.__dict__[model_state.SETTINGS_ATTR] = model_state.DEFAULT_SETTINGS
    module.register_state_dict_post_hook(model_state.post_state_dict_hook)
    module.register_load_state_dict_pre_hook(model_state.pre_load_state_dict_hook)


def _finish_root(root: nn.Module, args: FSDP1Args) -> None:
    for unit in FullyShardedDataParallel.fsdp_modules(root):
        unit.__dict__["_fsdp1_is_root"] = unit is root
    units = [u for u in root.modules() if isinstance(u, FSDPModule) and u is not root]
    prefetch = mapping.as_enum(args.backward_prefetch, BackwardPrefetch, "backward_prefetch")
    if prefetch is None:  # FSDP1: no backward prefetch; an empty list turns the core's default off
        for unit in [root, *units]:
            unit.set_modules_to_backward_prefetch([])
    if args.forward_prefetch:
        _record_forward_order(root, units)


def _record_forward_order(root: nn.Module, units: list[nn.Module]) -> None:
    """FSDP1's ``forward_prefetch``: follow the first iteration's order, then
    prefetch each unit's successor explicitly."""
    order: list[nn.Module] = []
    handles = [u.register_forward_pre_hook(lambda m, a: order.append(m) if m not in order else None)
               for u in units]

    def after_first_forward(module: nn.Module, inputs: Any, output: Any) -> None:
        for h in handles:
            h.remove()
        done.remove()
        for current, following in zip(order, order[1:]):
            current.set_modules_to_forward_prefetch([following])

    done = root.register_forward_hook(after_first_forward)
