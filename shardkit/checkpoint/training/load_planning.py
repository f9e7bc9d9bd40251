"""Planning a load: :func:`plan_load`, the reads that fill every target this rank holds.

Its own module beside :mod:`~.save_planning`: which keys a load fills, which
it leaves alone, and the check that every stored tensor fits its target (keys,
dtypes, shapes) are decided here, before anything is read; ``load`` runs the
plan, with its collectives and agreements.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardkit.checkpoint.formats.base import CheckpointReader, ReadRequest, plan_reads
from shardkit.checkpoint.geometry.boxes import box_numel, local_tensor
from shardkit.checkpoint.geometry.placements import local_pieces, view
from shardkit.checkpoint.state.aliases import alias_groups, find_aliases
from shardkit.checkpoint.state.tree import Flat, check_value_kind
from shardkit.errors import IncompatibleStateDict

__all__ = ["LoadPlan", "plan_load"]


class LoadPlan(NamedTuple):
    """What a load reads (``requests`` into the targets, ``device_copies`` staged for cast targets) and
    which keys it leaves alone (``missing`` from the checkpoint, ``unexpected`` in it)."""

    requests: list[ReadRequest]
    device_copies: list[tuple[torch.Tensor, torch.Tensor]]
    missing: list[str]
    unexpected: list[str]


def plan_load(reader: CheckpointReader, flat: Flat, strict: bool, dtype_cast: bool = False) -> LoadPlan:
    """Read requests that fill every tensor of ``flat`` this rank holds, the (buffer, target) copies
    for targets read through a host buffer (``dtype_cast``), and the keys left alone.  A GPU target's
    requests point at its device memory (``load`` reads them through host rounds).

    Each target is filled piece by piece (:func:`~shardkit.checkpoint.geometry.placements.local_pieces`):
    one box for most layouts, several row ranges for a ``_StridedShard`` that holds them, each
    read straight into its view of the local tensor.  Raises before anything is read when keys,
    dtypes or shapes do not match."""
    held = {key: local_pieces(target, key) or [] for key, target in flat.tensors.items()}  # once per target
    reader.focus({key: [g for g, _ in pieces] for key, pieces in held.items()})
    entries, values = reader.tensors(), reader.values()
    stored = set(entries) | set(values)
    wanted_keys = set(flat.tensors) | set(flat.values)
    tied = alias_groups(find_aliases(flat.tensors))
    # a tied group of the target is one tensor: read the first of its keys the checkpoint holds (the others
    # then hold the same bytes), and count every key of the group as present when one of them is stored
    reads = {key: next((k for k in tied.get(key, [key]) if k in stored), None) for key in flat.tensors}
    missing = sorted(k for k in wanted_keys - stored if reads.get(k) is None)
    unexpected = sorted(stored - wanted_keys)
    if strict and (missing or unexpected):
        raise IncompatibleStateDict(
            f"{reader.info.url} does not match the state dict: missing keys {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; unexpected keys {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}. Pass strict=False to load the common keys.")
    wanted, device_copies = [], []
    for key, target in flat.tensors.items():
        if key not in stored:
            continue
        check_value_kind(key, key in entries, True)
        entry = entries[key]
        cast = entry.dtype != target.dtype
        if tuple(entry.shape) != tuple(target.shape) or (cast and not (
                dtype_cast and entry.dtype.is_floating_point and target.dtype.is_floating_point)):
            hint = " (pass dtype_cast=True to cast floating-point values)" if cast and not dtype_cast else ""
            raise IncompatibleStateDict(f"{key!r}: checkpoint holds {entry.dtype} {list(entry.shape)}, the target "
                                        f"is {target.dtype} {list(target.shape)}{hint}")
        if reads[key] != key:  # tied to a key read already: the same memory
            continue
        pieces = [p for p in held[key] if box_numel(p[0])]
        if not pieces:
            continue
        local = local_tensor(target).detach()
        if cast:  # read as stored, then copy_ (casting) into the target
            buf = torch.empty(local.shape, dtype=entry.dtype)
            device_copies.append((buf, local))
            local = buf
        # one wanted box per piece the rank holds (several for a strided shard), read into its view
        wanted.extend((key, global_box, view(local, local_box)) for global_box, local_box in pieces)
    for key in flat.values:
        if key in stored:
            check_value_kind(key, key in entries, False)
    return LoadPlan(plan_reads(reader, wanted), device_copies, missing, unexpected)
