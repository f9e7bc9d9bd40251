"""What the object in a torch.save file means as a shardkit state dict.

A torch.save file holds whatever its author saved.  :func:`flatten_state`
turns it into shardkit's flattened keys (the keys ``shardkit.checkpoint.save``
gives the same state, so files diff and load alike); :func:`_placed` decides
where its top level goes.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit.checkpoint.flatten import flatten
from shardkit.errors import ConfigurationError, UnsupportedFormat

__all__ = ["flatten_state"]


def flatten_state(obj: Any, where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Nested state dict -> (flattened tensors, JSON-encoded values), keys joined by ``.``.

    The keys are the ones ``shardkit.checkpoint.save`` gives the same state dict
    (:func:`~shardkit.checkpoint.flatten.flatten`), so a torch.save file and a
    native checkpoint of one model can be diffed and loaded alike.  Non-finite
    floats (a ``best_loss`` of ``inf``) use flatten's ``{"$float": ...}`` form.
    Where the top level is placed is decided by :func:`_placed`.
    """
    if not isinstance(obj, dict):
        raise UnsupportedFormat(f"{where}: holds a {type(obj).__name__}, not a state dict")
    try:
        flat = flatten(_plain(_placed(obj)))
    except ConfigurationError as exc:
        raise UnsupportedFormat(f"{where}: {exc}") from None
    return flat.tensors, flat.values


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


def _plain(value: Any) -> Any:
    """Dict keys as strings (torch's own optimizer state is keyed by int) and tuples as lists, so that
    flatten can walk what ``torch.load`` returns; JSON has neither int keys nor tuples anyway."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
