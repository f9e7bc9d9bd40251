"""Where the elements of a tensor live: boxes of a global tensor, from DTensors or plain tensors.

A *box* is a hyper-rectangle of a global tensor: ``offsets`` (first index in
every dim) and ``shape``.  Every piece of state the checkpoint code moves is
described as a box: a rank's local shard of a DTensor, a stored chunk in a
file, the part of a stored chunk a new rank needs.  Boxes are plain tuples so
that they travel through JSON, across processes and into the offline tools
without any of the runtime.

This module only looks at a tensor and, for a DTensor, its mesh and
placements.  It never imports the sharding runtime, so models sharded by
shardkit, by torch's own ``fully_shard``, by ``distribute_tensor`` or not at
all look the same from here.

Sharding semantics are torch's: ``Shard(d)`` on a mesh dim of size ``k`` gives
piece ``i`` the rows ``[i*c, min((i+1)*c, n))`` of dim ``d`` with
``c = ceil(n / k)`` (later pieces may be short or empty); several mesh dims
sharding the same tensor dim nest left to right; ``Replicate()`` copies.
What a rank holds of a DTensor under any placement (``_StridedShard``
included, where it may be several boxes) is :mod:`.placements`' business.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from shardkit.errors import IncompatibleStateDict

if TYPE_CHECKING:
    import torch

__all__ = ["itemsize", "Box", "intersect", "box_numel", "box_contains", "shard_range", "shard_box",
           "local_tensor", "is_dtensor", "split_box", "check_cover"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (asked per chunk record when a manifest is parsed: no tensor made)."""
    return dtype.itemsize


def box_numel(box: Box) -> int:
    return math.prod(box[1])


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or ``None`` when they share no element."""
    offs, shape = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        shape.append(hi - lo)
    return tuple(offs), tuple(shape)


def box_contains(outer: Box, inner: Box) -> bool:
    return all(o <= i and i + isz <= o + osz for o, osz, i, isz in zip(outer[0], outer[1], inner[0], inner[1]))


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor -- without importing ``torch.distributed.tensor`` (~40 MB of RSS,
    which the offline tools' memory budgets feel): no DTensor can exist before its module is imported."""
    api = sys.modules.get("torch.distributed.tensor._api")
    return api is not None and isinstance(value, api.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local torch.Tensor (the DTensor's local shard, or the tensor itself).

    The shard itself, not ``to_local()``'s autograd view of it: checkpoints read and write the
    memory, and ``to_local`` costs an autograd call per tensor, hundreds per save or load."""
    import torch

    if is_dtensor(tensor):
        shard = getattr(tensor, "_local_tensor", None)
        return shard if isinstance(shard, torch.Tensor) else tensor.to_local()
    return tensor


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a dim of ``size`` that piece ``index`` of ``parts`` holds under ``Shard``:
    torch's rule, ``ceil(size / parts)`` rows each, later pieces short or empty.  Pure arithmetic,
    so tools that write sharded layouts need not import ``torch.distributed``."""
    per = -(-size // parts) if size else 0
    lo = min(index * per, size)
    return lo, min(lo + per, size)


def shard_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[Any]) -> Box:
    """The box held at mesh coordinate ``coord`` for ``Shard``/``Replicate`` placements."""
    from torch.distributed.tensor import Replicate, Shard

    offsets = [0] * len(global_shape)
    shape = list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # _StridedShard, Partial, custom: not a plain box rule
            raise IncompatibleStateDict(f"placement {placement} is not supported by the box rule")
        d = placement.dim if placement.dim >= 0 else placement.dim + len(global_shape)
        lo, hi = shard_range(shape[d], mesh_shape[mesh_dim], coord[mesh_dim])
        offsets[d] += lo
        shape[d] = hi - lo
    return tuple(offsets), tuple(shape)


def split_box(box: Box, itemsize: int, cap_bytes: int) -> list[Box]:
    """Split a box into sub-boxes of at most ``cap_bytes`` each, in row-major order.

    The concatenated bytes of the sub-boxes equal the box's own row-major bytes,
    so a contiguous local shard is written chunk after chunk with no copy.  The
    split runs along the outermost dim whose one-index slab fits the cap (dim 0
    for every matrix whose row fits), fixing single indices of the dims before it.
    """
    offsets, shape = box
    if math.prod(shape) * itemsize <= cap_bytes or not shape or 0 in shape:
        return [box]
    slab = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        slab[d] = slab[d + 1] * shape[d + 1]
    k = next((d for d in range(len(shape)) if slab[d] <= cap_bytes), len(shape) - 1)
    per = max(1, cap_bytes // slab[k])
    out: list[Box] = []

    def walk(d: int, offs: list[int]) -> None:
        if d == k:
            for lo in range(0, shape[k], per):
                sub_off = tuple(offs) + (offsets[k] + lo,) + tuple(offsets[k + 1:])
                sub_shape = (1,) * k + (min(per, shape[k] - lo),) + tuple(shape[k + 1:])
                out.append((sub_off, sub_shape))
            return
        for i in range(shape[d]):
            walk(d + 1, offs + [offsets[d] + i])

    walk(0, [])
    return out


def check_cover(shape: Sequence[int], boxes: Iterable[Box]) -> str | None:
    """Why ``boxes`` do not tile ``shape`` exactly (holes, overlaps, out of bounds), or ``None``.

    Volume equality plus pairwise disjointness implies an exact cover.  The
    sweep along dim 0 compares a box only with boxes whose dim-0 range is still
    open, which is a handful for the dim-0 partitions checkpoints are made of.
    """
    shape = tuple(shape)
    items = sorted(boxes, key=lambda b: b[0])
    total = 0
    for offs, sz in items:
        if len(offs) != len(shape) or len(sz) != len(shape):
            return f"a chunk has rank {len(offs)}, the tensor has rank {len(shape)}"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offs, sz, shape)):
            return f"chunk at {list(offs)} of shape {list(sz)} lies outside the tensor's shape {list(shape)}"
        total += math.prod(sz)
    if total != math.prod(shape):
        return f"chunks hold {total} elements, the tensor has {math.prod(shape)} (holes or overlaps)"
    if not shape:
        return None if len(items) == 1 else "a scalar is stored more than once"
    active: list[Box] = []
    for box in items:
        if math.prod(box[1]) == 0:
            continue
        start = box[0][0]
        active = [a for a in active if a[0][0] + a[1][0] > start]
        for other in active:
            if intersect(box, other) is not None:
                return f"chunks at {list(box[0])} and {list(other[0])} overlap"
        active.append(box)
    return None
