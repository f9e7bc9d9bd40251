"""What the object in a torch.save file means as a shardkit state dict.

A torch.save file holds whatever its author saved.  :func:`flatten_state`
turns it into shardkit's flattened keys (the keys ``shardkit.checkpoint.save``
gives the same state, so files diff and load alike); :func:`_placed` decides
where its top level goes.  A file unpickled with ``trust_pickle=True`` may hold
objects that are neither tensors nor JSON values (an ``argparse.Namespace`` of
the run's arguments): they are left out, each with a note, rather than failing
the whole conversion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardkit.checkpoint.flatten import flatten, to_json_value
from shardkit.errors import ConfigurationError, UnsupportedFormat

__all__ = ["TorchState", "flatten_state"]

_DROP = object()


@dataclass
class TorchState:
    """A torch.save file's object, flattened: tensors and JSON-encoded values by key, and notes on what
    was left out."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    notes: list[str]


def flatten_state(obj: Any, where: str, *, trusted: bool = False) -> TorchState:
    """Nested state -> flattened tensors and values (keys joined by ``.``), see :class:`TorchState`.

    ``trusted``: leave out (with a note) what is neither a tensor nor a JSON
    value.  Non-finite floats use flatten's ``{"$float": ...}`` form.
    """
    if not isinstance(obj, dict):
        raise UnsupportedFormat(f"{where}: holds a {type(obj).__name__}, not a state dict")
    notes: list[str] = []
    try:
        flat = flatten(_plain(_placed(obj), "", notes if trusted else None))
    except ConfigurationError as exc:
        raise UnsupportedFormat(f"{where}: {exc}") from None
    return TorchState(flat.tensors, flat.values, notes)


def _placed(obj: dict) -> dict:
    """Nest a top level that is not ``{"model": ..., "optim": ...}`` under the name it stands for.

    An optimizer state dict (``state`` + ``param_groups``, e.g. FSDP1's
    ``full_optim_state_dict`` saved alone) goes under ``optim.`` so it is never
    exported or cast as model weights; anything else is a bare model state dict.
    """
    if any(isinstance(obj.get(k), dict) for k in ("model", "optim")):
        return obj
    if isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), (list, tuple)):
        return {"optim": obj}
    return {"model": obj}


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
    if dropped is not None and not isinstance(value, torch.Tensor):
        try:
            to_json_value(value, key)
        except ConfigurationError:
            dropped.append(f"{key}: a {type(value).__module__}.{type(value).__qualname__}, neither a tensor nor "
                           "a JSON value")
            return _DROP
    return value
