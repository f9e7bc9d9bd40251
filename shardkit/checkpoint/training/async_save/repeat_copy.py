"""The blocking part of ``async_save`` when the state has the structure it had at the last save: a copy.

A training job saves the same state again and again; only the numbers in
it change.  Everything a save works out before copying -- which chunks this
rank writes, how they group into files, where each lands in the staging
buffer -- depends only on the tensors' structure (keys, dtypes, shapes,
placements, local shapes and addresses: :func:`~shardkit.checkpoint.training.save_planning.structure_of`).
So every rank keeps, per process group, the structure of its last staged
save and, for each staged chunk, where its bytes lie in the key's local
tensor.  The next save compares structures (one pass over the tensors), the
ranks agree in one small all-reduce that every one of them found its
structure unchanged at the same generation, and each copies the current
bytes over the last staging: no planning, no exchange of boxes, no chunk
records built.  The copy runs while the all-reduce is in flight (a rank that
finds its own structure unchanged copies optimistically), so the agreement
costs little more than the other ranks' lag.  Any difference anywhere, on
any rank, and all plan afresh (a rank that copied copies again).

Only geometry is kept (strides, offsets and the DTensor specs, which name a
mesh but hold no data), never a tensor, so nothing the training job frees
stays alive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.compression import Compression
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state.tree import flatten, keep_keys
from shardkit.checkpoint.training.async_save.host_buffers import StagingPool
from shardkit.checkpoint.training.save_plan import SavePlan
from shardkit.checkpoint.training.save_planning import plan_save, structure_of
from shardkit.held_groups import GroupRef

__all__ = ["RepeatStaging"]


@dataclass
class _Staged:
    generation: int  # the count of full plans on the group when this was staged: equal on every rank
    structure: tuple
    staged_token: str | None
    plan: SavePlan  # without chunks: those are the pool's (kept there, and freed with its buffer)
    sources: list[tuple[str, Any, Any, int]]  # (key, size, stride, offset) in its local tensor; size None: all of it


class RepeatStaging:
    """Plans and stages ``async_save``'s chunks, or only copies when nothing but the values changed."""

    def __init__(self) -> None:
        # (group, full plans so far, last staged); the group weakly: see shardkit.held_groups
        self._groups: dict[int, tuple[GroupRef, int, _Staged | None]] = {}

    def plan_and_stage(self, state_dict: dict[str, Any], dist: Dist, pool: StagingPool, *, chunk_bytes: int,
                       io_threads: int, compression: Compression | None,
                       keys: tuple[Sequence[str] | None, Sequence[str] | None] = (None, None)) -> SavePlan:
        """A :class:`SavePlan` whose chunks point at ``pool``'s staged copies of ``state_dict``'s bytes.

        Collective (one all-reduce, plus :func:`plan_save`'s exchange when anything changed): every rank
        calls it for every async save on the group, so generations advance together."""
        group, plans, last = self._groups.get(id(dist.group), (GroupRef(dist.group), 0, None))
        if not group.refers_to(dist.group):  # a new group where an old one was
            plans, last = 0, None
        options = (dist.group_rank, dist.group_size, chunk_bytes, io_threads, compression, keys)
        flat, locals_, structure = None, {}, None
        try:
            flat = keep_keys(flatten(state_dict), *keys)
            structure, locals_ = structure_of(flat.tensors, options)
        except Exception:  # noqa: BLE001 - plan_save below raises it, after the collectives every rank reaches
            pass
        same = (flat is not None and last is not None and last.structure == structure
                and last.staged_token is not None and last.staged_token == pool.staged_token)
        # the chunks this rank writes ride along: when the plan stands, every rank knows the most of any
        agreed = dist.start_all_same(same, last.generation if last is not None else -1,
                                     len(last.sources) if same and last is not None else 0)
        if same:  # copy while the ranks agree; if one of them changed, this copy is made again below
            assert flat is not None and last is not None
            with torch.no_grad():
                groups = pool.restage([locals_[key] if size is None else
                                       locals_[key].as_strided(size, stride, locals_[key].storage_offset() + offset)
                                       for key, size, stride, offset in last.sources])
        if agreed():
            assert flat is not None and last is not None
            plan = last.plan
            return SavePlan(groups, plan.tensors, dict(flat.values), plan.layouts, plan.aliases, plan.regions,
                            plan.coords)
        self._groups[id(dist.group)] = (GroupRef(dist.group), plans + 1, None)
        plan = plan_save(state_dict, dist, chunk_bytes=chunk_bytes, io_threads=io_threads, keys=keys,
                         compression=compression)
        sources = _sources(plan, locals_)
        plan.groups = pool.stage(plan.groups)
        plan.values = dict(plan.values)
        if sources is not None and structure is not None:
            skeleton = SavePlan([], plan.tensors, {}, plan.layouts, plan.aliases, plan.regions, plan.coords)
            self._groups[id(dist.group)] = (GroupRef(dist.group), plans + 1,
                                            _Staged(plans + 1, structure, pool.staged_token, skeleton, sources))
        return plan


def _sources(plan: SavePlan, locals_: Mapping[str, torch.Tensor]
             ) -> list[tuple[str, Any, Any, int]] | None:
    """Where each chunk of ``plan`` lies in its key's local tensor, or ``None`` when one is not a plain
    view of it (then the next save plans afresh)."""
    out = []
    for group in plan.groups:
        for chunk in group:
            local = locals_.get(chunk.fqn)
            data = chunk.data
            if (local is None or not isinstance(data, torch.Tensor) or data.device != local.device
                    or data.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()):
                return None
            offset = data.storage_offset() - local.storage_offset()
            whole = offset == 0 and data.shape == local.shape and data.stride() == local.stride()
            out.append((chunk.fqn, None, None, 0) if whole else
                       (chunk.fqn, tuple(data.shape), data.stride(), offset))
    return out
