"""Full (unsharded) state dicts of a sharded model and optimizer, one tensor at a time.

``get_full_state_dict`` gathers each tensor in turn (to rank 0 and the CPU by
default), so no rank ever holds two full copies; ``set_full_state_dict`` cuts
each full tensor to the live layout (:func:`~shardkit.checkpoint.state.relayout.copy_into`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state.relayout import (
    copy_into,
    full_for,
    gather_full_state,
    is_json_scalar,
    leaf_paths,
    leaf_paths_with_slots,
)
from shardkit.checkpoint.state.state_dict import get_training_state, set_training_state
from shardkit.checkpoint.state.tree import restore_like
from shardkit.errors import IncompatibleStateDict

__all__ = ["get_full_state_dict", "set_full_state_dict"]


def get_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                        rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, Any]:
    """The full (unsharded) state dict, gathered one tensor at a time; ``{}`` off rank 0 when ``rank0_only``."""
    return gather_full_state(get_training_state(model, optimizer), rank0_only=rank0_only, cpu_offload=cpu_offload)


def set_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, full: dict[str, Any], *,
                        broadcast_from_rank0: bool = False, strict: bool = True) -> None:
    """Load a full state dict into a (sharded) model and optimizer, one tensor at a time.

    Every rank needs ``full`` unless ``broadcast_from_rank0``, where only rank
    0's is read and each tensor is broadcast in turn.  Keys and shapes are
    checked on every rank before any tensor is written.
    """
    dist = Dist()
    live = get_training_state(model, optimizer)
    have = {p for p, _ in leaf_paths(live)}
    problem = None
    if not broadcast_from_rank0 or dist.rank == 0:
        given = dict(leaf_paths(full))
        missing = sorted(have - set(given)) if strict else []
        unexpected = sorted(set(given) - have) if strict else []
        wrong = [p for p, v in leaf_paths(live) if isinstance(v, torch.Tensor) and p in given
                 and (not isinstance(given[p], torch.Tensor) or tuple(given[p].shape) != tuple(v.shape))]
        if missing or unexpected or wrong:
            problem = f"full state dict mismatch: missing {missing[:10]}, unexpected {unexpected[:10]}, " \
                      f"wrong shape or type {wrong[:10]}"
    if dist.any_failed(problem is not None):
        raise IncompatibleStateDict(problem or "full state dict mismatch on rank 0 (see its error)")
    given = dict(leaf_paths(full)) if (not broadcast_from_rank0 or dist.rank == 0) else {}
    for path, (container, key, like) in leaf_paths_with_slots(live):
        if isinstance(like, torch.Tensor):
            if path in given or broadcast_from_rank0:
                value = full_for(path, like, given, broadcast_from_rank0, dist)
                copy_into(like, value, path)
        elif path in given:
            container[key] = restore_like(given[path], like)
    if broadcast_from_rank0:
        values = dist.broadcast_json({p: v for p, v in given.items() if not isinstance(v, torch.Tensor)
                                      and is_json_scalar(v)} if dist.rank == 0 else None)
        for path, (container, key, like) in leaf_paths_with_slots(live):
            if not isinstance(like, torch.Tensor) and path in values:
                container[key] = restore_like(values[path], like)
    set_training_state(model, optimizer, live, strict=False)
