"""FSDP1's optimizer-state functions.

FSDP1 names optimizer state by parameter FQN (its "full" and "sharded"
optimizer state dicts) while ``torch.optim`` names it by integer ID.
``rekey_optim_state_dict`` converts between the two.  The other functions
convert between the optimizer's own state and FQN-keyed full or sharded
forms; the tensor work (gathering, sharding, broadcasting) is the
checkpoint subsystem's (:mod:`shardkit.checkpoint.state_dict`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from shardkit.errors import ConfigurationError
from shardkit.fsdp1 import mapping
from shardkit.fsdp1.api import OptimStateKeyType

__all__ = ["rekey_optim_state_dict", "param_id_order", "fqn_of_params"]


def fqn_of_params(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's FQN (the first name of a shared parameter)."""
    out: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(p, name)
    return out


def param_id_order(model: nn.Module, optim: torch.optim.Optimizer | None,
                   optim_input: Iterable[Any] | None = None) -> list[nn.Parameter]:
    """Parameters in the order ``torch.optim`` numbers them: the optimizer's
    groups, else ``optim_input`` (params or param-group dicts), else
    ``model.parameters()``."""
    if optim is not None:
        return [p for group in optim.param_groups for p in group["params"]]
    if optim_input is not None:
        items = list(optim_input)
        if items and isinstance(items[0], dict):
            return [p for group in items for p in group["params"]]
        return items
    return list(model.parameters())


def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: OptimStateKeyType,
                           model: nn.Module, optim_input: Iterable[Any] | None = None,
                           optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Re-key an optimizer state dict by parameter name (``PARAM_NAME``) or by
    ``torch.optim``'s integer IDs (``PARAM_ID``).

    IDs follow ``optim``'s parameter order (else ``optim_input``'s, else
    ``model.parameters()``); names are ``model``'s FQNs.  As in FSDP1, each
    param group's ``"params"`` list comes back sorted, and a dict already
    keyed the asked way is returned unchanged.
    """
    key_type = mapping.as_enum(optim_state_key_type, OptimStateKeyType, "optim_state_key_type")
    keys = list(optim_state_dict["state"]) + [k for g in optim_state_dict["param_groups"] for k in g["params"]]
    named = [type(k) is str for k in keys]
    numbered = [type(k) is int for k in keys]
    if not (all(named) or all(numbered)):
        raise ConfigurationError("the optimizer state dict mixes parameter names and IDs (or uses other keys); "
                                 "it must be keyed uniformly")
    if (key_type is OptimStateKeyType.PARAM_NAME and all(named)) or (
            key_type is OptimStateKeyType.PARAM_ID and all(numbered)):
        return optim_state_dict
    order = param_id_order(model, optim, optim_input)
    names = fqn_of_params(model)
    id_to_name = {i: names[p] for i, p in enumerate(order) if p in names}
    if key_type is OptimStateKeyType.PARAM_NAME:
        mapping_ = id_to_name
    else:
        mapping_ = {name: i for i, name in id_to_name.items()}
    missing = [k for k in keys if k not in mapping_]
    if missing:
        raise ConfigurationError(f"optimizer state keys {missing[:5]} do not match the model's parameters "
                                 f"({'names' if key_type is OptimStateKeyType.PARAM_ID else 'IDs'}); "
                                 "pass the optimizer (optim=...) the state dict belongs to")
    out: dict[str, Any] = {"state": {mapping_[k]: v for k, v in optim_state_dict["state"].items()},
                           "param_groups": copy.deepcopy(
                               [{k: v for k, v in g.items() if k != "params"}
                                for g in optim_state_dict["param_groups"]])}
    for new_group, old_group in zip(out["param_groups"], optim_state_dict["param_groups"]):
        new_group["params"] = sorted(mapping_[k] for k in old_group["params"])
    return out

