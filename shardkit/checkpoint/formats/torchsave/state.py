"""What the object in a torch.save file means as a shardkit state dict.

A torch.save file holds whatever its author saved.  :func:`flatten_state`
turns the common shapes of it into shardkit's flattened keys (the keys
``shardkit.checkpoint.save`` gives the same state, so files diff and load
alike):

* ``{"model": ..., "optim": ...}`` (shardkit's own) as it is; the classic
  spellings ``model_state_dict`` and ``optimizer``/``optimizer_state_dict``
  are read as ``model`` and ``optim``; an optimizer state dict saved alone
  goes under ``optim``; anything else is a bare model state dict.
* An optimizer state from torch's ``optimizer.state_dict()`` keys its state
  by parameter *number*: ``param_groups`` list the numbers, group by group, in
  the order the optimizer was given the parameters.  Those numbers are named
  with parameter FQNs (:func:`name_optimizer_ids`) so the state lands at
  ``optim.state.<fqn>.<name>`` with ``optim.param_groups`` listing FQNs, as a
  native checkpoint holds it and ``shardkit.checkpoint.load`` fills an
  optimizer from it.
* A file unpickled with ``trust_pickle=True`` may hold objects that are
  neither tensors nor JSON values (an ``argparse.Namespace`` of the run's
  arguments): they are left out, each with a note, rather than failing the
  whole conversion.

Naming the numbers.  The names come from ``model_keys`` when given (the FQNs
in ``model.named_parameters()`` order), else from the file's model state dict,
*assuming* its order is ``named_parameters()`` order with buffers left out:
``state_dict()`` lists each module's parameters, then its buffers, module by
module, exactly as ``named_parameters()`` walks them, and a tied weight
(stored under two names, one storage) counts once, under its first name.
Integer tensors (``num_batches_tracked``) are never parameters an optimizer
updates, so they are skipped; floating buffers (``running_mean``) cannot be
told from parameters in a file, and neither can parameters that were left out
of the optimizer.  So the names are used only when their count equals the
number of parameters the param groups list, and every state tensor that has
its parameter's shape in torch's optimizers (``exp_avg``, ``momentum_buffer``,
...) must have the shape of the parameter it is mapped to; otherwise the
numbers cannot be named, and the reason is given.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shardkit.checkpoint.state.tree import flatten, to_json_value
from shardkit.errors import ConfigurationError, IncompatibleStateDict, UnsupportedFormat

__all__ = ["TorchState", "flatten_state", "name_optimizer_ids", "read_model_keys", "UNNAMED_HINT"]

_ALIASES = {"model_state_dict": "model", "optimizer": "optim", "optimizer_state_dict": "optim"}
# state that has its parameter's shape in torch.optim (Adam/AdamW/NAdam/RAdam/Adamax, SGD, RMSprop, Adagrad,
# Adadelta, ASGD, Rprop); factored states (Adafactor's row/col variances) have other shapes and are not checked
_PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer", "square_avg", "grad_avg",
                 "acc_delta", "sum", "ax", "prev", "step_size")
UNNAMED_HINT = ("pass --model-keys FILE (the names in model.named_parameters() order, one per line or a JSON list; "
                "model_keys= in Python), or --model-only to leave the optimizer state out")
_DROP = object()


@dataclass
class TorchState:
    """A torch.save file's object, flattened: tensors and JSON-encoded values by key, and notes on what
    was left out."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    notes: list[str]


def flatten_state(obj: Any, where: str, *, model_keys: Sequence[str] | None = None, need_names: bool = False,
                  trusted: bool = False) -> TorchState:
    """Nested state -> flattened tensors and values (keys joined by ``.``), see :class:`TorchState`.

    ``need_names``: numbered optimizer state that cannot be named raises
    instead of keeping the numbers as keys (``optim.state.0.exp_avg``), which
    is what ``inspect`` shows and what no optimizer can load.  ``trusted``:
    leave out (with a note) what is neither a tensor nor a JSON value.
    Non-finite floats use flatten's ``{"$float": ...}`` form.
    """
    if not isinstance(obj, dict):
        raise UnsupportedFormat(f"{where}: holds a {type(obj).__name__}, not a state dict")
    placed = _placed(obj)
    optim = placed.get("optim")
    if isinstance(optim, dict):
        model = placed.get("model") if isinstance(placed.get("model"), dict) else None
        placed = {**placed, "optim": name_optimizer_ids(optim, model, model_keys, where, required=need_names)}
    elif model_keys is not None:
        raise ConfigurationError(f"{where}: --model-keys names optimizer parameters, but the file holds no "
                                 "optimizer state")
    notes: list[str] = []
    try:
        flat = flatten(_plain(placed, "", notes if trusted else None))
    except ConfigurationError as exc:
        raise UnsupportedFormat(f"{where}: {exc}") from None
    return TorchState(flat.tensors, flat.values, notes)


def _placed(obj: dict) -> dict:
    """Read classic top-level names as shardkit's, and nest a top level that is neither under the name it
    stands for (an optimizer state dict saved alone under ``optim.``, so it is never exported or cast as
    model weights; anything else under ``model.``)."""
    rename = {}
    for alias, name in _ALIASES.items():
        if name not in obj and name not in rename.values() and _looks_like(obj.get(alias), name):
            rename[alias] = name
    obj = {rename.get(k, k): v for k, v in obj.items()}
    if any(isinstance(obj.get(k), dict) for k in ("model", "optim")):
        return obj
    if _looks_like(obj, "optim"):
        return {"optim": obj}
    return {"model": obj}


def _looks_like(value: Any, name: str) -> bool:
    if name == "model":
        return isinstance(value, dict)
    return (isinstance(value, dict) and isinstance(value.get("state"), dict)
            and isinstance(value.get("param_groups"), (list, tuple)))


def _plain(value: Any, key: str, dropped: list[str] | None) -> Any:
    """Dict keys as strings (torch's own optimizer state is keyed by int) and tuples as lists, so that
    flatten can walk what ``torch.load`` returns; JSON has neither int keys nor tuples anyway.  With
    ``dropped`` (a trusted file), what is neither a tensor nor JSON is left out and named there."""
    if isinstance(value, dict):
        out = {str(k): _plain(v, f"{key}.{k}" if key else str(k), dropped) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not _DROP}
    if isinstance(value, (list, tuple)):
        out = [_plain(v, f"{key}.{i}", dropped) for i, v in enumerate(value)]
        return [v for v in out if v is not _DROP]
    if _is_dtensor(value):
        return _whole_tensor(value, key)
    if dropped is not None and not isinstance(value, torch.Tensor):
        try:
            to_json_value(value, key)
        except ConfigurationError:
            dropped.append(f"{key}: a {type(value).__module__}.{type(value).__qualname__}, neither a tensor nor "
                           "a JSON value")
            return _DROP
    return value


def _is_dtensor(value: Any) -> bool:
    """A ``DTensor`` (only a trusted file can hold one: its class is outside torch's allowlist), told by its
    interface so that reading a plain file never imports ``torch.distributed``."""
    return isinstance(value, torch.Tensor) and hasattr(value, "placements") and hasattr(value, "to_local")


def _whole_tensor(value: Any, key: str) -> torch.Tensor:
    """The tensor a pickled ``DTensor`` stands for, when its local part is all of it (a mesh of one rank, or
    replicated); a shard is one rank's part of a checkpoint that other files complete, so it is refused
    rather than read as if it were the whole tensor."""
    local = value.to_local()
    if tuple(local.shape) != tuple(value.shape):
        raise ConfigurationError(f"{key}: a DTensor holding one rank's part ({tuple(local.shape)} of "
                                f"{tuple(value.shape)}, placements {list(map(str, value.placements))}): this file is "
                                "one rank's share of a sharded checkpoint; open the folder that holds every rank's "
                                "file instead (a DCP or torch_checkpointing step folder)")
    return local.detach()


def _is_number(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def name_optimizer_ids(osd: dict, model: dict | None, model_keys: Sequence[str] | None, where: str, *,
                       required: bool) -> dict:
    """``osd`` with parameter numbers replaced by FQNs (see the module docstring for where names come
    from and what is checked); ``osd`` itself when it is keyed by name already, or when the numbers
    cannot be named and ``required`` is False."""
    state, groups = osd.get("state"), osd.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, (list, tuple)):
        return osd
    ids = [p for g in groups if isinstance(g, dict) for p in g.get("params", ())]
    if not any(_is_number(p) for p in ids) and not any(_is_number(k) for k in state):
        if model_keys is not None:
            raise ConfigurationError(f"{where}: --model-keys names numbered optimizer parameters, but the "
                                     "optimizer state is keyed by name already")
        return osd
    try:
        names = _names_for(ids, state, model, model_keys)
    except _Unnamed as exc:
        if not required:
            return osd
        kind = IncompatibleStateDict if exc.mismatch else UnsupportedFormat
        raise kind(f"{where}: the optimizer state is keyed by parameter number (torch's optimizer.state_dict()) "
                   f"and the numbers cannot be named: {exc}; {UNNAMED_HINT}") from None
    named = dict(zip(ids, names))
    return {**osd, "state": {named[k]: v for k, v in state.items()},
            "param_groups": [{**g, "params": [named[p] for p in g.get("params", ())]} for g in groups]}


class _Unnamed(Exception):
    """Why numbered optimizer state cannot be named (``mismatch``: a shape says the names are wrong)."""

    def __init__(self, why: str, mismatch: bool = False) -> None:
        super().__init__(why)
        self.mismatch = mismatch


def _names_for(ids: list, state: dict, model: dict | None, model_keys: Sequence[str] | None) -> list[str]:
    if not all(_is_number(p) for p in ids) or len(set(ids)) != len(ids):
        raise _Unnamed("the param groups do not list distinct parameter numbers")
    listed = set(ids)
    stray = [k for k in state if k not in listed]
    if stray:
        raise _Unnamed(f"the state holds parameter {stray[0]!r}, which no param group lists")
    params = _model_params(model) if model is not None else {}
    if model_keys is not None:
        names, source = [_as_param(n, params) for n in model_keys], "--model-keys lists"
        unknown = [n for n in names if params and n not in params]
        if unknown:
            raise _Unnamed(f"--model-keys names {unknown[0]!r}, which the file's model state dict does not hold")
        if len(set(names)) != len(names):
            raise _Unnamed("--model-keys lists a name twice")
    elif model is None:
        raise _Unnamed("the file holds no model state dict to take the names from")
    else:
        names, source = list(params), "the model state dict holds"
    if len(names) != len(ids):
        what = "names" if model_keys is not None else ("floating tensors (buffers such as running_mean, or "
                                                       "parameters left out of the optimizer, cannot be told "
                                                       "apart in a file)")
        raise _Unnamed(f"the param groups list {len(ids)} parameters, {source} {len(names)} {what}")
    for number, name in zip(ids, names):
        param = params.get(name)
        for key, value in (state.get(number) or {}).items():
            if (param is not None and key in _PARAM_SHAPED and isinstance(value, torch.Tensor)
                    and tuple(value.shape) != tuple(param.shape)):
                raise _Unnamed(f"parameter {number}'s {key} is {tuple(value.shape)}, but {name!r}, the name in "
                               f"its place, is {tuple(param.shape)}", mismatch=True)
    return names


def _as_param(name: str, params: dict[str, torch.Tensor]) -> str:
    """A ``--model-keys`` name as the file's model names it (shardkit's ``model.`` prefix dropped)."""
    if name not in params and name.startswith("model.") and name[len("model."):] in params:
        return name[len("model."):]
    return name


def _model_params(model: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model state dict's floating tensors in order, a tied weight (one storage, two names) once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for key, value in model.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            for k, v in _model_params(value, f"{name}.").items():
                out.setdefault(k, v)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            storage = value.untyped_storage()  # tied: the same bytes of the same storage (an empty one ties nothing)
            view = ((storage.data_ptr(), value.storage_offset(), tuple(value.shape), value.stride())
                    if storage.nbytes() else (id(value),))
            if view not in seen:
                seen.add(view)
                out[name] = value
    return out


def read_model_keys(path: str) -> list[str]:
    """Parameter names from a ``--model-keys`` file: a JSON list of strings, or one name per line."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigurationError(f"--model-keys {path}: cannot read it ({exc.strerror or exc})") from None
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except ValueError as exc:
            raise ConfigurationError(f"--model-keys {path}: not a JSON list ({exc})") from None
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ConfigurationError(f"--model-keys {path}: the JSON list must hold parameter names (strings)")
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise ConfigurationError(f"--model-keys {path}: holds no names")
    return names
