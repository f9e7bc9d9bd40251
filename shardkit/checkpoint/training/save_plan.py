"""What one rank of a save writes, and how the job held its tensors: :class:`SavePlan`.

Its own module so that both halves of a save can name the type: ``save.py``
makes plans, ``save_commit.py`` commits what every rank reported of its plan,
and ``async_save`` stages a plan's chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.native import Layout
from shardkit.checkpoint.geometry.boxes import Box
from shardkit.checkpoint.geometry.placements import layout_of

__all__ = ["SavePlan", "layouts_of", "layout_rules"]


@dataclass
class SavePlan:
    """What one rank writes: its chunks grouped into files, and the tensors' global metadata.

    ``layouts`` says how the job held its tensors (see :func:`layouts_of`), for the manifest.
    ``regions`` (key -> the global boxes this rank stores, before they are cut into chunks) and
    ``coords`` (this rank's coordinate on each layout's mesh, ``None`` off it) are what a writer of a
    version-3 checkpoint tells rank 0 (:mod:`~shardkit.checkpoint.training.save_commit`).
    """

    groups: list[list[WriteChunk]]
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    values: dict[str, Any]
    layouts: list[dict[str, Any]] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # tied key -> the key its data is written under
    regions: Mapping[str, Sequence[Box]] = field(default_factory=dict)
    coords: Sequence[tuple[int, ...] | None] = ()

    def __post_init__(self) -> None:
        self.layouts = self.layouts or []
        self.aliases = self.aliases or {}
        self.regions = dict(self.regions or {})
        self.coords = list(self.coords) or [None] * len(self.layouts)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for g in self.groups for c in g)

    @property
    def mesh(self) -> dict[str, Any] | None:
        """The widest mesh any tensor lives on (the job's mesh; sub-meshes are slices of it) with the
        placements of its first tensor: the manifest's ``writer.mesh``."""
        return self.layouts[0]["mesh"] | {"placements": self.layouts[0]["placements"]} if self.layouts else None


def layouts_of(tensors: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    """How the job held its tensors: ``[{"mesh": {"shape", "dim_names"}, "placements": [...],
    "specs": [...], "tensors": [fqn, ...]}, ...]``, one entry per distinct mesh and placements, widest mesh first.
    Plain tensors are not listed (every rank holds them whole)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        layout = layout_of(tensor)
        if layout is None:
            continue
        entry = groups.setdefault(repr((layout["shape"], layout["dim_names"], layout["placements"])), {
            "mesh": {"shape": layout["shape"], "dim_names": layout["dim_names"]}, "placements": layout["placements"],
            "specs": layout["specs"], "tensors": []})
        entry["tensors"].append(key)
    return sorted(groups.values(), key=lambda e: (-len(e["mesh"]["shape"]), -math.prod(e["mesh"]["shape"])))


def layout_rules(layouts: Sequence[Mapping[str, Any]]) -> list[Layout]:
    """A save plan's layouts (:func:`layouts_of`) as (mesh shape, specs, fqns)."""
    return [(tuple(int(n) for n in layout["mesh"]["shape"]), tuple(tuple(s) for s in layout["specs"]),
             tuple(layout["tensors"])) for layout in layouts]
