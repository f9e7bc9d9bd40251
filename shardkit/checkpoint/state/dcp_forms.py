"""The shapes torch's DCP state-dict functions give and take, and the checks they make on their options.

:mod:`~shardkit.checkpoint.state.dcp_state_dict` answers to code written for
``torch.distributed.checkpoint.state_dict``; what it must reproduce exactly --
the flat optimizer keys (``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``),
how a combined optimizer state dict is split among several optimizers, and
which inputs torch refuses with which builtin error and wording -- is written
here, apart from the moving of tensors.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterable, TypeVar

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from shardkit.errors import ArgumentTypeError
from shardkit.wire.fqn import eager_fqn

__all__ = ["StateDictOptions", "as_optimizers", "checked_options", "check_not_empty", "param_names",
           "flatten_optim_state_dict", "unflatten_optim_state_dict", "split_optim_state_dict", "formerly"]

Function = TypeVar("Function", bound=Callable[..., Any])


def formerly(old_use: str) -> Callable[[Function], Function]:
    """A torch-named function whose wrong-shaped calls also say where shardkit's former function went.

    Until these functions followed torch, ``shardkit.checkpoint.state_dict``
    gave the same names to shardkit's own dict form (``get_state_dict(model,
    optimizer)`` returned ``{"model": ..., "optim": ...}``, ``set_*`` took
    ``strict=``).  Such a call now misses torch's signature, and Python raises
    a ``TypeError`` before the body runs; that error, and only that one (a
    ``TypeError`` from inside the body passes unchanged), becomes
    :class:`~shardkit.errors.ArgumentTypeError` -- still the ``TypeError``
    torch raises, with Python's wording first -- followed by ``old_use``.
    """
    def wrap(function: Function) -> Function:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except TypeError as exc:
                if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
                    raise  # raised inside the function: the call itself fits the signature
                raise ArgumentTypeError(f"{exc}. {function.__name__} is torch.distributed.checkpoint.state_dict's; "
                                        f"{old_use}") from None
        return call  # type: ignore[return-value]
    return wrap


def as_optimizers(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
                  ) -> tuple[torch.optim.Optimizer, ...]:
    """One optimizer or an iterable of them, as torch accepts both; ``None`` (shardkit's former "no optimizer")
    is torch's ``TypeError`` with where to go instead."""
    if optimizers is None:
        raise ArgumentTypeError("'NoneType' object is not iterable. torch's state-dict functions take an optimizer "
                                "or an iterable of them; for the model alone use get_model_state_dict / "
                                "set_model_state_dict. shardkit's former get_state_dict(model, None) is now "
                                "get_training_state(model).")
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)


def checked_options(options: StateDictOptions | None, *, optimizers: tuple[torch.optim.Optimizer, ...] = (),
                    optim_only: bool = False, submodules: Any = None) -> StateDictOptions:
    """``options`` (default: torch's defaults) after torch's own checks, with torch's warning and errors."""
    if submodules:
        warnings.warn("Getting submodules only model/optim state_dict is deprecated and will be removed in 2.5. "
                      "This feature can be achieved by manually filtering out the state_dict returned from "
                      "get_state_dict.", FutureWarning, stacklevel=3)
    if optim_only and not optimizers:
        raise RuntimeError("Optimizers are not passed in but optim_only is set to True.")
    options = options or StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")
    return options


def check_not_empty(model_sd: dict[str, Any], optim_sd: dict[str, Any], options: StateDictOptions, *,
                    handle_model: bool, handle_optim: bool, filtered: bool = False) -> None:
    """torch's refusal of an empty state dict where one is needed (``RuntimeError``, torch's wording)."""
    gathered_elsewhere = options.cpu_offload and options.full_state_dict
    if handle_model and not model_sd and not filtered and not options.ignore_frozen_params \
            and not gathered_elsewhere and options.strict and not options.broadcast_from_rank0:
        raise RuntimeError("The option indicates that model state_dict is required to save or load, but model "
                           "state_dict is empty. Pass the model's state dict (keys: its parameter FQNs).")
    if handle_optim and not optim_sd and not gathered_elsewhere and not options.broadcast_from_rank0:
        raise RuntimeError("The option indicates that model state_dict is required to save, or load but optim "
                           "state_dict is empty. Pass the optimizers' state dict (get_optimizer_state_dict's).")


def param_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> [FQN, ...]``: every name of a parameter, a tied one's included (first = canonical)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqns = names.setdefault(id(p), [])
        if eager_fqn(name) not in fqns:
            fqns.append(eager_fqn(name))
    return names


# --------------------------------------------------------------------------
# flat optimizer keys


def _flatten_nested(values: dict[Any, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in values.items():
        path = f"{prefix}.{key}"
        if isinstance(value, dict):
            _flatten_nested(value, path, out)
        elif isinstance(value, (torch.Tensor, int, float)):
            out[path] = value
        else:
            raise NotImplementedError("Flattening optimizer state_dict only supports tensor, int, float, dict "
                                      f"states now. Type is {type(value)}. (state key {path!r})")


def flatten_optim_state_dict(osd: dict[str, Any]) -> dict[str, Any]:
    """``{"state": {fqn: {name: v}}, "param_groups": [...]}`` as torch's flat keys.

    ``state.<fqn>.<name>`` (nested state dicts continue the dots) and
    ``param_groups.<fqn>.<hyper-parameter>`` for each parameter of each group,
    so that optimizer state reshards by key like the model's (pipeline stages).
    """
    out: dict[str, Any] = {}
    for fqn, state in osd["state"].items():
        _flatten_nested(state, f"state.{fqn}", out)
    for group in osd["param_groups"]:
        for fqn in group["params"]:
            out.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    return out


def _nested(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of ``flat`` under ``prefix.`` as a nested dict (a state value that is itself a dict)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(prefix + "."):
            *parents, last = key[len(prefix) + 1:].split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
    return out


def _chosen_names(names: list[str], group: dict[str, Any], present: Any) -> list[str]:
    """The names of a parameter that a loaded state dict uses: all of them for an untied parameter; of a tied
    one, those the state dict holds (torch keeps a tied parameter under the names it was saved with)."""
    if len(names) == 1:
        return names
    return [n for n in names if present(n, group)]


def unflatten_optim_state_dict(optimizer: torch.optim.Optimizer, flat: dict[str, Any],
                               names: dict[int, list[str]]) -> dict[str, Any]:
    """torch's flat keys back to ``{"state": ..., "param_groups": ...}`` for ``optimizer``'s parameters."""
    def present(fqn: str, group: dict[str, Any]) -> bool:
        first = next((k for k in group if k != "params"), None)
        return first is None or f"param_groups.{fqn}.{first}" in flat

    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        loaded: dict[str, Any] = {"params": []}
        for p in group["params"]:
            for fqn in _chosen_names(names[id(p)], group, present):
                loaded["params"].append(fqn)
                if p.requires_grad:
                    state[fqn] = {name: flat[f"state.{fqn}.{name}"] if f"state.{fqn}.{name}" in flat
                                  else _nested(flat, f"state.{fqn}.{name}") for name in optimizer.state[p]}
        first = loaded["params"][0]
        for k in group:
            if k == "params":
                continue
            value = flat[f"param_groups.{first}.{k}"]
            if k in loaded and loaded[k] != value:
                raise RuntimeError("All the parameters in the same parameter group should have the same saved "
                                   f"param_group value. But {first}.{k} is {value} while other(s) is {loaded[k]}.")
            loaded[k] = value
        groups.append(loaded)
    return {"state": state, "param_groups": groups}


def split_optim_state_dict(optimizer: torch.optim.Optimizer, osd: dict[str, Any], names: dict[int, list[str]],
                           *, strict: bool) -> dict[str, Any]:
    """The part of a combined (several optimizers') state dict that belongs to ``optimizer``.

    Groups are matched by the parameters they hold, so optimizers may be given
    in any order; with ``strict`` a trainable parameter without saved state is
    torch's ``RuntimeError``.
    """
    if all(isinstance(k, int) for k in osd["state"]):
        return osd  # keyed by parameter id: the optimizer's own form, as torch passes it on

    def present(fqn: str, _group: dict[str, Any]) -> bool:
        return any(fqn in g["params"] for g in osd["param_groups"])

    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        loaded: dict[str, Any] = {"params": []}
        source = None
        for p in group["params"]:
            for fqn in _chosen_names(names[id(p)], group, present):
                loaded["params"].append(fqn)
                if p.requires_grad:
                    if fqn in osd["state"]:
                        state[fqn] = osd["state"][fqn]
                    elif strict:
                        raise RuntimeError(f"Missing optimizer state for parameter '{fqn}' in checkpoint. The "
                                           "parameter requires gradients but has no saved optimizer state. To "
                                           "load anyway, use StateDictOptions(strict=False).")
                source = source or next((g for g in osd["param_groups"] if fqn in g["params"]), None)
        if source is None and not group["params"]:
            empty = [g for g in osd["param_groups"] if not g["params"]]
            if len(empty) != 1:
                raise ValueError("There are param groups that have zero parameters. In such a case, DSD only "
                                 "support exactly one param group with zero parameters.But the loaded state_dict "
                                 "has zero or more than one param groups that have zero parameters.")
            source = empty[0]
        loaded.update({k: v for k, v in (source or {}).items() if k != "params"})
        groups.append(loaded)
    return {"state": state, "param_groups": groups}
