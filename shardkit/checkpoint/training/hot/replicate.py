"""A hot save: every rank writes its own copy to its node's directory, sends it to its replica holders,
the ranks vote, and each node records the step complete.

The order is what makes a kill at any moment harmless:

1. each rank writes ``rank-<r>.<save id>/`` (manifest last) -- until then the copy does not exist;
2. each copy travels to ``replica-<r>.<save id>/`` on the next ``replicas`` nodes (manifest last);
3. the ranks agree that every copy and replica was written, under the same save id (one small
   collective); a failure anywhere fails the save on every rank and removes this save's directories,
   nothing older;
4. each node's lowest rank writes ``complete.json`` (atomically) and runs retention, which never
   removes the newest complete step; one more small collective, and the save is acknowledged -- so by
   then every node dropped what the step supersedes.

Recovery does not trust ``complete.json``: it checks the copies themselves, so a step killed between 3
and 4 on some node is still found whole.  The marker is what retention keeps by.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.local_disk import error_from_message
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.io.transfer import DirectoryMove, move_directories
from shardkit.checkpoint.training.hot.copies import write_copy
from shardkit.checkpoint.training.hot.local_keep import remove_copy, retain_local
from shardkit.checkpoint.training.hot.nodes import COMPLETE_NAME, NodeLayout, copy_name
from shardkit.checkpoint.training.run_steps import step_dir
from shardkit.data.resume import InputSnapshot
from shardkit.errors import CheckpointError, ShardkitError, error_record, from_record
from shardkit.wire.collectives import raise_any_failure

__all__ = ["HotSave", "run_hot_save"]

log = logging.getLogger(__name__)


@dataclass
class HotSave:
    """Everything a hot save needs once the state was taken (or copied to host): safe to run in the
    background while training goes on."""

    step: int
    save_id: str
    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    inputs: dict[str, Any]
    structure: str
    meta: dict[str, Any]
    local_keep: int
    deferred: InputSnapshot | None = None  # the RNG state taken at the save, gathered over the ranks here


def _own_copy(layout: NodeLayout, rank: int, job: HotSave) -> str:
    return os.path.join(layout.node_dir(rank), step_dir(job.step), copy_name("rank", rank, job.save_id))


def _replica(layout: NodeLayout, holder: int, of_rank: int, job: HotSave) -> str:
    return os.path.join(layout.node_dir(holder), step_dir(job.step), copy_name("replica", of_rank, job.save_id))


def run_hot_save(layout: NodeLayout, job: HotSave, group: Any = None) -> float:
    """Steps 1-4 of the module docstring on every rank of ``group`` (collective); the seconds it took.
    Raises on every rank when any rank failed, naming it."""
    started = time.perf_counter()
    dist = Dist(group)
    rank = dist.rank
    error = None
    hot = {"step": job.step, "save_id": job.save_id, "rank": rank, "world_size": layout.world_size,
           "structure": job.structure}
    mine = _own_copy(layout, rank, job)
    try:
        inputs = job.inputs if job.deferred is None else {**job.inputs, **job.deferred.gathered(group)}
        write_copy(mine, job.tensors, job.values, inputs, hot, job.meta)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the replication below
        error = exc
    moves = [DirectoryMove(src=r, source_dir=_own_copy(layout, r, job), dst=holder,
                           target_dir=_replica(layout, holder, r, job))
             for r in range(layout.world_size) for holder in layout.replica_holders(r)]
    # phase "replicate"; every rank's outcome goes into the vote below, so the move need not confirm its commits
    results = move_directories(moves, group=group, confirm=False) if moves else []
    if error is None:
        failed = [res for res in results if not res.ok]
        if failed:
            error = error_from_message(f"hot save of step {job.step}: replication failed: {failed[0].error}")
    dist.phase = "vote"
    votes = dist.all_gather_json({"error": None if error is None else error_record(error), "save_id": job.save_id})
    first = next(((r, v["error"]) for r, v in enumerate(votes) if v["error"] is not None), None)
    if first is None and any(v["save_id"] != job.save_id for v in votes):
        error = CheckpointError(f"hot save of step {job.step}: the ranks named it differently ("
                                f"{sorted({v['save_id'] for v in votes})}); every rank must call save the same times")
        first = (rank, error_record(error))
    if first is not None:
        _remove_this_save(layout, rank, job)
        if error is not None:
            raise error
        raise from_record(first[1], f"hot save of step {job.step} failed on rank {first[0]}: {first[1]['message']}")
    marker_error = None
    if layout.is_node_leader(rank):
        try:
            marker_dir = Storage(os.path.join(layout.node_dir(rank), step_dir(job.step)))
            marker_dir.put_atomic(COMPLETE_NAME, json.dumps({"step": job.step, "save_id": job.save_id,
                                                           "world_size": layout.world_size}).encode())
        except Exception as exc:  # noqa: BLE001 - every rank learns of it below
            marker_error = exc
        else:
            try:
                retain_local(layout.node_dir(rank), job.step, job.save_id, job.local_keep)
            except (OSError, ShardkitError) as exc:  # housekeeping: never fail a complete save over it
                log.warning("hot tier retention in %s failed: %s", layout.node_dir(rank), exc)
    # Acknowledged only once every node recorded the step and removed what it replaces (an abandoned
    # history above it): a kill after this never brings back a step this save superseded.
    raise_any_failure(dist.first_error, marker_error,
                      lambda failed, text: f"hot save of step {job.step}: recording it complete failed on rank "
                                           f"{failed}: {text}")
    seconds = time.perf_counter() - started
    log.info("rank %d: hot step %d complete in %s (own copy and %d replica(s)) in %.3f s", rank, job.step,
             layout.node_dir(rank), layout.replicas, seconds)
    return seconds


def _remove_this_save(layout: NodeLayout, rank: int, job: HotSave) -> None:
    """A failed save's own directories on this rank (never complete, never anyone else's)."""
    for path in [_own_copy(layout, rank, job)] + [_replica(layout, rank, r, job) for r in layout.replicated_here(rank)]:
        remove_copy(path)

