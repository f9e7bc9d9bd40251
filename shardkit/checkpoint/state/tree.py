"""Nested state dicts <-> flat keys, and the JSON allowlist for non-tensor values.

A state dict is nested dicts (and lists) whose leaves are tensors or plain
values.  The checkpoint stores it flat: keys join the path with ``.``
(``model.layers.0.w.weight``, ``optim.state.layers.0.w.weight.exp_avg``,
``optim.param_groups``).  Every dict is walked (an empty one contributes no
key); a list is a leaf value unless it holds tensors, in which case it is
walked with its indices as path parts.

Non-tensor leaves must be JSON: ``None``, ``bool``, ``int``, ``float``, ``str``,
and lists/tuples/str-keyed dicts of those.  Non-finite floats, which JSON
cannot spell, are stored as ``{"$float": "nan" | "inf" | "-inf"}`` (:mod:`shardkit.wire.json_values`).  Anything
else (a torch.dtype, an object) raises :class:`ConfigurationError` naming the
key: we refuse to save what we could not load without pickle.

Loading writes values back with :func:`restore_like`, which re-creates tuples
where the target had tuples (JSON has only lists), so ``betas=(0.9, 0.999)``
comes back as a tuple.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from shardkit.errors import ConfigurationError, IncompatibleStateDict
from shardkit.wire.json_values import FLOAT_TAG, encode_scalar, is_json_scalar, is_tagged_float

__all__ = ["has_tensor", "keep_keys", "object_path", "Flat", "walk", "flatten", "plain_values", "to_json_value",
           "from_json_value", "restore_like"]


@dataclass
class Flat:
    """A flattened state dict: tensors and values by key, and where each value lives."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]              # JSON-encoded
    slots: dict[str, tuple[Any, Any]]   # key -> (container, index) of every value, for writing back

    def set_value(self, key: str, decoded: Any) -> None:
        container, index = self.slots[key]
        container[index] = restore_like(decoded, container[index])


def has_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or holds one in its dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_tensor(v) for v in value)
    return False


def walk(tree: Any, descend: Callable[[str, Any], bool], prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """``(path, container, key, value)`` of every leaf below ``tree`` (a dict or a list), depth first, in order.

    The one walker of nested state: paths join dict keys and list indices with
    ``.`` below ``prefix``.  ``descend(path, value)`` is asked of each entry in
    turn and says whether it is walked into (a dict or a list) or is a leaf;
    that is the one rule the readers of nested state differ in (a list of
    numbers is a value to :func:`flatten`, DCP flattens a list of dicts, a
    relayout walks every list), so it is theirs to give.
    """
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        path = f"{prefix}.{key}" if prefix else str(key)
        if descend(path, value):
            yield from walk(value, descend, path)
        else:
            yield path, tree, key, value


def _walked_by_flatten(path: str, value: Any) -> bool:
    """:func:`flatten`'s rule: every dict is walked, a list only when it holds tensors (else it is a value)."""
    if isinstance(value, dict):
        _check_keys(value, path)
        return True
    if isinstance(value, (list, tuple)) and has_tensor(value):
        if isinstance(value, tuple):
            raise ConfigurationError(f"{path!r}: tensors inside a tuple cannot be loaded in place; use a list")
        return True
    return False


def _check_keys(tree: dict, path: str) -> None:
    for k in tree:
        if not isinstance(k, str):
            raise ConfigurationError(f"state dict key {k!r} under {path or '<root>'!r} is not a string")


def flatten(state_dict: dict[str, Any]) -> Flat:
    """Flatten ``state_dict``; raise on key collisions and on values JSON cannot hold."""
    if not isinstance(state_dict, dict):
        raise ConfigurationError(f"a state dict must be a dict, got {type(state_dict).__name__}")
    flat = Flat({}, {}, {})

    def add(key: str, table: dict, value: Any) -> None:
        if key in flat.tensors or key in flat.values:
            raise ConfigurationError(f"two entries of the state dict flatten to the same key {key!r}; rename one")
        table[key] = value

    _check_keys(state_dict, "")
    for key, container, index, value in walk(state_dict, _walked_by_flatten):
        if isinstance(value, torch.Tensor):
            add(key, flat.tensors, value)
        else:
            add(key, flat.values, to_json_value(value, key))
            flat.slots[key] = (container, index)
    return flat


def plain_values(prefix: str, state: Any) -> dict[str, Any]:
    """``state`` (a dict of JSON values, e.g. an LR scheduler's ``state_dict()``) as flat values under
    ``prefix``; raises :class:`ConfigurationError` saying why when it holds tensors or other objects."""
    flat = flatten({prefix: state})
    if flat.tensors:
        raise ConfigurationError(f"{prefix!r} holds tensors ({', '.join(sorted(flat.tensors)[:3])})")
    return flat.values


def to_json_value(value: Any, key: str) -> Any:
    """``value`` as JSON types, or :class:`ConfigurationError` naming ``key``."""
    if is_json_scalar(value):
        return encode_scalar(value)
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigurationError(f"{key!r}: dict key {k!r} is not a string; JSON values need string keys")
            out[k] = to_json_value(v, f"{key}.{k}")
        return out
    kind = type(value).__name__
    raise ConfigurationError(f"{key!r} holds {'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}, which a "
                             f"checkpoint cannot store without pickle; {_where_it_can_go(key)}")


# the metadata a save carries beside the state dict (CheckpointManager.save's ``extra=``, save's ``meta=``):
# JSON only, so a tensor there has to move, not just change type
_METADATA_ROOTS = ("extra", "meta")


def _where_it_can_go(key: str) -> str:
    """What to do with a value :func:`to_json_value` cannot encode, said for where it was found."""
    root = re.split(r"[.\[]", key, maxsplit=1)[0]
    if root in _METADATA_ROOTS:
        return (f"{root} holds JSON types only (None, bool, int, float, str, list, dict): put tensors in the "
                "state dict you save, or pass the object that owns them as CheckpointManager.save(..., "
                "stateful={'name': Stateful(obj)}), whose state_dict() may hold tensors")
    return "store it as a tensor in the state dict, or as JSON types (None, bool, int, float, str, list, dict)"


def from_json_value(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json_value(v) for v in value]
    if isinstance(value, dict):
        if is_tagged_float(value):
            return float(value[FLOAT_TAG])
        return {k: from_json_value(v) for k, v in value.items()}
    return value


def restore_like(loaded: Any, like: Any) -> Any:
    """``loaded`` (decoded JSON) with tuples where ``like`` had tuples."""
    if isinstance(like, tuple) and isinstance(loaded, list) and len(like) == len(loaded):
        return tuple(restore_like(a, b) for a, b in zip(loaded, like))
    if isinstance(like, list) and isinstance(loaded, list) and len(like) == len(loaded):
        return [restore_like(a, b) for a, b in zip(loaded, like)]
    if isinstance(like, dict) and isinstance(loaded, dict):
        return {k: restore_like(v, like[k]) if k in like else v for k, v in loaded.items()}
    return loaded


def check_value_kind(key: str, in_checkpoint_as_tensor: bool, target_is_tensor: bool) -> None:
    if in_checkpoint_as_tensor != target_is_tensor:
        raise IncompatibleStateDict(
            f"{key!r} is a {'tensor' if in_checkpoint_as_tensor else 'non-tensor value'} in the checkpoint but a "
            f"{'tensor' if target_is_tensor else 'non-tensor value'} in the target state dict")


def object_path(fqn: str) -> tuple[str | int, ...]:
    """The nested path of a flattened key: ``model.<param>``, ``optim.state.<param>.<name>``.

    Flattened keys are unambiguous only with this rule, because parameter names
    themselves contain dots.  torch.save and DCP outputs nest by it.
    """
    parts = fqn.split(".")
    if parts[0] == "model" and len(parts) > 1:
        return ("model", ".".join(parts[1:]))
    if parts[:2] == ["optim", "state"] and len(parts) > 3:
        return ("optim", "state", ".".join(parts[2:-1]), parts[-1])
    if parts[:2] == ["optim", "param_groups"] and len(parts) > 3:
        return ("optim", "param_groups", int(parts[2]) if parts[2].isdigit() else parts[2], ".".join(parts[3:]))
    if len(parts) > 1 and parts[0] == "optim":
        return ("optim", ".".join(parts[1:]))
    return (fqn,)


def keep_keys(flat: Flat, only: Sequence[str] | None = None, exclude: Sequence[str] | None = None) -> Flat:
    """``flat`` with the keys that match a glob of ``only`` (all when ``None``) and none of ``exclude``.

    A selection that keeps nothing is refused: a save of nothing would commit
    an empty checkpoint that reports success.
    """
    if not only and not exclude:
        return flat

    def kept(key: str) -> bool:
        return ((not only or any(fnmatch.fnmatchcase(key, g) for g in only))
                and not (exclude and any(fnmatch.fnmatchcase(key, g) for g in exclude)))

    out = Flat({k: v for k, v in flat.tensors.items() if kept(k)}, {k: v for k, v in flat.values.items() if kept(k)},
               {k: v for k, v in flat.slots.items() if kept(k)})
    if not out.tensors and not out.values:
        raise ConfigurationError(f"only={list(only or [])}, exclude={list(exclude or [])} keep no key of the state "
                                 f"dict; nothing to save")
    return out
