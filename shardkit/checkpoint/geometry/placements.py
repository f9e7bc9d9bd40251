"""What a rank holds of a DTensor: a list of (global box, local box) pieces, for any mesh and placement.

A DTensor's placements say, mesh dim by mesh dim and left to right, how the
global tensor is cut: ``Shard(d)`` keeps piece ``c`` of ``k`` of the current
indices of dim ``d`` (torch's rule, ``ceil(n / k)`` each, later pieces short or
empty), ``Replicate()`` keeps them all, and ``_StridedShard(d, sf)`` first cuts
the current indices into ``sf`` pieces, keeps piece ``c`` of ``k`` of *each*,
and concatenates them.  FSDP composed with tensor parallelism labels its
parameters so (``(_StridedShard(0, sf=tp), Shard(0))`` on a (dp, tp) mesh), and
then a rank's rows are one range; but a strided placement on its own, e.g.
``(_StridedShard(0, sf=2), Replicate())``, leaves a rank several row ranges.

So a rank's local tensor is not always one box of the global tensor.  Here it
is a list of :data:`Piece` s: each a box of the global tensor and the box of
the local tensor holding it (the cartesian product, over dims, of the index
runs the rank holds).  ``save`` writes each piece, ``load`` fills each piece,
``relayout`` cuts each piece, always through views of the local tensor.

Why our own rule and not torch's: ``compute_local_shape_and_global_offset``
(``torch.distributed.tensor._utils``, a private module) and
``DTensor.__create_chunk_list__`` built on it return one offset and one shape
per rank -- the first index of every dim -- which is the wrong box when a
strided rank holds several ranges.  Torch tracks the full index list inside
that function; we track it as runs, which is the same rule without a tensor of
indices.  The tests cross-check both against the data torch's
``distribute_tensor`` and ``fully_shard`` put on each rank.

Pure arithmetic on shapes and placements, plus reading a DTensor's mesh; no
runtime import, so models sharded by shardkit, by torch or by hand look alike.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Sequence

from shardkit.checkpoint.geometry.boxes import Box, is_dtensor, local_tensor, shard_range
from shardkit.errors import IncompatibleStateDict

if TYPE_CHECKING:
    import torch

__all__ = ["Piece", "Spec", "placement_specs", "held_runs", "held_pieces", "local_pieces", "local_shape",
           "view", "lowest_replica", "layout_of"]

Piece = tuple[Box, Box]  # (box of the global tensor, box of the rank's local tensor holding it)
Spec = tuple  # ("replicate",) | ("shard", dim) | ("strided", dim, split_factor): a placement as plain data
Run = tuple[int, int]  # (first global index, length) of consecutive global indices held along one dim


def placement_specs(placements: Sequence[Any], ndim: int, fqn: str = "") -> list[Spec]:
    """``placements`` as plain :data:`Spec` s; refuses ``Partial`` and any placement without a box rule."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    what = repr(fqn) if fqn else "a tensor"
    specs: list[Spec] = []
    for p in placements:
        if isinstance(p, Replicate):
            specs.append(("replicate",))
        elif isinstance(p, Partial):
            raise IncompatibleStateDict(f"{what} has a Partial placement (a pending reduction); redistribute it "
                                        f"to Shard/Replicate before checkpointing")
        elif type(p) is Shard or type(p).__name__ == "_StridedShard":
            dim = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= dim < ndim:
                raise IncompatibleStateDict(f"{what}: placement {p!r} shards dim {p.dim} of a {ndim}-D tensor")
            specs.append(("shard", dim) if type(p) is Shard else ("strided", dim, int(p.split_factor)))
        else:
            raise IncompatibleStateDict(f"{what}: placement {p!r} has no box rule; use Shard, _StridedShard or "
                                        f"Replicate")
    return specs


def _select(runs: list[Run], ranges: Sequence[tuple[int, int]]) -> list[Run]:
    """The global runs at local positions ``ranges`` (``[lo, hi)``, ascending) of the concatenated ``runs``."""
    out: list[Run] = []
    for lo, hi in ranges:
        pos = 0
        for start, length in runs:
            a, b = max(lo, pos), min(hi, pos + length)
            if a < b:
                g = start + a - pos
                if out and out[-1][0] + out[-1][1] == g:
                    out[-1] = (out[-1][0], out[-1][1] + b - a)
                else:
                    out.append((g, b - a))
            pos += length
    return out


def held_runs(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              specs: Sequence[Spec]) -> list[list[Run]]:
    """Per tensor dim, the runs of global indices mesh coordinate ``coord`` holds, in local order."""
    runs: list[list[Run]] = [[(0, n)] if n else [] for n in shape]
    for k, c, spec in zip(mesh_shape, coord, specs):
        if spec[0] == "replicate":
            continue
        d = spec[1]
        total = sum(length for _, length in runs[d])
        if spec[0] == "shard":
            wanted = [shard_range(total, k, c)]
        else:  # strided: piece c of k of each of the split_factor pieces, concatenated
            wanted = []
            for j in range(spec[2]):
                lo, hi = shard_range(total, spec[2], j)
                a, b = shard_range(hi - lo, k, c)
                wanted.append((lo + a, lo + b))
        runs[d] = _select(runs[d], wanted)
    return runs


def held_pieces(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                specs: Sequence[Spec]) -> list[Piece]:
    """The pieces held at ``coord``: one per combination of runs; ``[]`` when it holds no element."""
    runs = held_runs(shape, mesh_shape, coord, specs)
    per_dim = []
    for dim_runs in runs:
        local, pos = [], 0
        for start, length in dim_runs:
            local.append((start, pos, length))
            pos += length
        per_dim.append(local)
    if any(not d for d in per_dim):
        return []
    pieces = []
    for combo in itertools.product(*per_dim):
        sizes = tuple(n for _, _, n in combo)
        pieces.append(((tuple(g for g, _, _ in combo), sizes), (tuple(p for _, p, _ in combo), sizes)))
    return pieces


def local_shape(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                specs: Sequence[Spec]) -> tuple[int, ...]:
    """The shape of the local tensor at ``coord`` (what torch allocates, without padding)."""
    return tuple(sum(length for _, length in r) for r in held_runs(shape, mesh_shape, coord, specs))


class _MeshFacts:
    """A mesh's rank grid and this rank's coordinate, computed once per mesh object.

    Recent torch versions rebuild ``DeviceMesh.mesh`` from its layout on every
    access; a save or load asks for every tensor, and a model has hundreds.
    """

    def __init__(self) -> None:
        self._facts: dict[int, tuple[weakref.ref, torch.Tensor, tuple[int, ...] | None]] = {}

    def of(self, mesh: Any) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        found = self._facts.get(id(mesh))
        if found is None or found[0]() is not mesh:
            if len(self._facts) > 64:  # meshes come and go in long test sessions; keep the live ones
                self._facts = {k: v for k, v in self._facts.items() if v[0]() is not None}
            coord = mesh.get_coordinate()
            found = self._facts[id(mesh)] = (weakref.ref(mesh), mesh.mesh, None if coord is None else tuple(coord))
        return found[1], found[2]


_meshes = _MeshFacts()


def local_pieces(tensor: torch.Tensor, fqn: str = "") -> list[Piece] | None:
    """This rank's pieces of ``tensor``; ``None`` when its mesh excludes this rank.

    A plain tensor is one piece, itself.  A DTensor's pieces come from its
    placements at this rank's mesh coordinate; the local tensor must have the
    shape they imply (else :class:`~shardkit.errors.IncompatibleStateDict`).
    """
    if not is_dtensor(tensor):
        whole = (0,) * tensor.dim(), tuple(tensor.shape)
        return [(whole, whole)] if tensor.numel() else []
    mesh = tensor.device_mesh
    specs = placement_specs(tensor.placements, tensor.dim(), fqn)
    grid, coord = _meshes.of(mesh)
    if coord is None:
        return None
    shape, mshape = tuple(tensor.shape), tuple(grid.shape)
    expect = local_shape(shape, mshape, coord, specs)
    got = tuple(local_tensor(tensor).shape)
    if got != expect:
        raise IncompatibleStateDict(f"{fqn or 'a DTensor'}: local tensor has shape {got}, its placements "
                                    f"{tuple(tensor.placements)} imply {expect}")
    return held_pieces(shape, mshape, coord, specs)


def view(local: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``local`` at a local box."""
    return local[tuple(slice(o, o + s) for o, s in zip(*box))]


def lowest_replica(tensor: torch.Tensor) -> bool:
    """Whether this rank is the lowest rank *of the tensor's own mesh* holding its pieces.

    Ranks that differ only on ``Replicate`` mesh dims hold the same pieces;
    distinct coordinates on sharding dims hold disjoint ones.  Ranks outside
    the mesh that hold the same data (a tensor on the dp sub-mesh, copied on
    every tp rank) are invisible here; ``save`` finds those by comparing boxes
    across ranks.  A plain tensor counts as held by every rank alike.
    """
    if not is_dtensor(tensor):
        return True
    from torch.distributed.tensor import Replicate

    grid, coord = _meshes.of(tensor.device_mesh)
    if coord is None:
        return False
    index = tuple(slice(None) if isinstance(p, Replicate) else c for p, c in zip(tensor.placements, coord))
    return int(grid[index].min()) == int(grid[coord])


def layout_of(tensor: torch.Tensor) -> dict[str, Any] | None:
    """``{"shape", "dim_names", "placements", "specs"}`` of a DTensor's mesh (``None`` for a plain tensor): what
    the manifest records so ``inspect`` can show how the job held each tensor."""
    if not is_dtensor(tensor):
        return None
    mesh = tensor.device_mesh
    return {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or []),
            "placements": [str(p) for p in tensor.placements],
            "specs": [list(s) for s in placement_specs(tensor.placements, tensor.ndim)]}
