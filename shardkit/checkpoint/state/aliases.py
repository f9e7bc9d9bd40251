"""Tied tensors: two keys of a state dict that are one tensor.

A model whose output head shares the input embedding (GPT-2, Llama-3.2:
``lm_head.weight`` *is* ``embed_tokens.weight``) lists the one Parameter
under both names in ``model.state_dict()``.  A checkpoint stores the data
once and records the second name as an *alias* of the first (the manifest's
``aliases``, docs/format.md); a load fills both names from the one stored
tensor, and a missing key of a tied target counts as present when the key it
is tied to is in the checkpoint.

"The same tensor" is decided from the tensors alone, never from the runtime:
the same storage (by identity, so two empty shards of different parameters
never look alike), the same offset, shape, strides and dtype of the local
data, and for a DTensor the same global shape and placements.  Each rank
decides from its own shards; ``state_dict()`` hands every rank the same
Parameter under the same names, so ranks agree (a save checks that they do).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from shardkit.checkpoint.geometry.boxes import is_dtensor, local_tensor

__all__ = ["find_aliases", "alias_groups"]


def _view_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    local = local_tensor(tensor)
    spec: tuple[Any, ...] = ()
    if is_dtensor(tensor):
        spec = (tuple(tensor.shape), tuple(str(p) for p in tensor.placements), id(tensor.device_mesh))
    return (local.dtype, local.device, local.storage_offset(), tuple(local.shape), tuple(local.stride())) + spec


def find_aliases(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: key}`` for every key whose tensor is the same tensor as an earlier key's.

    The earlier key (in ``tensors``' order, i.e. module registration order:
    the embedding before the head) holds the data; later ones alias it.
    """
    first: dict[tuple[Any, ...], str] = {}
    storages: dict[int, Any] = {}  # keeps each storage alive so its id is not reused while we look
    aliases: dict[str, str] = {}
    for key, tensor in tensors.items():
        if tensor.layout != torch.strided:  # sparse tensors: not stored by this format anyway
            continue
        storage = local_tensor(tensor).untyped_storage()  # one Python object per storage (identity)
        storages.setdefault(id(storage), storage)
        view = (id(storage),) + _view_key(tensor)
        owner = first.setdefault(view, key)
        if owner != key:
            aliases[key] = owner
    return aliases


def alias_groups(aliases: Mapping[str, str]) -> dict[str, list[str]]:
    """Every key of a tied group -> the whole group, the key holding the data first."""
    groups: dict[str, list[str]] = {}
    for alias, target in aliases.items():
        groups.setdefault(target, [target]).append(alias)
    return {key: group for group in groups.values() for key in group}
