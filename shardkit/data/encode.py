"""Arbitrary ``state_dict()`` values <-> JSON text plus tensors, losslessly, without pickle.

Why not store a user object's state as nested checkpoint keys: the checkpoint
flattens nested dicts into dotted keys, which loses an empty dict, a key
containing a dot, an int key (``{0: ...}``), a tuple and a NaN -- all common
in the ``state_dict()`` of schedulers and loaders.  An object's state is
therefore stored as one JSON text (a single string value) plus its tensors
under ``tensors.<i>``, and comes back exactly as it was.

The JSON text is plain JSON with a few tagged objects, so it stays readable
and any language can decode it:

==============================  ===============================================
``{"$tensor": i}``              the ``i``-th tensor (``tensors.<i>``)
``{"$float": "nan"}``           ``nan``, ``inf`` or ``-inf`` (:mod:`shardkit.wire.json_values`)
``{"$tuple": [...]}``           a tuple
``{"$items": [[k, v], ...]}``   a dict whose keys are not all strings, or has a key starting with ``$``
==============================  ===============================================

Anything else (a numpy array, a custom object, a DTensor) raises
:class:`DataStateError` naming where it sits, because it could not be loaded
back without pickle.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from shardkit.errors import DataStateError
from shardkit.wire.json_values import FLOAT_TAG, encode_scalar, is_json_scalar

__all__ = ["encode_tree", "decode_tree", "encode_state", "decode_state"]


def encode_tree(value: Any, where: str) -> tuple[Any, list[torch.Tensor]]:
    """``value`` as a JSON-able tree with tensors replaced by ``{"$tensor": i}``, and the tensors."""
    tensors: list[torch.Tensor] = []

    def enc(v: Any, path: str) -> Any:
        if is_json_scalar(v):
            return encode_scalar(v)
        if isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
                raise DataStateError(f"{path}: a {type(v).__name__} cannot be stored as input state; store a plain "
                                     f"tensor (e.g. .full_tensor() or .to_local())")
            if v.layout != torch.strided:
                raise DataStateError(f"{path}: a {v.layout} tensor cannot be stored; convert it to a dense tensor")
            tensors.append(v.detach())
            return {"$tensor": len(tensors) - 1}
        if isinstance(v, tuple):
            return {"$tuple": [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: enc(x, f"{path}.{k}") for k, x in v.items()}
            return {"$items": [[enc(k, f"{path} key {k!r}"), enc(x, f"{path}[{k!r}]")] for k, x in v.items()]}
        raise DataStateError(
            f"{path} holds a {type(v).__module__}.{type(v).__qualname__}, which cannot be stored without pickle; "
            f"make state_dict() return tensors and JSON types (None, bool, int, float, str, list, tuple, dict)")

    return enc(value, where), tensors


def decode_tree(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`encode_tree`."""
    if isinstance(tree, list):
        return [decode_tree(x, tensors) for x in tree]
    if isinstance(tree, dict):
        if len(tree) == 1:
            (tag, inner), = tree.items()
            if tag == "$tensor":
                return tensors[inner]
            if tag == FLOAT_TAG:
                return float(inner)
            if tag == "$tuple":
                return tuple(decode_tree(x, tensors) for x in inner)
            if tag == "$items":
                return {_hashable(decode_tree(k, tensors)): decode_tree(v, tensors) for k, v in inner}
        return {k: decode_tree(v, tensors) for k, v in tree.items()}
    return tree


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def encode_state(value: Any, where: str) -> dict[str, Any]:
    """``value`` as checkpoint-ready ``{"json": str, "tensors": {"0": tensor, ...}}``.

    ``tensors`` is left out when there are none (an empty dict would vanish
    when the checkpoint flattens it anyway).
    """
    tree, tensors = encode_tree(value, where)
    out: dict[str, Any] = {"json": json.dumps(tree, allow_nan=False, separators=(",", ":"))}
    if tensors:
        out["tensors"] = {str(i): t for i, t in enumerate(tensors)}
    return out


def decode_state(stored: Any, where: str) -> Any:
    """Inverse of :func:`encode_state`; :class:`DataStateError` naming ``where`` if malformed."""
    if not isinstance(stored, dict) or not isinstance(stored.get("json"), str):
        raise DataStateError(f"{where}: expected {{'json': str, 'tensors': {{...}}}}, got {_describe(stored)}")
    by_index = stored.get("tensors") or {}
    try:
        tensors = [by_index[str(i)] for i in range(len(by_index))]
        return decode_tree(json.loads(stored["json"]), tensors)
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise DataStateError(f"{where}: stored state is malformed ({exc})") from exc


def _describe(value: Any) -> str:
    return f"{type(value).__name__} with keys {sorted(value)}" if isinstance(value, dict) else type(value).__name__

