"""The hot save's view of the state (:class:`~.copies.LocalState`), derived once per layout and reused.

Why: the hot tier saves every step, and every step hands it the same model and optimizer -- the same tensor
objects under the same keys.  Flattening the state dict into keys, taking each tensor's local shard and
digesting the structure (dtypes, shapes, placements, meshes) cost a few microseconds per tensor: at a few
hundred tensors, milliseconds of every step's blocking time, to find what the last step found.

What is checked at every save, so that a changed state never reuses a stale view:

* the **skeleton** of the state dict -- every dict's keys in order, every list walked into and its length,
  whether each leaf is a tensor -- equal to the last one (then :func:`~shardkit.checkpoint.state.tree.flatten`
  would give the same keys in the same order);
* every tensor leaf of the **same layout** as last time: its local shard's dtype, shape and device, and a
  DTensor's sharding spec (mesh, placements, global shape and dtype) -- all the structure digest
  covers, so the digest found last time is this state's too; the tensors themselves are this call's.

The values (learning rates, step counters kept as numbers, ...) are read and encoded afresh at every save.
Anything else -- a first save, a changed skeleton, one tensor that differs -- takes the full path
(:func:`~.copies.local_state`), whose result becomes the one reused next.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.checkpoint.geometry.boxes import is_dtensor, local_tensor
from shardkit.checkpoint.state.tree import Flat, has_tensor, to_json_value
from shardkit.checkpoint.training.hot.copies import LocalState, local_state
from shardkit.checkpoint.training.input_state import INPUT_KEYS

__all__ = ["LayoutCache"]


@dataclass
class _Layout:
    """What the last full derivation found, and what must match for it to be reused."""

    skeleton: list[Any]
    layouts: list[tuple[Any, ...]]  # each tensor leaf's layout, in walk order (:func:`_shard_and_layout`)
    tensor_keys: list[str]
    value_keys: list[str]
    structure: str


def _shard_and_layout(t: torch.Tensor, dtensor: type | None) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """``t``'s local shard, and what :func:`~.copies.structure_of` digests of it: the shard's dtype, shape and
    device, and a DTensor's sharding spec (mesh, placements, global shape and dtype: the spec object a detached
    view shares with its parameter, so it compares by identity first).  ``dtensor``: the DTensor class, when
    imported (a type check costs a fraction of ``isinstance``'s against it, which is paid per tensor)."""
    if dtensor is not None and (type(t) is dtensor or is_dtensor(t)):
        shard = local_tensor(t)
        return shard, (shard.dtype, shard.shape, shard.device, t._spec)
    return t, (t.dtype, t.shape, t.device, None)


def _dtensor_class() -> type | None:
    api = sys.modules.get("torch.distributed.tensor._api")
    return None if api is None else api.DTensor


def _walk(tree: Any, skeleton: list[Any], tensors: list[torch.Tensor], values: list[tuple[Any, Any, Any]]) -> None:
    """The leaves of ``tree`` in :func:`~shardkit.checkpoint.state.tree.flatten`'s order and by its rule (every
    dict walked, a list only when it holds tensors), without building a key: the skeleton records what decides
    the keys, ``values`` each value leaf as ``(container, index, value)``."""
    if isinstance(tree, dict):
        skeleton.append(tuple(tree))
        items: Any = tree.items()
    else:
        skeleton.append(len(tree))
        items = enumerate(tree)
    for key, value in items:
        if isinstance(value, torch.Tensor):
            skeleton.append("t")
            tensors.append(value)
        elif isinstance(value, dict) or (isinstance(value, list) and has_tensor(value)):
            _walk(value, skeleton, tensors, values)
        else:
            skeleton.append("x" if isinstance(value, tuple) and has_tensor(value) else "v")  # "x": flatten refuses
            values.append((tree, key, value))


class LayoutCache:
    """:func:`~.copies.local_state` for a state whose layout repeats from save to save (see the module
    docstring); one per hot tier."""

    def __init__(self) -> None:
        self._last: _Layout | None = None
        self.hits = 0  # saves that reused the last layout (for tests and logs)

    def local_state(self, state: dict[str, Any]) -> LocalState:
        """This rank's :class:`~.copies.LocalState` of ``state``, the last one's layout reused when it holds."""
        part = {k: v for k, v in state.items() if k not in INPUT_KEYS}
        inputs = {k: v for k, v in state.items() if k in INPUT_KEYS}
        skeleton: list[Any] = []
        tensors: list[torch.Tensor] = []
        values: list[tuple[Any, Any, Any]] = []
        _walk(part, skeleton, tensors, values)
        dtensor = _dtensor_class()
        found_shards = [_shard_and_layout(t, dtensor) for t in tensors]
        shards = [shard for shard, _ in found_shards]
        layouts = [layout for _, layout in found_shards]
        last = self._last
        if last is not None and skeleton == last.skeleton and layouts == last.layouts:
            self.hits += 1
            slots = {key: (container, index) for key, (container, index, _) in zip(last.value_keys, values)}
            encoded = {key: to_json_value(value, key) for key, (_, _, value) in zip(last.value_keys, values)}
            flat = Flat(dict(zip(last.tensor_keys, tensors)), encoded, slots)
            return LocalState(dict(zip(last.tensor_keys, shards)), encoded, last.structure, flat, inputs)
        found = local_state(state)
        keys = list(found.flat.tensors)
        self._last = None
        if len(keys) == len(tensors) and len(found.flat.values) == len(values) \
                and all(found.flat.tensors[k] is t for k, t in zip(keys, tensors)):
            self._last = _Layout(skeleton, layouts, keys, list(found.flat.values), found.structure)
        return found
