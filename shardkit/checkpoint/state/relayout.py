"""Full <-> sharded state, one tensor at a time.

A full (unsharded) state dict is what single-process tools and the FSDP1
``FULL_STATE_DICT`` speak; a sharded one is what a training job holds.  The
conversions here never gather the whole model at once: each tensor is gathered
(one all-gather), offloaded and dropped before the next, or cut from the full
value (and, with ``broadcast_from_rank0``, broadcast first) one at a time.

Per tensor: :func:`full_to_local`, :func:`shard_full_tensor`,
:func:`relayout_like`, :func:`gather_full_tensor`.  Per tree (nested dicts/lists, e.g. an optimizer
state): :func:`gather_full_state`, :func:`shard_state`, :func:`full_leaves_from_rank0`.  For a model and
optimizer: :func:`get_full_state_dict`, :func:`set_full_state_dict`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from shardkit.checkpoint.geometry.boxes import is_dtensor, local_tensor
from shardkit.checkpoint.geometry.placements import local_pieces, view
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state.rank0_tree import broadcast_tree, is_json_value
from shardkit.checkpoint.state.tree import restore_like, walk
from shardkit.errors import IncompatibleStateDict

__all__ = ["full_to_local", "shard_full_tensor", "relayout_like", "gather_full_tensor", "gather_full_state",
           "shard_state", "full_leaves_from_rank0", "copy_into", "leaf_paths", "leaf_paths_with_slots"]


def full_to_local(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that this rank holds of ``like``: a view when the rank holds one box
    (``full`` itself for plain tensors), else a new tensor of the local shape assembled from each
    held box (a ``_StridedShard`` rank may hold several row ranges)."""
    if tuple(full.shape) != tuple(like.shape):
        raise IncompatibleStateDict(f"full tensor has shape {tuple(full.shape)}, the target {tuple(like.shape)}")
    if not is_dtensor(like):
        return full
    pieces = local_pieces(like)
    if pieces is None:
        return full
    local_shape = tuple(local_tensor(like).shape)
    if len(pieces) == 1 and pieces[0][0][1] == local_shape:
        return view(full, pieces[0][0])
    out = full.new_empty(local_shape)
    for global_box, local_box in pieces:
        view(out, local_box).copy_(view(full, global_box))
    return out


def shard_full_tensor(full: torch.Tensor, like: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new DTensor with ``like``'s mesh and placements holding ``full``'s values (no communication).

    The result's dtype is ``dtype``, by default ``like``'s: ``dtype`` lets a
    caller cut e.g. an fp32 optimizer moment like a bf16 parameter without
    allocating a template in the moment's dtype.  A plain ``like`` gives a copy
    of ``full`` (in ``dtype`` when given).  The result never shares memory with
    ``full``.
    """
    if not is_dtensor(like):
        return full.detach().to(dtype or full.dtype, copy=True)
    return _cut(full, like, dtype or like.dtype, copy=True)


def relayout_like(value: torch.Tensor, like: torch.Tensor, *, dtype: torch.dtype | None = None,
                  copy: bool = True) -> torch.Tensor:
    """``value`` laid out like ``like`` (mesh, placements, shape), in ``dtype`` (default: ``value``'s own).

    The one "re-cut a value to a target's layout" step of the project (loading
    state dicts, FSDP1 model and optimizer state): a DTensor already on
    ``like``'s mesh and placements is returned as is (cast only if ``dtype``
    differs); a DTensor laid out otherwise is gathered (``full_tensor()``, a
    collective every rank of its mesh must reach) and cut; a plain tensor is
    the full value and each rank keeps its slice (no communication).  For a
    plain ``like`` the full value is returned (a DTensor ``value`` gathered).
    The dtype is ``value``'s by default because state such as an fp32 Adam
    moment must keep it even when its parameter is bf16.

    ``copy=True`` (default) makes a cut result own its memory (it neither
    aliases a plain ``value`` nor keeps a gathered full tensor alive);
    ``copy=False`` may return a view into the full value, for callers that
    copy it on at once.  Raises :class:`~shardkit.errors.IncompatibleStateDict`
    when the shapes differ.
    """
    if tuple(value.shape) != tuple(like.shape):
        raise IncompatibleStateDict(f"cannot lay out a value of shape {tuple(value.shape)} like a tensor of "
                                    f"shape {tuple(like.shape)}")
    dtype = dtype or value.dtype
    if is_dtensor(value):
        if is_dtensor(like) and value.device_mesh == like.device_mesh \
                and tuple(value.placements) == tuple(like.placements):
            return value if value.dtype == dtype else value.to(dtype)
        value = value.full_tensor()
    if not is_dtensor(like):
        return value if value.dtype == dtype else value.to(dtype)
    return _cut(value, like, dtype, copy=copy)


def _cut(full: torch.Tensor, like: torch.Tensor, dtype: torch.dtype, *, copy: bool) -> torch.Tensor:
    """A DTensor laid out like ``like`` whose local shard is this rank's slice of ``full`` in ``dtype``."""
    from torch.distributed.tensor import DTensor

    local = full_to_local(full.detach(), like).to(device=local_tensor(like).device, dtype=dtype)
    if copy:
        shares = local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        local = local.clone(memory_format=torch.contiguous_format) if shares else local.contiguous()
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def gather_full_tensor(tensor: torch.Tensor, *, rank0_only: bool = True,
                       cpu_offload: bool = True) -> torch.Tensor | None:
    """The full value of ``tensor`` (one all-gather for a DTensor); ``None`` off rank 0 when ``rank0_only``.

    Collective for DTensors: every rank of the mesh must call it, in the same order.
    """
    full = tensor.full_tensor() if is_dtensor(tensor) else tensor.detach()
    if rank0_only and Dist().rank != 0:
        return None
    return full.cpu() if cpu_offload else full


def _copy_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_tree(v) for v in tree]
    return tree


def gather_full_state(tree: Any, *, rank0_only: bool = True, cpu_offload: bool = True) -> Any:
    """``tree`` with every tensor gathered to its full value, one tensor at a time.

    Off rank 0 with ``rank0_only`` the result is ``{}`` (the gathers still run: collective).
    """
    out = _copy_tree(tree)
    for _, container, key, value in list(walk(out, _every_dict_and_list)):
        if isinstance(value, torch.Tensor):
            container[key] = gather_full_tensor(value, rank0_only=rank0_only, cpu_offload=cpu_offload)
    if rank0_only and Dist().rank != 0:
        return {}
    return out


def shard_state(full_tree: Any, like_tree: Any, *, broadcast_from_rank0: bool = False) -> Any:
    """A copy of ``like_tree`` whose tensors hold ``full_tree``'s values, sharded like ``like_tree``.

    Each DTensor leaf of ``like_tree`` becomes a new DTensor (same mesh and
    placements) cut from the matching full tensor; plain tensors are copied.
    With ``broadcast_from_rank0`` only rank 0 needs ``full_tree``
    (:func:`full_leaves_from_rank0`; every rank must call this, in the same order).
    """
    out = _copy_tree(like_tree)
    slots = dict(leaf_paths_with_slots(out))
    if broadcast_from_rank0:
        full_leaves = full_leaves_from_rank0(full_tree, {p: like for p, (_, _, like) in slots.items()},
                                             lambda _path, full, like: shard_full_tensor(full, like))
    else:
        full_leaves = dict(leaf_paths(full_tree))
    for path, (container, key, like) in slots.items():
        if isinstance(like, torch.Tensor):
            full = full_leaves.get(path)
            if not isinstance(full, torch.Tensor):
                raise IncompatibleStateDict(f"{path!r} is missing from the full state dict")
            container[key] = full if broadcast_from_rank0 else shard_full_tensor(full, like)
        elif path in full_leaves:
            container[key] = restore_like(full_leaves[path], like)
    return out


def full_leaves_from_rank0(full_tree: Any, like_leaves: dict[str, Any],
                           cut: Callable[[str, torch.Tensor, torch.Tensor], Any],
                           check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Rank 0's leaves of ``full_tree`` (:func:`leaf_paths`) that ``like_leaves`` names, on every rank, each
    tensor as ``cut(path, full_tensor, like)`` returns it.

    The leaf-path form of :func:`~shardkit.checkpoint.state.rank0_tree.broadcast_tree`,
    which sends them: only rank 0 reads ``full_tree``, and each tensor is cut
    (e.g. to this rank's shard, or copied into the live tensor) as it arrives,
    so no rank holds two full tensors.  Before anything is sent, rank 0
    checks that every tensor of ``like_leaves`` has a full tensor of its
    shape, and runs ``check(its leaves)``: what either raises is raised on
    every rank.  A non-tensor leaf JSON cannot carry stays behind (the caller
    keeps its live value).  Collective: every rank calls it.
    """
    def rank0_leaves() -> dict[str, Any]:
        given = dict(leaf_paths(full_tree))
        for path, like in like_leaves.items():
            full = given.get(path)
            if isinstance(like, torch.Tensor) and not (isinstance(full, torch.Tensor)
                                                       and tuple(full.shape) == tuple(like.shape)):
                raise IncompatibleStateDict(f"{path!r}: rank 0's full state dict lacks it or has another shape")
        if check is not None:
            check(given)
        return {path: value for path, value in given.items() if path in like_leaves
                and (isinstance(value, torch.Tensor) or is_json_value(value))}

    return broadcast_tree(rank0_leaves, lambda path, full: cut(path[0], full, like_leaves[path[0]]))


def _every_dict_and_list(_path: str, value: Any) -> bool:
    return isinstance(value, (dict, list))


def _dicts_and_lists_of_dicts_or_tensors(_path: str, value: Any) -> bool:
    """The leaves of a state dict as torch nests it: a list of numbers (``betas``, ``params``) is one leaf."""
    return isinstance(value, dict) or (isinstance(value, list)
                                       and any(isinstance(x, (dict, torch.Tensor)) for x in value))


def leaf_paths(tree: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for path, (_, _, v) in leaf_paths_with_slots(tree, prefix):
        yield path, v


def leaf_paths_with_slots(tree: Any, prefix: str = "") -> Iterable[tuple[str, tuple[Any, Any, Any]]]:
    for path, container, key, value in walk(tree, _dicts_and_lists_of_dicts_or_tensors, prefix):
        yield path, (container, key, value)


def copy_into(target: torch.Tensor, value: Any, key: str) -> None:
    """Copy ``value`` (DTensor of any layout, full tensor, or the target itself) into ``target`` in place.

    :func:`relayout_like` brings ``value`` to the target's layout (a DTensor
    laid out otherwise is gathered: collective); copying a tensor onto itself
    is skipped, so loading a state dict that holds the live tensors is free.
    """
    if not isinstance(value, torch.Tensor):
        raise IncompatibleStateDict(f"{key!r}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(target.shape):
        raise IncompatibleStateDict(f"{key!r}: shape {tuple(value.shape)} does not match {tuple(target.shape)}")
    src = local_tensor(relayout_like(value, target, copy=False))
    dst = local_tensor(target)
    if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.stride() == dst.stride():
        return
    with torch.no_grad():
        dst.copy_(src)
