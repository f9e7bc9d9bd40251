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
    full_leaves_from_rank0,
    gather_full_state,
    leaf_paths,
    leaf_paths_with_slots,
)
from shardkit.checkpoint.state.training_state import get_training_state, set_training_state
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
    0's is read and each tensor is broadcast in turn and copied into the live
    tensor as it arrives (:func:`~shardkit.checkpoint.state.relayout.full_leaves_from_rank0`).
    Keys and shapes are checked on every rank before any tensor is written.
    """
    live = get_training_state(model, optimizer)
    slots = dict(leaf_paths_with_slots(live))
    have = {path: like for path, (_, _, like) in slots.items()}
    if broadcast_from_rank0:
        def refuse_mismatch(given: dict[str, Any]) -> None:
            problem = _mismatch(have, given, strict)
            if problem:
                raise IncompatibleStateDict(problem)

        given = full_leaves_from_rank0(full, have, _copy_into_live, refuse_mismatch)
    else:
        given = dict(leaf_paths(full))
        problem = _mismatch(have, given, strict)
        if Dist().any_failed(problem is not None):
            raise IncompatibleStateDict(problem or "full state dict mismatch on another rank (see its error)")
    for path, (container, key, like) in slots.items():
        if isinstance(like, torch.Tensor):
            if path in given:
                copy_into(like, given[path], path)  # a broadcast tensor already is ``like``: skipped
        elif path in given:
            container[key] = restore_like(given[path], like)
    set_training_state(model, optimizer, live, strict=False)


def _copy_into_live(path: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    copy_into(like, full, path)
    return like


def _mismatch(have: dict[str, Any], given: dict[str, Any], strict: bool) -> str | None:
    """What keeps ``given`` (leaf path -> value) from loading into the live leaves ``have``, or ``None``."""
    missing = sorted(set(have) - set(given)) if strict else []
    unexpected = sorted(set(given) - set(have)) if strict else []
    wrong = [p for p, v in have.items() if isinstance(v, torch.Tensor) and p in given
             and (not isinstance(given[p], torch.Tensor) or tuple(given[p].shape) != tuple(v.shape))]
    if missing or unexpected or wrong:
        return f"full state dict mismatch: missing {missing[:10]}, unexpected {unexpected[:10]}, " \
               f"wrong shape or type {wrong[:10]}"
    return None
