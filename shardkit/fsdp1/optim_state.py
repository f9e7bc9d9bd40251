"""FSDP1's optimizer-state functions, on the checkpoint subsystem's state-dict code.

FSDP1 names optimizer state by parameter FQN in its "full" and "sharded"
optimizer state dicts, while ``torch.optim`` names it by integer ID:

* full (``full_optim_state_dict``, ``optim_state_dict`` under
  ``FULL_STATE_DICT``): ``{"state": {fqn: {"exp_avg": full tensor, ...}},
  "param_groups": [{..., "params": [fqn, ...]}]}``, gathered one tensor at a
  time, on rank 0 only by default;
* sharded (``sharded_optim_state_dict``, ``optim_state_dict`` under
  ``SHARDED_STATE_DICT``): the same with ``DTensor`` values (FSDP1 used
  ``ShardedTensor``), ready for ``torch.distributed.checkpoint``;
* loadable (what ``shard_full_``/``scatter_full_``/``flatten_sharded_optim_state_dict``
  and ``optim_state_dict_to_load`` return): ``optim.load_state_dict``'s
  ID-keyed form with each state tensor laid out like its parameter.

Gathering, sharding, re-cutting and broadcasting are
:mod:`shardkit.checkpoint.state.training_state`'s (``live_optimizer_state``,
``gather_full_state``, ``shard_state``, ``relayout_like``,
``to_torch_optimizer_state``); this module only maps FSDP1's signatures and
key conventions onto them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state import training_state as sd
from shardkit.checkpoint.state.tree import restore_like
from shardkit.errors import ConfigurationError, IncompatibleStateDict
from shardkit.fsdp1 import mapping, model_state
from shardkit.fsdp1.api import OptimStateKeyType, StateDictType

__all__ = ["rekey_optim_state_dict", "full_optim_state_dict", "sharded_optim_state_dict",
           "shard_full_optim_state_dict", "scatter_full_optim_state_dict", "flatten_sharded_optim_state_dict",
           "optim_state_dict", "optim_state_dict_to_load", "param_id_order"]


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
    names = sd.param_fqns(model)
    id_to_name = {i: names[id(p)] for i, p in enumerate(order) if id(p) in names}
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


# --------------------------------------------------------------------------
# FQN-keyed state from the live optimizer, and back to a loadable dict


def _named(osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer | None,
           optim_input: Iterable[Any] | None = None) -> dict[str, Any]:
    """``osd`` keyed by parameter FQN (re-keyed from IDs when needed)."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise IncompatibleStateDict("an optimizer state dict has 'state' and 'param_groups' entries; got keys "
                                    f"{sorted(osd)[:5] if isinstance(osd, dict) else type(osd).__name__}")
    return rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model, optim_input=optim_input, optim=optim)


def _live_named_state(model: nn.Module, optim: torch.optim.Optimizer, *, init_fresh: bool) -> dict[str, Any]:
    """The optimizer's own state keyed by FQN (live tensors, not copies).

    ``init_fresh`` creates the state of a never-stepped optimizer (zero
    moments, step 0: it then steps exactly like a fresh one) so that a sharded
    state dict has tensors for ``torch.distributed.checkpoint`` to load into;
    the full form leaves such an optimizer untouched, as FSDP1 does.
    """
    return sd.live_optimizer_state(model, optim, init_fresh=init_fresh)


def _loadable(model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Iterable[Any] | None,
              named: dict[str, Any]) -> dict[str, Any]:
    """FQN-keyed -> the ID-keyed dict ``optim.load_state_dict`` takes."""
    if optim is not None:
        out = sd.to_torch_optimizer_state(model, optim, named)
        for group, live in zip(out["param_groups"], optim.param_groups):
            for key, value in list(group.items()):
                if key != "params" and key in live:
                    group[key] = restore_like(value, live[key])
        return out
    return rekey_optim_state_dict(named, OptimStateKeyType.PARAM_ID, model, optim_input=optim_input)


def _params_by_fqn(model: nn.Module) -> dict[str, nn.Parameter]:
    """FQN -> parameter, with the FQNs the checkpoint subsystem uses (the
    first name of a shared parameter, wrapper parts dropped)."""
    names = sd.param_fqns(model)
    return {names[id(p)]: p for p in model.parameters()}


def _like_param(value: Any, param: nn.Parameter | None) -> Any:
    """A state tensor of its parameter's shape, laid out like the parameter
    (in the state's own dtype); anything else unchanged."""
    if isinstance(value, torch.Tensor) and isinstance(param, DTensor) and tuple(value.shape) == tuple(param.shape):
        return sd.relayout_like(value, param)
    return value


def _template(param: DTensor, dtype: torch.dtype) -> DTensor:
    """A ``DTensor`` with ``param``'s shape, mesh and placements in ``dtype``,
    holding no memory (one element expanded to the local shard's shape).

    ``shard_state`` cuts each full value like its template and, with
    ``broadcast_from_rank0``, allocates the other ranks' receive buffers in
    the template's dtype: the template is how those ranks learn that an
    optimizer moment of a bf16 parameter is fp32.  Only its metadata is read.
    """
    if param.dtype == dtype:
        return param.detach()
    local = param.to_local()
    empty = torch.empty((), dtype=dtype, device=local.device).expand(local.shape)
    return DTensor.from_local(empty, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _check_group(group: Any, function: str) -> None:
    """FSDP1's ``group`` names the process group the model is sharded over.
    shardkit gathers and cuts optimizer state over each parameter's own mesh
    and broadcasts from rank 0 of the default group, which is exactly that
    when ``group`` spans every rank; over fewer ranks it is not honoured: warn."""
    if group is None or not dist.is_initialized():
        return
    ranks = sorted(dist.get_process_group_ranks(group))
    if ranks == list(range(dist.get_world_size())):
        return
    mapping.warn_once(f"group:{function}", f"{function}(group=<{len(ranks)} of {dist.get_world_size()} ranks>) "
                      "is not honoured: shardkit uses each parameter's own mesh and broadcasts from rank 0 "
                      "of the default process group; call it on every rank of the default group", stacklevel=4)


# --------------------------------------------------------------------------
# the FSDP1 statics


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Iterable[Any] | None = None,
                          rank0_only: bool = True, group: Any = None) -> dict[str, Any]:
    """The full optimizer state keyed by FQN, on CPU; ``{}`` on ranks other
    than 0 with ``rank0_only`` (every rank must call it: it gathers).

    ``optim`` alone names the parameters (its param groups and the model's
    FQNs), so ``optim_input`` (deprecated in FSDP1) is not used: passing it
    warns once."""
    if optim_input is not None:
        mapping.warn_once("full_optim_state_dict:optim_input", "full_optim_state_dict(optim_input=...) is not "
                          "used: the optimizer's own param_groups name the parameters", stacklevel=3)
    _check_group(group, "full_optim_state_dict")
    named = _live_named_state(model, optim, init_fresh=False)
    return sd.gather_full_state(named, rank0_only=rank0_only, cpu_offload=True)


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group: Any = None) -> dict[str, Any]:
    """The optimizer state keyed by FQN with ``DTensor`` values (each rank its
    shard; no communication) for ``torch.distributed.checkpoint`` or
    ``shardkit.checkpoint``."""
    _check_group(group, "sharded_optim_state_dict")
    return _live_named_state(model, optim, init_fresh=True)


def _skeleton(named: dict[str, Any]) -> dict[str, Any]:
    """The JSON shape of a full optimizer state: tensor shapes/dtypes and plain values."""
    state = {fqn: {k: ({"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                       if isinstance(v, torch.Tensor) else {"value": v}) for k, v in values.items()}
             for fqn, values in named["state"].items()}
    return {"state": state, "param_groups": named["param_groups"]}


def _shard_full(full_osd: dict[str, Any] | None, model: nn.Module, optim: torch.optim.Optimizer | None,
                optim_input: Iterable[Any] | None, *, broadcast: bool) -> dict[str, Any]:
    comm = Dist()
    has_full = not broadcast or comm.rank == 0
    named = _named(full_osd, model, optim, optim_input) if has_full else None
    skeleton = _skeleton(named) if has_full else None
    if broadcast:
        skeleton = comm.broadcast_json(skeleton)
    params = _params_by_fqn(model)
    like: dict[str, Any] = {}
    for fqn, entries in skeleton["state"].items():
        param = params.get(fqn)
        if param is None:
            raise IncompatibleStateDict(f"optimizer state for {fqn!r}, which is not a parameter of the model")
        like[fqn] = {}
        for key, spec in entries.items():
            if "value" in spec:
                like[fqn][key] = spec["value"]
            elif isinstance(param, DTensor) and spec["shape"] == list(param.shape):
                # sharded like the parameter, in the state's own dtype (fp32 moments of bf16 weights stay fp32)
                like[fqn][key] = _template(param, getattr(torch, spec["dtype"]))
            else:
                like[fqn][key] = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
    sharded = sd.shard_state({"state": named["state"]} if has_full else {}, {"state": like},
                             broadcast_from_rank0=broadcast)
    groups = copy.deepcopy(named["param_groups"]) if has_full else skeleton["param_groups"]
    return _loadable(model, optim, optim_input, {"state": sharded["state"], "param_groups": groups})


def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module,
                                optim_input: Iterable[Any] | None = None,
                                optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's part of a full optimizer state dict, ready for
    ``optim.load_state_dict`` (every rank holds the full dict; no communication)."""
    return _shard_full(full_optim_state_dict, model, optim, optim_input, broadcast=False)


def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: nn.Module,
                                  optim_input: Iterable[Any] | None = None, optim: torch.optim.Optimizer | None = None,
                                  group: Any = None) -> dict[str, Any]:
    """Like :func:`shard_full_optim_state_dict`, but only rank 0 holds the full
    dict: its structure and each tensor in turn are broadcast."""
    _check_group(group, "scatter_full_optim_state_dict")
    return _shard_full(full_optim_state_dict, model, optim, optim_input, broadcast=True)


def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: nn.Module,
                                     optim: torch.optim.Optimizer) -> dict[str, Any]:
    """A sharded (FQN-keyed, ``DTensor``) optimizer state dict -> ``optim.load_state_dict``'s
    form; state laid out otherwise (another mesh, full tensors) is re-cut like the parameters."""
    named = _named(sharded_optim_state_dict, model, optim)
    params = _params_by_fqn(model)
    state = {fqn: {k: _like_param(v, params.get(fqn)) for k, v in values.items()}
             for fqn, values in named["state"].items()}
    return _loadable(model, optim, None, {"state": state, "param_groups": named["param_groups"]})


def _settings(model: nn.Module) -> Any:
    return model_state.get_state_dict_type(model) if model_state.units_under(model) else model_state.DEFAULT_SETTINGS


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                     optim_state_dict: dict[str, Any] | None = None, group: Any = None) -> dict[str, Any]:
    """The optimizer state in the form ``state_dict_type`` selects: full
    (``FullOptimStateDictConfig(rank0_only, offload_to_cpu)``) or sharded."""
    _check_group(group, "optim_state_dict")
    settings = _settings(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    if optim_state_dict is not None:
        named = _named(optim_state_dict, model, optim)
    else:
        named = _live_named_state(model, optim, init_fresh=not full)
    if not full:
        return named
    config = settings.optim_state_dict_config
    return sd.gather_full_state(named, rank0_only=getattr(config, "rank0_only", False),
                                cpu_offload=getattr(config, "offload_to_cpu", True))


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                             is_named_optimizer: bool = False, load_directly: bool = False,
                             group: Any = None) -> dict[str, Any]:
    """An optimizer state dict from :func:`optim_state_dict` (full or sharded,
    any world size) -> ``optim.load_state_dict``'s form for this model.

    Under ``FULL_STATE_DICT`` with ``rank0_only``, only rank 0's dict is read
    and broadcast.  The older argument order ``(optim_state_dict, model,
    optim)`` is accepted too.
    """
    if isinstance(model, dict) and isinstance(optim, nn.Module):
        model, optim, optim_state_dict = optim, optim_state_dict, model  # type: ignore[assignment]
    _check_group(group, "optim_state_dict_to_load")
    if is_named_optimizer:
        mapping.warn_once("is_named_optimizer", "is_named_optimizer=True: shardkit treats the optimizer as a "
                          "torch.optim.Optimizer")
    settings = _settings(model)
    rank0_only = getattr(settings.optim_state_dict_config, "rank0_only", False)
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT and rank0_only:
        result = _shard_full(optim_state_dict, model, optim, None, broadcast=True)
    else:
        result = flatten_sharded_optim_state_dict(optim_state_dict, model, optim)
    if load_directly:
        optim.load_state_dict(result)
    return result
