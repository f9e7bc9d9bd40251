"""Step 1 of a save: :func:`plan_save`, the chunks each rank writes, grouped into its data files.

Its own module because planning is what a repeated save must not pay for
again: everything worked out per tensor depends only on the state's
structure (:func:`structure_of`), so it is kept for the last few structures
per process group and reused; ``save`` and ``async_save`` (whose repeated
saves only copy) both plan here.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.compression import Compression
from shardkit.checkpoint.formats.dtypes import dtype_to_code
from shardkit.checkpoint.formats.native import group_into_files
from shardkit.checkpoint.geometry.boxes import Box, box_numel, is_dtensor, local_tensor, split_box
from shardkit.checkpoint.geometry.placements import local_pieces, lowest_replica
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state.aliases import find_aliases
from shardkit.checkpoint.state.tree import flatten, keep_keys
from shardkit.checkpoint.training.save_plan import SavePlan, layouts_of
from shardkit.checkpoint.training.writer_assignment import WriterAssignments, writer_assignments
from shardkit.errors import CheckpointError, UnsupportedFormat
from shardkit.held_groups import GroupRef

__all__ = ["plan_save", "structure_of", "check_storable", "files_for", "PARALLEL_FILE_BYTES"]


class _LastPlan:
    """What planning derived from the structures of the last few saves, kept per process group.

    Everything :func:`plan_save` works out per tensor (pieces, replicas, tied
    keys, layouts, chunk boxes) depends only on the tensors' keys, shapes,
    dtypes, placements and memory addresses.  When those are what they were
    at one of the last saves, it is reused and only the views into the current
    tensors are made again.  No tensor is referenced, so nothing is kept alive
    (nor the group: see :mod:`shardkit.held_groups`).
    """

    KEPT = 4  # structures remembered per group: a job may alternate a few (the training state, an export)

    def __init__(self) -> None:
        self._groups: dict[int, tuple[GroupRef, list[tuple[tuple, dict[str, Any]]]]] = {}

    def get(self, dist: Dist, signature: tuple) -> dict[str, Any] | None:
        found = self._groups.get(id(dist.group))
        if found is None or not found[0].refers_to(dist.group):
            return None
        return next((derived for kept, derived in reversed(found[1]) if kept == signature), None)

    def put(self, dist: Dist, signature: tuple, derived: dict[str, Any]) -> None:
        found = self._groups.get(id(dist.group))
        kept = found[1] if found is not None and found[0].refers_to(dist.group) else []
        self._groups[id(dist.group)] = (GroupRef(dist.group), (kept + [(signature, derived)])[-self.KEPT:])


_last_plans = _LastPlan()


def structure_of(flat_tensors: Mapping[str, torch.Tensor], options: tuple) -> tuple[tuple, dict[str, torch.Tensor]]:
    """What planning a save depends on -- every tensor's key, dtype, shape, placements, mesh and local
    shape, strides and address, plus ``options`` -- as one comparable tuple; and each key's local tensor.

    Called on every save of a training run, so it reads as little as it can: a DTensor's spec (global
    dtype, shape, placements and mesh in one object, usually the very object of the last save, so
    comparing is an identity check) and its local tensor's geometry.  A plain tensor's address counts only
    where its storage is another key's too (it could be tied to it): a training state's RNG states and step
    counts are new tensors at every save, and would otherwise make every save plan afresh.
    """
    api = sys.modules.get("torch.distributed.tensor._api")
    dtensor = api.DTensor if api is not None else ()
    parts: list[tuple] = [options]
    locals_: dict[str, torch.Tensor] = {}
    plain: list[int] = []  # where in ``parts`` a plain tensor is, its address left out for now
    for key, tensor in flat_tensors.items():
        if isinstance(tensor, dtensor):
            spec = tensor._spec
            local = local_tensor(tensor)
            described = spec if spec.tensor_meta is not None else (spec, tensor.dtype, tensor.shape)
            parts.append((key, described, local.shape, local.stride(), local.data_ptr()))
        else:
            local = tensor
            plain.append(len(parts))
            parts.append((key, type(tensor), tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset()))
        locals_[key] = local
    if plain:
        storages = collections.Counter(_storage_address(t) for t in locals_.values())
        for at in plain:
            local = locals_[parts[at][0]]
            address = _storage_address(local)
            if address is None or storages[address] > 1:
                parts[at] += (id(local) if address is None else local.data_ptr(),)
    return tuple(parts), locals_


def _storage_address(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s storage is; ``None`` for a wrapper subclass that has none (planning refuses it)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _derive(flat_tensors: Mapping[str, torch.Tensor], dist: Dist) -> dict[str, Any]:
    """Per-tensor planning: global dtype/shape of each key written, the boxes this rank holds (and where
    they are in its local tensors), tied keys and layouts."""
    aliases = find_aliases(flat_tensors)
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    held: dict[str, list[Box]] = {}
    local_boxes: dict[tuple[str, Box], Box] = {}
    for key, tensor in flat_tensors.items():
        check_storable(key, tensor)  # unsupported dtypes and tensor subclasses fail here, before anything is written
        if key in aliases:
            continue
        tensors[key] = (tensor.dtype, tuple(tensor.shape))
        pieces = local_pieces(tensor, key)
        if not pieces or not lowest_replica(tensor) or (not is_dtensor(tensor) and dist.group_rank != 0):
            continue  # a plain tensor is every rank's: rank 0 writes it without asking the others
        for global_box, local_box in pieces:
            if box_numel(global_box):
                held.setdefault(key, []).append(global_box)
                local_boxes[(key, global_box)] = local_box
    layouts = layouts_of(flat_tensors)
    coords = [flat_tensors[layout["tensors"][0]].device_mesh.get_coordinate() for layout in layouts]
    return {"aliases": aliases, "tensors": tensors, "held": held, "local_boxes": local_boxes,
            "layouts": layouts, "coords": [None if c is None else tuple(c) for c in coords],
            "held_signature": WriterAssignments.signature(dist, held), "chunks": None}


def check_storable(key: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor the native format cannot hold: a dtype without a code, or a tensor subclass that
    dispatches its own operations (torchao's float8 weights, NF4, any wrapper subclass) -- its bytes are
    not the values it stands for, and saving them would load back wrong, so it is named instead."""
    dtype_to_code(tensor.dtype)
    local = local_tensor(tensor)
    if getattr(type(local), "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None):
        raise UnsupportedFormat(f"{key!r} is a {type(local).__module__}.{type(local).__qualname__}, a tensor "
                                f"subclass whose stored bytes are not its values; save a plain tensor of what it "
                                f"holds instead (e.g. its dequantized or high-precision form)")


def _chunk_boxes(derived: dict[str, Any], writes: Mapping[str, Sequence[Box]], chunk_bytes: int
                 ) -> list[tuple[str, Box, tuple[slice, ...]]]:
    """``(key, chunk box, index into the local tensor)`` of every chunk this rank writes (kept in
    ``derived`` for the next save with the same ``writes``)."""
    cached = derived["chunks"]
    if cached is not None and cached[0] == (writes, chunk_bytes):
        return cached[1]
    out = []
    for key, boxes in writes.items():
        itemsize = derived["tensors"][key][0].itemsize
        for box in boxes:
            local_box = derived["local_boxes"][(key, box)]
            for sub in split_box(box, itemsize, chunk_bytes):
                out.append((key, sub, tuple(slice(lo + o - bo, lo + o - bo + n) for lo, o, bo, n
                                            in zip(local_box[0], sub[0], box[0], sub[1]))))
    derived["chunks"] = ((writes, chunk_bytes), out)
    return out


def plan_save(state_dict: Mapping[str, Any], dist: Dist, *, chunk_bytes: int, io_threads: int,
              compression: Compression | None,
              keys: tuple[Sequence[str] | None, Sequence[str] | None] = (None, None)) -> SavePlan:
    """Chunks this rank writes (each stored box by one rank, tied tensors once), grouped into files balanced
    by bytes.  ``keys`` = (only, exclude) globs choose the keys saved.  Collective
    (:func:`~.writer_assignment.assign_writers`, reused across saves of the same structure by
    :class:`~.writer_assignment.WriterAssignments`):
    every rank reaches the exchange even when its own planning failed, and raises that failure after it.
    A save of the structure the last one had reuses its per-tensor planning (``_LastPlan``)."""
    derived: dict[str, Any] | None = None
    error: BaseException | None = None
    try:
        flat = keep_keys(flatten(state_dict), *keys)
        signature = structure_of(flat.tensors, (dist.group_rank, dist.group_size))[0]
        derived = _last_plans.get(dist, signature)
        if derived is None:
            derived = _derive(flat.tensors, dist)
            _last_plans.put(dist, signature, derived)
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the exchange
        error, derived = exc, None
    writes = writer_assignments.assign(dist, None if derived is None else derived["held"],
                                       None if derived is None else derived["held_signature"],
                                       lambda writes: len(_chunk_boxes(derived, writes, chunk_bytes)))
    if error is not None or derived is None:
        raise error or CheckpointError("save planning failed")
    tensors = derived["tensors"]
    locals_ = {key: local_tensor(flat.tensors[key]).detach() for key in writes}
    chunks = [WriteChunk(key, tensors[key][0], sub[0], sub[1], locals_[key][index], tensors[key][1])
              for key, sub, index in _chunk_boxes(derived, writes, chunk_bytes)]
    return SavePlan(group_into_files(chunks, files_for(sum(c.nbytes for c in chunks), io_threads),
                                     chunk_bytes if compression else None),
                    tensors, flat.values, derived["layouts"], derived["aliases"], writes, derived["coords"])


# Each data file a rank writes costs its own create, fsync and hand-off to an I/O thread (a few ms on a busy
# machine); a second thread pays that back only with this much to write, so a small state goes into fewer
# files than there are I/O threads (one below twice this), a large one into one per thread.
PARALLEL_FILE_BYTES = 8 << 20


def files_for(nbytes: int, io_threads: int) -> int:
    """How many data files a rank writes ``nbytes`` into: one per I/O thread, at least
    :data:`PARALLEL_FILE_BYTES` each."""
    return max(1, min(io_threads, nbytes // PARALLEL_FILE_BYTES))
