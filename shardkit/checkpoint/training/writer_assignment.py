"""Which rank writes which box: the lowest rank holding it, agreed once and reused while nothing changed.

Every stored element must be written exactly once, whether it is replicated on
a mesh dim of its tensor (HSDP), held by ranks outside the tensor's mesh, or a
plain tensor.  The ranks exchange the boxes they hold (JSON over the process
group) and each writes the boxes no lower rank holds.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping, Sequence

from shardkit.checkpoint.geometry.boxes import Box
from shardkit.checkpoint.io.dist import Dist
from shardkit.held_groups import GroupRef

__all__ = ["assign_writers", "WriterAssignments", "writer_assignments"]


def assign_writers(dist: Dist, held: Mapping[str, Sequence[Box]] | None) -> dict[str, list[Box]]:
    """Of the boxes this rank holds (``{fqn: [box, ...]}``), the ones it writes: those no lower rank holds.

    Collective: every rank must call it, in the same order; a rank whose
    planning failed passes ``None`` (it holds nothing) so the others do not
    wait for it.  Only boxes this rank may write after the local rule
    (:func:`~shardkit.checkpoint.geometry.placements.lowest_replica`) travel,
    as JSON; a box held identically by several ranks -- whether the replica
    dimension is part of the tensor's own mesh or not -- is written by the
    lowest of them.  Boxes are compared whole: two ranks holding *different*
    but overlapping boxes of one tensor is a layout no mesh produces, and the
    manifest check at commit refuses it, naming the tensor.
    """
    mine = {k: [[list(b[0]), list(b[1])] for b in boxes] for k, boxes in (held or {}).items()}
    everyone = dist.all_gather_json(mine)
    taken: dict[str, set[str]] = {}
    for rank_boxes in everyone[:dist.group_rank]:
        for key, boxes in (rank_boxes or {}).items():
            taken.setdefault(key, set()).update(repr(b) for b in boxes)
    return {key: [tuple(map(tuple, b)) for b in boxes if repr(b) not in taken.get(key, ())]
            for key, boxes in mine.items()}


class WriterAssignments:
    """The last few :func:`assign_writers` results of each process group, reused while nothing changed.

    A training job saves the same structures again and again (the training state every few steps, perhaps a
    model-only export between); the exchange of every rank's boxes is then the same each time.  Every rank
    keeps, for each of the last :data:`KEPT` structures it saved, what it held and what it was told to write,
    numbered by the generation of the exchange -- a count all ranks advance together.  A later save agrees in
    one small all-reduce that every rank found what it holds now under the same generation -- then each
    reuses its answer -- else all exchange again.  The group is remembered weakly
    (see :mod:`shardkit.held_groups`); a group formed where an old one was starts afresh, and every rank still
    takes part in the agreement, so none skips a collective the others make.
    """

    KEPT = 4

    def __init__(self) -> None:
        self._groups: dict[int, tuple[GroupRef, int, OrderedDict[str, tuple[int, dict[str, list[Box]]]]]] = {}

    @staticmethod
    def signature(dist: Dist, held: Mapping[str, Sequence[Box]]) -> str:
        return repr((dist.group_rank, dist.group_size, sorted(
            (k, [tuple(map(tuple, b)) for b in boxes]) for k, boxes in held.items())))

    def assign(self, dist: Dist, held: Mapping[str, Sequence[Box]] | None, signature: str | None = None,
               chunks_of: Callable[[Mapping[str, Sequence[Box]]], int] | None = None) -> dict[str, list[Box]]:
        """``assign_writers(dist, held)``, or an earlier answer (``signature``: of ``held``, if known).

        ``chunks_of(writes)``: how many chunks this rank's ``writes`` make; passed by every rank, it travels
        with the agreement, and when an earlier answer stands ``dist.agreed_most`` is the most of any rank."""
        if held is not None and signature is None:
            signature = self.signature(dist, held)
        group, generation, kept = self._groups.get(id(dist.group), (GroupRef(dist.group), 0, OrderedDict()))
        if not group.refers_to(dist.group):
            group, generation, kept = GroupRef(dist.group), 0, OrderedDict()
        found = kept.get(signature) if signature is not None and held is not None else None
        most = None if chunks_of is None else chunks_of(found[1]) if found is not None else 0
        if dist.all_same(found is not None, found[0] if found is not None else -1, most):
            assert found is not None and signature is not None
            kept.move_to_end(signature)
            return {k: list(boxes) for k, boxes in found[1].items()}
        writes = assign_writers(dist, held)
        generation += 1
        if held is not None and signature is not None:
            kept[signature] = (generation, writes)
            while len(kept) > self.KEPT:
                kept.popitem(last=False)
        self._groups[id(dist.group)] = (group, generation, kept)
        return writes


writer_assignments = WriterAssignments()  # one per process: the last exchange of each process group
