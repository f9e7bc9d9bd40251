"""Where each parameter's elements lie in the flat partitions a ZeRO checkpoint stores.

ZeRO keeps, per rank, flat 1-D fp32 partitions (and optimizer state of the
same shape), and ``param_shapes`` (every parameter's name and shape, in
flattening order, per param group).  A parameter's elements are found again
by walking that order, the way DeepSpeed's own ``zero_to_fp32`` does, but
here each parameter becomes a list of :class:`Piece` s (which partition,
where, how many elements) instead of a gathered tensor, so a reader copies
only the rows a request needs, partition by partition, in bounded memory.

* Stages 1 and 2: a param group's partitions, concatenated in rank order,
  are the group's flat buffer; parameters follow one another in it, each
  followed by its ``param_alignment_paddings`` entry (when recorded).  The end
  is padded to a multiple of ``2 * world_size``.
* Stage 3: every parameter is split across all ranks: ``ceil(numel /
  world_size)`` elements each, the last rank's share padded.  On each rank,
  the shares follow one another through the rank's sub-group partitions,
  which together form one stream.

A layout that does not add up (a parameter running past the partitions,
elements left over) is refused: the checkpoint is not what its metadata says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from shardkit.errors import InvalidManifest

__all__ = ["Piece", "cut", "starts_of", "zero12_pieces", "zero3_pieces", "spread_pieces"]


@dataclass(frozen=True)
class Piece:
    """``count`` elements starting at element ``start`` of the flat tensor named ``source``."""

    source: Hashable
    start: int
    count: int


def cut(lo: int, n: int, starts: Sequence[int], sizes: Sequence[int], source: Sequence[Hashable]) -> list[Piece]:
    """Elements ``[lo, lo + n)`` of a buffer made of consecutive parts (``starts``/``sizes``)."""
    pieces = []
    for start, size, src in zip(starts, sizes, source):
        a, b = max(lo, start), min(lo + n, start + size)
        if a < b:
            pieces.append(Piece(src, a - start, b - a))
    return pieces


def starts_of(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def zero12_pieces(groups: Sequence[Mapping[str, Sequence[int]]], partition_numels: Sequence[Sequence[int]],
                  paddings: Sequence[Sequence[int]] | None, where: str) -> dict[str, tuple[int, list[Piece]]]:
    """Stages 1/2: ``{name: (param group, pieces)}``; a piece's source is ``(rank, group)``.

    ``groups``: ``param_shapes`` (name -> shape, per group);
    ``partition_numels[rank][group]``: the size of each rank's partition.
    """
    world = len(partition_numels)
    out: dict[str, tuple[int, list[Piece]]] = {}
    for g, shapes in enumerate(groups):
        sizes = [p[g] for p in partition_numels]
        starts, total = starts_of(sizes), sum(sizes)
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(shapes):
            raise InvalidManifest(f"{where}: param group {g} lists {len(shapes)} parameters and {len(pads)} "
                                  "alignment paddings")
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = math.prod(shape)
            if offset + n > total:
                raise InvalidManifest(f"{where}: parameter {name!r} ({n} elements at {offset}) runs past the "
                                      f"{total} elements of param group {g}'s partitions")
            out[name] = (g, cut(offset, n, starts, sizes, [(r, g) for r in range(world)]))
            offset += n + (pads[i] if pads is not None else 0)
        align = 2 * world  # ZeRO pads each group to a multiple of 2 * world size
        if -(-offset // align) != -(-total // align):
            raise InvalidManifest(f"{where}: param group {g}'s parameters take {offset} elements, its partitions "
                                  f"hold {total}: the checkpoint does not match its param_shapes")
    return out


def zero3_pieces(groups: Sequence[Mapping[str, Sequence[int]]], partition_numels: Sequence[Sequence[int]],
                 where: str) -> dict[str, tuple[int, int, list[Piece]]]:
    """Stage 3: ``{name: (param group, sub-group, pieces)}``; a piece's source is ``(rank, sub-group)``.

    ``partition_numels[rank][sub_group]``: the size of each rank's sub-group partitions (equal on every rank).
    """
    world = len(partition_numels)
    sizes = list(partition_numels[0])
    if any(list(p) != sizes for p in partition_numels):
        raise InvalidManifest(f"{where}: the ranks' stage-3 partitions differ in size ({partition_numels[0]} on "
                              "rank 0); every rank holds an equal share")
    starts, total = starts_of(sizes), sum(sizes)
    out: dict[str, tuple[int, int, list[Piece]]] = {}
    offset = 0
    for g, shapes in enumerate(groups):
        for name, shape in shapes.items():
            n = math.prod(shape)
            share = -(-n // world)
            if offset + share > total:
                raise InvalidManifest(f"{where}: parameter {name!r} runs past the {total} elements of each rank's "
                                      "partitions")
            pieces: list[Piece] = []
            for r in range(world):
                count = min(share, n - r * share)
                if count <= 0:
                    break
                pieces.extend(cut(offset, count, starts, sizes, [(r, s) for s in range(len(sizes))]))
            sub_group = max(s for s, start in enumerate(starts) if start <= offset) if sizes else 0
            out[name] = (g, sub_group, pieces)
            offset += share
    if offset != total:
        raise InvalidManifest(f"{where}: the parameters take {offset} elements of each rank's partitions, which "
                              f"hold {total}: the checkpoint does not match its param_shapes")
    return out


def spread_pieces(numel: int, shares: Sequence[int], source: Sequence[Hashable]) -> list[Piece]:
    """A tensor stored as consecutive shares (stage 3's frozen parameters: one per rank, the last padded)."""
    return cut(0, numel, starts_of(shares), shares, source)
