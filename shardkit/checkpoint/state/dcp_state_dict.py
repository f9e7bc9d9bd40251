"""torch's ``torch.distributed.checkpoint.state_dict`` functions, for code written against them.

Same signatures, options (torch's own :class:`StateDictOptions`), return types,
errors and results as torch 2.13: ``get_state_dict`` returns ``(model_sd,
optim_sd)``, ``set_model_state_dict``/``set_state_dict`` return
``_IncompatibleKeys``, keys are canonical FQNs (no ``_orig_mod.`` or
activation-checkpoint parts), sharded tensors stay DTensors unless
``full_state_dict``.  Only tensors and placements are looked at, so a model
sharded by shardkit, by torch's ``fully_shard``, by tensor parallelism or not
at all is handled alike (torch's FSDP1 ``FlatParameter`` models are not: use
torch's own functions for those).

shardkit's own training-state form (``{"model": ..., "optim": ...}``, what
``save``/``load`` and ``CheckpointManager`` take) is
:func:`~shardkit.checkpoint.state.training_state.get_training_state`.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.nn.modules.module as nn_module
from torch.utils._pytree import tree_map_only

from shardkit.checkpoint.geometry.boxes import is_dtensor
from shardkit.checkpoint.state.dcp_forms import (
    StateDictOptions,
    as_optimizers,
    check_not_empty,
    checked_options,
    flatten_optim_state_dict,
    formerly,
    param_names,
    split_optim_state_dict,
    unflatten_optim_state_dict,
)
from shardkit.checkpoint.state.rank0_tree import broadcast_tree
from shardkit.checkpoint.state.relayout import gather_full_state, relayout_like
from shardkit.checkpoint.state.training_state import (
    init_optimizer_state,
    live_model_state,
    live_optimizer_state,
    live_tensors,
)
from shardkit.wire.fqn import eager_fqn

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


# --------------------------------------------------------------------------
# reading


def _full_or_offloaded(tree: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    """Full tensors (``full_state_dict``; with ``cpu_offload`` on rank 0 only, ``{}`` elsewhere) or CPU copies."""
    if options.full_state_dict:
        rank0_only = options.cpu_offload and torch.distributed.is_initialized()
        return gather_full_state(tree, rank0_only=rank0_only, cpu_offload=options.cpu_offload)
    if options.cpu_offload:
        return tree_map_only(torch.Tensor, lambda t: t.to("cpu"), tree)
    return tree


def _model_part(model: nn.Module, options: StateDictOptions, submodules: Any) -> dict[str, Any]:
    state = live_model_state(model)
    if submodules:
        prefixes = [f"{eager_fqn(name)}." for name, m in model.named_modules() if m in set(submodules)]
        state = {(k if options.keep_submodule_prefixes else k[len(p):]): v
                 for k, v in state.items() for p in prefixes if k.startswith(p)}
    if options.ignore_frozen_params:
        frozen = {eager_fqn(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    return _full_or_offloaded(state, options)


def _init_like_torch(optimizer: torch.optim.Optimizer) -> None:
    """torch's rule for creating a fresh optimizer's state: only when it has none and no gradient is set.

    Unlike shardkit's own :func:`init_optimizer_state`, the step counters stay
    at 1, as torch leaves them: a drop-in reports what torch reports.
    """
    if optimizer.state or any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    init_optimizer_state(optimizer, reset_steps=False)


def _optim_part(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
                options: StateDictOptions) -> dict[str, Any]:
    if not optimizers:
        return {}
    combined: dict[str, Any] = {"state": {}, "param_groups": []}
    for optimizer in optimizers:
        _init_like_torch(optimizer)
        osd = live_optimizer_state(model, optimizer, init_fresh=False)
        combined["state"].update(osd["state"])
        combined["param_groups"].extend(osd["param_groups"])
    if options.flatten_optimizer_state_dict:
        combined = flatten_optim_state_dict(combined)
    return _full_or_offloaded(combined, options)


def get_model_state_dict(model: nn.Module, *, submodules: set[nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict keyed by canonical FQNs, as torch's ``get_model_state_dict``."""
    options = checked_options(options, submodules=submodules)
    state = _model_part(model, options, submodules)
    check_not_empty(state, {}, options, handle_model=True, handle_optim=False, filtered=bool(submodules))
    return state


@formerly("shardkit's former get_optimizer_state_dict(model, optimizer, *, init_fresh=True) is now "
           "live_optimizer_state, or get_training_state(model, optimizer)['optim'].")
def get_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules: set[nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' combined state dict keyed by parameter FQN, as torch's ``get_optimizer_state_dict``."""
    optimizers = as_optimizers(optimizers)
    options = checked_options(options, optimizers=optimizers, optim_only=True, submodules=submodules)
    state = _optim_part(model, optimizers, options)
    check_not_empty({}, state, options, handle_model=False, handle_optim=True)
    return state


@formerly("shardkit's former get_state_dict(model, optimizer=None, *, trainable_only=False), which returned "
           "{'model': ..., 'optim': ...}, is now get_training_state.")
def get_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules: set[nn.Module] | None = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optimizer_state_dict)``, as torch's ``get_state_dict``."""
    optimizers = as_optimizers(optimizers)
    options = checked_options(options, optimizers=optimizers, submodules=submodules)
    model_sd = _model_part(model, options, submodules)
    optim_sd = _optim_part(model, optimizers, options)
    check_not_empty(model_sd, optim_sd, options, handle_model=True, handle_optim=bool(optimizers),
                    filtered=bool(submodules))
    return model_sd, optim_sd


# --------------------------------------------------------------------------
# loading


def _cut_like(full: torch.Tensor, like: Any) -> torch.Tensor:
    """``full`` (or a DTensor of another layout) laid out like the live ``like``; unchanged when it cannot be
    (no such key, another shape: ``load_state_dict`` then reports it with the key)."""
    if not isinstance(like, torch.Tensor) or like.dim() == 0 or tuple(full.shape) != tuple(like.shape):
        return full.cpu() if full.dim() == 0 else full
    if is_dtensor(like):
        return relayout_like(full, like)
    return full.detach().to(like.device)


def _with_module_keys(model: nn.Module, state_dict: dict[Any, Any]) -> dict[str, Any]:
    """torch's deprecated ``{submodule: its state dict}`` form as one FQN-keyed dict (with torch's warning)."""
    if not state_dict or not isinstance(next(iter(state_dict)), nn.Module):
        return state_dict
    warnings.warn("Passing model_state_dict as a ``Dict[nn.Module, Dict[str, Any]]``is deprecated and will be "
                  "removed in 2.5. If you need this feature, please preprocess the model_state_dict to achieve the "
                  "same functionality.", FutureWarning, stacklevel=3)
    prefix = {m: eager_fqn(name) for name, m in model.named_modules()}
    return {f"{prefix[m]}.{k}" if prefix[m] else k: v for m, sub in state_dict.items() for k, v in sub.items()}


def _load_model(model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions) -> Any:
    if not state_dict and not options.broadcast_from_rank0:
        return nn_module._IncompatibleKeys([], [])
    live = live_model_state(model)
    if options.broadcast_from_rank0:
        state_dict = broadcast_tree(lambda: dict(state_dict), lambda path, full: _cut_like(full, live.get(path[0])))
        if not options.strict:  # a key rank 0 lacks keeps its live value, as torch does
            state_dict = {**live, **state_dict}
    elif options.full_state_dict:
        state_dict = {k: _cut_like(v, live.get(k)) if isinstance(v, torch.Tensor) else v
                      for k, v in state_dict.items()}
    with live_tensors():
        raw = {eager_fqn(k): k for k in model.state_dict()}
    with torch.no_grad():
        return model.load_state_dict({raw.get(k, k): v for k, v in state_dict.items()}, strict=options.strict)


def _load_optims(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], osd: dict[str, Any],
                 options: StateDictOptions) -> None:
    names = param_names(model)
    for optimizer in optimizers:
        _init_like_torch(optimizer)
    for optimizer in optimizers:
        # .get: indexing the state defaultdict would add an empty entry for each parameter without state
        like = {fqn: optimizer.state.get(p, {}) for g in optimizer.param_groups for p in g["params"]
                for fqn in names[id(p)]}

        def own_part(optimizer: torch.optim.Optimizer = optimizer) -> dict[str, Any]:
            if not osd:
                return {}
            if "state" in osd:
                return split_optim_state_dict(optimizer, osd, names, strict=options.strict)
            return unflatten_optim_state_dict(optimizer, osd, names)

        def cut(path: tuple[Any, ...], full: torch.Tensor) -> torch.Tensor:
            slot = like.get(path[1], {}) if len(path) == 3 and path[0] == "state" else {}
            return _cut_like(full, slot.get(path[2]))

        if options.broadcast_from_rank0:
            part = broadcast_tree(own_part, cut)
        else:
            part = own_part()
            for fqn, values in part.get("state", {}).items():
                for name, value in list(values.items()) if isinstance(values, dict) else ():
                    if isinstance(value, torch.Tensor):
                        values[name] = cut(("state", fqn, name), value)
        if part:
            optimizer.load_state_dict(part)


@formerly("strict is StateDictOptions(strict=...) in options=. shardkit's former set_model_state_dict(model, "
           "state_dict, *, strict=True) is now apply_model_state, or set_training_state(model, None, "
           "{'model': state_dict}).")
def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> Any:
    """Load a model state dict (sharded, or full with ``full_state_dict``); torch's ``_IncompatibleKeys``."""
    model_state_dict = _with_module_keys(model, model_state_dict)
    options = checked_options(options)
    check_not_empty(model_state_dict, {}, options, handle_model=True, handle_optim=False)
    return _load_model(model, model_state_dict, options)


@formerly("strict is StateDictOptions(strict=...) in options=. shardkit's former set_optimizer_state_dict(model, "
           "optimizer, osd, *, strict=True) is now apply_optimizer_state.")
def set_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Load the optimizers' state (FQN-keyed, nested or flat), as torch's ``set_optimizer_state_dict``."""
    optimizers = as_optimizers(optimizers)
    options = checked_options(options, optimizers=optimizers, optim_only=True)
    check_not_empty({}, optim_state_dict, options, handle_model=False, handle_optim=True)
    _load_optims(model, optimizers, optim_state_dict, options)


@formerly("model_state_dict= and optim_state_dict= are keyword-only and strict is StateDictOptions(strict=...) "
           "in options=. shardkit's former set_state_dict(model, optimizer, {'model': ..., 'optim': ...}, "
           "*, strict=True) is now "
           "set_training_state.")
def set_state_dict(model: nn.Module, optimizers: Optimizers, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: StateDictOptions | None = None) -> Any:
    """Load model and optimizers (optimizers first, as torch); torch's ``_IncompatibleKeys`` of the model."""
    model_state_dict = _with_module_keys(model, model_state_dict)
    optimizers = as_optimizers(optimizers)
    options = checked_options(options, optimizers=optimizers, optim_only=not model_state_dict)
    handle_model = bool(model_state_dict) or options.broadcast_from_rank0
    check_not_empty(model_state_dict, optim_state_dict, options, handle_model=handle_model,
                    handle_optim=bool(optimizers))
    _load_optims(model, optimizers, optim_state_dict, options)
    if not handle_model:
        return nn_module._IncompatibleKeys([], [])
    return _load_model(model, model_state_dict, options)
