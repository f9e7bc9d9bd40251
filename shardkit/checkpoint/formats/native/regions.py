"""Writer regions: which writer stored which box of a tensor, by rule wherever the job's layout allows.

Format version 3 keeps chunk records out of ``manifest.json`` (they live in
one index file per writer, :mod:`~shardkit.checkpoint.formats.native.index`).
What the manifest still says, per tensor, is each writer's *regions*: the
boxes whose chunks that writer stored.  A loading rank compares them with the
boxes it needs and reads only the index files of the writers that overlap.

Listing every region would grow with the model times the ranks again, so a
regular layout is described by a **rule** that every tensor saved that way
shares: the mesh shape, the placements as plain specs and the writer of each
mesh coordinate (row-major; ``-1`` where nothing is stored).  A tensor's
regions follow from its shape by the DTensor box rule
(:func:`~shardkit.checkpoint.geometry.placements.held_pieces`): the boxes
coordinate ``c`` holds, written by ``writers[c]`` (replicas name the same
writer).  Whatever no rule reproduces exactly -- plain tensors rank 0 writes,
irregular assignments -- is listed: ``[[writer, offsets, shape], ...]``.

A rule is only kept when it reproduces the chunks that were written: every
chunk lies in a region of its own writer and the regions tile the tensor.
Readers check the same, so a manifest whose rules and index files disagree
is refused.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Iterable, Mapping, Sequence

from shardkit.checkpoint.geometry.boxes import Box, box_contains, check_cover, intersect
from shardkit.checkpoint.geometry.placements import Spec, held_pieces

__all__ = ["Rule", "Regions", "rule_regions", "derive_regions", "regions_problem", "rule_boxes", "rule_problem",
           "chunks_problem",
           "coordinate_boxes",
           "by_writer", "rule_by_writer", "overlapping_writers", "rule_overlapping_writers"]

Rule = tuple[tuple[int, ...], tuple[Spec, ...], tuple[int, ...]]  # (mesh shape, specs, writer per coordinate)
Regions = tuple[tuple[int, Box], ...]                               # ((writer, box), ...)


def _coords(mesh: Sequence[int]) -> Iterable[tuple[int, ...]]:
    return itertools.product(*(range(m) for m in mesh))


@lru_cache(maxsize=4096)
def _first_offsets(shape: tuple[int, ...], mesh: tuple[int, ...], specs: tuple[Spec, ...]
                   ) -> tuple[tuple[tuple[int, ...], ...] | None, ...]:
    """Per mesh coordinate (row-major), the offsets of the first box it holds (``None``: it holds nothing)."""
    return tuple(pieces[0][0][0] if pieces else None
                 for pieces in (held_pieces(shape, mesh, c, specs) for c in _coords(mesh)))


@lru_cache(maxsize=4096)
def rule_regions(shape: tuple[int, ...], rule: Rule) -> Regions:
    """The regions ``rule`` gives a tensor of ``shape``: each distinct (writer, box), in coordinate order."""
    mesh, specs, writers = rule
    seen: dict[tuple[int, Box], None] = {}
    for c, writer in zip(_coords(mesh), writers):
        if writer < 0:
            continue
        for global_box, _ in held_pieces(shape, mesh, c, specs):
            if math.prod(global_box[1]):
                seen.setdefault((writer, global_box), None)
    return tuple(seen)


def _grid(shape: tuple[int, ...], mesh: tuple[int, ...], specs: tuple[Spec, ...],
          writer_at: Mapping[tuple[int, ...], int]) -> tuple[int, ...] | None:
    """The writer of each coordinate, found by the chunk each coordinate's first box starts with."""
    grid = []
    for offsets in _first_offsets(shape, mesh, specs):
        if offsets is None:
            grid.append(-1)
            continue
        writer = writer_at.get(offsets)
        if writer is None:
            return None
        grid.append(writer)
    return tuple(grid)


def _join(rules: list[tuple[tuple[int, ...], tuple[Spec, ...], list[int]]], mesh: tuple[int, ...],
          specs: tuple[Spec, ...], grid: tuple[int, ...]) -> int:
    """Index of a kept rule of this mesh and specs whose grid agrees with ``grid`` wherever both name a writer
    (filled in where it did not), or of a new one: tensors too small to reach every coordinate share their
    layout's rule."""
    for i, (m, s, kept) in enumerate(rules):
        if m == mesh and s == specs and all(a < 0 or b < 0 or a == b for a, b in zip(kept, grid)):
            for j, b in enumerate(grid):
                if kept[j] < 0:
                    kept[j] = b
            return i
    rules.append((mesh, specs, list(grid)))
    return len(rules) - 1


def derive_regions(tensors: Mapping[str, tuple[int, ...]], chunks: Mapping[str, Sequence[tuple[int, Box]]],
                   candidates: Mapping[str, Sequence[tuple[tuple[int, ...], tuple[Spec, ...]]]]
                   ) -> tuple[list[Rule], dict[str, int | Regions]]:
    """Rules and, per tensor, a rule index or its explicit regions.

    ``chunks[fqn]``: ``(writer, box)`` of every stored chunk; ``candidates[fqn]``: layouts (mesh shape,
    specs) the tensor may have been saved with, tried in order.  A rule is used for a tensor only when its
    regions hold every chunk in a region of the chunk's writer (so they also tile the tensor)."""
    rules: list[tuple[tuple[int, ...], tuple[Spec, ...], list[int]]] = []  # grids filled in as tensors join
    out: dict[str, int | Regions] = {}
    for fqn, shape in tensors.items():
        stored = tuple(chunks.get(fqn, ()))
        writer_at = {box[0]: w for w, box in stored}
        out[fqn] = tuple(stored)  # listed, unless a candidate rule reproduces it
        for mesh, specs in candidates.get(fqn, ()):
            grid = _grid(shape, mesh, specs, writer_at)
            if grid is not None and rule_problem(shape, (mesh, specs, grid)) is None \
                    and chunks_problem(rule_by_writer(shape, (mesh, specs, grid)), stored) is None:
                out[fqn] = _join(rules, mesh, specs, grid)
                break
    return [(mesh, specs, tuple(grid)) for mesh, specs, grid in rules], out


def regions_problem(shape: Sequence[int], regions: Regions) -> str | None:
    """Why ``regions`` do not tile the tensor (a box named by two writers counts as an overlap), or ``None``."""
    boxes = [box for _, box in regions]
    if len(set(boxes)) != len(boxes):
        return "two writers' regions are the same box"
    return check_cover(shape, boxes)


def rule_boxes(rule: Rule) -> int:
    """The most boxes ``rule`` can give a tensor: one per coordinate and strided piece."""
    return math.prod(rule[0]) * math.prod(s[2] for s in rule[1] if s[0] == "strided")


@lru_cache(maxsize=4096)
def rule_problem(shape: tuple[int, ...], rule: Rule) -> str | None:
    """Why a rule's regions do not tile a tensor of ``shape``, or ``None``; once per shape (the layers of a
    model share their shapes).  The boxes the coordinates hold tile the tensor by construction (the DTensor
    box rule: replicas hold the same box, other coordinates disjoint ones), so what is left to check is that
    the replicas of a box name one writer, and -- where some coordinate names none (``-1``) -- that another
    coordinate names a writer for each box it holds: linear, where a general tiling check is not."""
    writer_of: dict[Box, int] = {}
    for writer, box in rule_regions(shape, rule):
        if writer_of.setdefault(box, writer) != writer:
            return f"the box at {list(box[0])} is named by writers {writer_of[box]} and {writer}"
    mesh, specs, writers = rule
    for c, writer in zip(_coords(mesh), writers):
        if writer < 0:
            lost = next((box for box in coordinate_boxes(shape, mesh, c, specs) if box not in writer_of), None)
            if lost is not None:
                return f"no writer stored the box at {list(lost[0])} (mesh coordinate {list(c)})"
    return None


@lru_cache(maxsize=65536)
def coordinate_boxes(shape: tuple[int, ...], mesh: tuple[int, ...], coord: tuple[int, ...],
                     specs: tuple[Spec, ...]) -> tuple[Box, ...]:
    """The non-empty boxes mesh coordinate ``coord`` holds of a tensor of ``shape``: a writer's regions when
    it stored what its coordinate holds (once per shape: the layers of a model share their shapes)."""
    return tuple(box for box, _ in held_pieces(shape, mesh, coord, specs) if math.prod(box[1]))


def by_writer(regions: Regions) -> dict[int, tuple[Box, ...]]:
    """``regions`` grouped by writer."""
    out: dict[int, list[Box]] = {}
    for writer, box in regions:
        out.setdefault(writer, []).append(box)
    return {w: tuple(boxes) for w, boxes in out.items()}


@lru_cache(maxsize=4096)
def rule_by_writer(shape: tuple[int, ...], rule: Rule) -> dict[int, tuple[Box, ...]]:
    """:func:`by_writer` of a rule's regions, once per shape."""
    return by_writer(rule_regions(shape, rule))


def chunks_problem(regions: Mapping[int, Sequence[Box]], chunks: Sequence[tuple[int, Box]],
                   writers: Iterable[int] | None = None) -> str | None:
    """Why ``chunks`` (writer, box) do not tile exactly the regions (writer -> boxes) of their writers,
    or ``None``.

    ``chunks`` may be those of some ``writers`` only (default: the writers of ``chunks``; a reader that
    fetched some index files passes their writers): each region of those writers must be tiled exactly
    by that writer's chunks.  The regions themselves are checked by :func:`regions_problem` (or
    :func:`rule_problem`)."""
    inside: dict[tuple[int, Box], list[Box]] = {}
    for writer, box in chunks:
        if not math.prod(box[1]):
            continue
        region = next((r for r in regions.get(writer, ()) if box_contains(r, box)), None)
        if region is None:
            return f"a chunk of writer {writer} at {list(box[0])} lies outside that writer's regions"
        inside.setdefault((writer, region), []).append(box)
    for writer in set(writers) if writers is not None else {w for w, _ in chunks}:
        for region in regions.get(writer, ()):
            rel = [(tuple(o - r for o, r in zip(b[0], region[0])), b[1]) for b in inside.get((writer, region), [])]
            problem = check_cover(region[1], rel)
            if problem:
                return f"writer {writer}'s region at {list(region[0])}: {problem}"
    return None


def overlapping_writers(regions: Regions, boxes: Iterable[Box]) -> set[int]:
    """The writers whose regions meet any of ``boxes``."""
    wanted = [b for b in boxes if math.prod(b[1])]
    return {w for w, region in regions if any(intersect(region, b) is not None for b in wanted)}


@lru_cache(maxsize=65536)
def rule_overlapping_writers(shape: tuple[int, ...], rule: Rule, boxes: tuple[Box, ...]) -> frozenset[int]:
    """:func:`overlapping_writers` of a rule's regions, once per shape and boxes: a loading rank wants
    the same boxes of every layer."""
    return frozenset(overlapping_writers(rule_regions(shape, rule), boxes))
