"""FSDP1's ``state_dict_type``: what ``module.state_dict()`` returns and what
``module.load_state_dict()`` accepts on an FSDP1 model.

Every unit carries a :class:`StateDictSettings` (FSDP1's default:
``FULL_STATE_DICT``); ``set_state_dict_type`` sets it on every unit under a
module.  A state-dict post-hook on each unit turns the ``DTensor`` values of
its subtree into what the type asks for, so the keys are always the original
FQNs:

* ``FULL_STATE_DICT``: each ``DTensor`` is gathered with ``full_tensor()``
  one at a time (every rank takes part), moved to the CPU with
  ``offload_to_cpu``, and dropped on ranks other than 0 with ``rank0_only``.
* ``SHARDED_STATE_DICT`` (and ``LOCAL_STATE_DICT``, served the same way):
  ``DTensor`` values as they are, no communication.

``shardkit.checkpoint`` reads state dicts inside its ``live_tensors()``
context and always gets the live ``DTensor``s, so its ``get_training_state`` /
``save`` / ``load`` work on FSDP1 models whatever their state-dict type.

Loading goes the other way: a pre-hook turns every plain tensor aimed at a
``DTensor`` parameter into a ``DTensor`` with the parameter's mesh and
placements by slicing locally (every rank holds the full tensor in FSDP1's
full-state-dict load, so no communication is needed).  ``DTensor`` values,
e.g. from ``torch.distributed.checkpoint``, pass through; one laid out for
another mesh is gathered and re-cut.  That re-cut is the checkpoint
subsystem's ``relayout_like``, the same one its own loads and the FSDP1
optimizer-state functions use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardkit.checkpoint.state.training_state import reading_live_tensors, relayout_like
from shardkit.errors import ConfigurationError
from shardkit.fsdp1 import mapping
from shardkit.fsdp1.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = ["SETTINGS_ATTR", "DEFAULT_SETTINGS", "units_under", "set_state_dict_type", "get_state_dict_type",
           "state_dict_type", "post_state_dict_hook", "pre_load_state_dict_hook"]

SETTINGS_ATTR = "_fsdp1_state_dict_settings"
DEFAULT_SETTINGS = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                     FullOptimStateDictConfig())

_CONFIGS: dict[StateDictType, tuple[type, type]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def units_under(module: nn.Module) -> list[nn.Module]:
    """Every FSDP1 unit in ``module``'s tree (``module`` included), in module order."""
    return [m for m in module.modules() if SETTINGS_ATTR in m.__dict__]


def settings_of(unit: nn.Module) -> StateDictSettings:
    """``unit``'s state-dict settings (FSDP1's default, ``FULL_STATE_DICT``, until set)."""
    return unit.__dict__.get(SETTINGS_ATTR, DEFAULT_SETTINGS)


def _check_config(config: Any, expected: type, base: type, kind: StateDictType) -> Any:
    if config is None:
        return expected()
    # torch's own config objects are accepted when they are the matching kind
    if isinstance(config, expected) or type(config).__name__ == expected.__name__:
        return config
    if type(config) in (base,) or type(config).__name__ == base.__name__:
        return config
    raise ConfigurationError(f"{type(config).__name__} does not configure {kind.name}; "
                             f"pass a {expected.__name__}")


def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: OptimStateDictConfig | None = None) -> StateDictSettings:
    """Set the type and configs on every unit under ``module``; return the previous settings."""
    kind = mapping.check_state_dict_type(state_dict_type)
    model_cls, optim_cls = _CONFIGS[kind]
    settings = StateDictSettings(kind, _check_config(state_dict_config, model_cls, StateDictConfig, kind),
                                 _check_config(optim_state_dict_config, optim_cls, OptimStateDictConfig, kind))
    units = units_under(module)
    if not units:
        raise ConfigurationError(f"{type(module).__name__} holds no FullyShardedDataParallel unit; "
                                 "set_state_dict_type applies to FSDP1 models")
    previous = settings_of(units[0])
    for unit in units:
        unit.__dict__[SETTINGS_ATTR] = settings
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings shared by every unit under ``module``; raise if they differ."""
    units = units_under(module)
    if not units:
        raise ConfigurationError(f"{type(module).__name__} holds no FullyShardedDataParallel unit")
    found = {settings_of(u) for u in units}
    if len(found) > 1:
        raise ConfigurationError(f"the FSDP1 units under {type(module).__name__} have different state-dict "
                                 "settings; call FullyShardedDataParallel.set_state_dict_type on the root")
    return found.pop()


@contextlib.contextmanager
def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                    state_dict_config: StateDictConfig | None = None,
                    optim_state_dict_config: OptimStateDictConfig | None = None) -> Generator[None, None, None]:
    """``set_state_dict_type`` for the duration of the block, then the previous settings again."""
    previous = {id(u): settings_of(u) for u in units_under(module)}
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for unit in units_under(module):
            if id(unit) in previous:
                unit.__dict__[SETTINGS_ATTR] = previous[id(unit)]


# --------------------------------------------------------------------------
# the hooks


def post_state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Registered on every unit: turn the unit subtree's ``DTensor`` values into
    what the unit's state-dict type asks for (see the module docstring).

    Units nest, so an inner unit's hook has already turned its values into
    plain tensors when the outer unit's hook runs; the outer one only touches
    what is still a ``DTensor``.  Inside ``shardkit.checkpoint``'s
    ``live_tensors()`` it does nothing, whatever the type.
    """
    settings = settings_of(module)
    if settings.state_dict_type is not StateDictType.FULL_STATE_DICT or reading_live_tensors():
        return  # shardkit.checkpoint asks for the live (sharded) tensors, whatever the type
    config = settings.state_dict_config
    offload = getattr(config, "offload_to_cpu", False)
    drop = getattr(config, "rank0_only", False) and dist.is_initialized() and dist.get_rank() != 0
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if drop:
            del state_dict[key]
            continue
        if offload and isinstance(value, torch.Tensor):
            value = value.cpu()
        state_dict[key] = value


def pre_load_state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                             strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                             error_msgs: list[str]) -> None:
    """Registered on every unit: lay each tensor aimed at one of the unit's
    ``DTensor`` parameters out like that parameter (the checkpoint
    subsystem's ``relayout_like``), so ``load_state_dict``'s in-place copy
    runs shard to shard.

    Values of the wrong shape are left alone for ``load_state_dict`` to report
    with their key.  A ``DTensor`` laid out for another mesh is gathered, so
    every rank must load (as in FSDP1).
    """
    for name, param in module.named_parameters():
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
            continue
        if tuple(value.shape) != tuple(param.shape):
            continue  # load_state_dict reports the size mismatch with the key
        # A plain (full) value needs no copy of its slice: load_state_dict copies the view into the
        # parameter.  A gathered DTensor is copied, so that the full tensors of the whole subtree are
        # not all kept alive until then (this hook runs for a unit before any of its loads).
        state_dict[key] = relayout_like(value.detach(), param, copy=isinstance(value, DTensor))
