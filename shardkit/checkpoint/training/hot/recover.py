"""Recovery from the hot tier: the ranks agree on the newest step they can assemble from verified copies.

1. **Report.**  Each rank reads the manifests of the copies it keeps -- its own ``rank-<r>`` and the
   ``replica-<q>`` it holds for other nodes -- and the ranks exchange the reports with the structure each
   rank's state has now (one JSON all-gather).  A copy whose manifest cannot be read is reported as such.
2. **Choose.**  Every rank computes the same answer from the same reports: the newest (step, save) at or
   above ``at_least`` (the newest durable step) saved by this world size, for which every rank has a copy
   of its own layout that was not found bad.  Each rank's source is its own copy when it has one, else the
   replica on the nearest node.
3. **Fetch.**  A rank without a usable copy of its own receives one from its replica holder over the
   process group (:func:`~shardkit.checkpoint.io.transfer.move_directories`) into ``fetched-<r>...``.
4. **Check, then agree.**  Each rank reads and checks every byte of its copy (checksums, sizes, keys,
   shapes) without writing any target; the ranks exchange what failed.  A rank checks its own newest copy
   before step 1 already and reports the outcome with it, so when every rank's source is such a checked
   own copy (a recovery from the local tier) step 2 alone settles it, with no second exchange.  A failed
   copy is marked bad, named in the log with the reason, and step 2 runs again -- the next copy of that
   rank, then an older step -- until every rank's copy checks out, or no hot step is left (the caller then
   loads the durable root).

Nothing here writes a target: the caller applies the checked copies once this returns.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.io.transfer import DirectoryMove, move_directories
from shardkit.checkpoint.io.transfer_files import list_directory
from shardkit.checkpoint.training.hot.copies import copy_meta
from shardkit.checkpoint.training.hot.flat import MANIFEST_NAME
from shardkit.checkpoint.training.hot.local_keep import remove_copy
from shardkit.checkpoint.training.hot.nodes import NodeLayout, copy_name, parse_copy_name
from shardkit.checkpoint.training.run_steps import step_dir, step_of_dir
from shardkit.errors import ShardkitError

__all__ = ["Recovered", "recover", "hot_reports"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Recovered(Generic[T]):
    """The agreed step: its number and save, whether any rank needed a peer's copy, this rank's copy
    (checked, ready to apply) and where it came from."""

    step: int
    save_id: str
    source: str          # "local" | "peer"
    opened: T
    path: str
    fetched: bool
    meta: dict[str, Any]

    def done(self) -> None:
        """Remove a copy fetched from a peer (the next save writes this node's own copy again)."""
        if self.fetched:
            remove_copy(self.path)


def hot_reports(layout: NodeLayout, rank: int) -> list[dict[str, Any]]:
    """Step 1 for this rank: one entry per copy it keeps (see the module docstring)."""
    node_dir = layout.node_dir(rank)
    kept = {("rank", rank)} | {("replica", q) for q in layout.replicated_here(rank)}
    reports = []
    node = Storage(node_dir)
    for step_name in node.listdir():
        if step_of_dir(step_name) is None or not node.is_dir(step_name):
            continue
        step = node.child(step_name)
        for name in step.listdir():
            parsed = parse_copy_name(name)
            if parsed is None or (parsed.kind, parsed.rank) not in kept:
                continue
            path = step.child(name).url
            entry: dict[str, Any] = {"path": path, "holder": rank, "of": parsed.rank, "save_id": parsed.save_id}
            try:
                entry["files"] = list_directory(path, MANIFEST_NAME)  # what a fetch of it sends, listed once here
                hot = copy_meta(path)["hot"]
                entry.update(step=hot["step"], world_size=hot["world_size"], structure=hot["structure"])
                if hot["rank"] != parsed.rank or hot["save_id"] != parsed.save_id:
                    entry["bad"] = f"its manifest says rank {hot['rank']}, save {hot['save_id']}"
            except (ShardkitError, OSError) as exc:
                entry["bad"] = str(exc)
            reports.append(entry)
    return reports


def _choose(entries: list[dict[str, Any]], structures: list[str], world_size: int, at_least: int,
            bad: set[str]) -> tuple[int, str, dict[int, dict[str, Any]]] | None:
    """Step 2: the newest complete (step, save) and each rank's source copy, or ``None``."""
    by_save: dict[tuple[int, str], dict[int, list[dict[str, Any]]]] = {}
    for e in entries:
        if "bad" in e or e["path"] in bad or e["world_size"] != world_size or e["step"] < at_least:
            continue
        if e["structure"] != structures[e["of"]]:
            continue
        by_save.setdefault((e["step"], e["save_id"]), {}).setdefault(e["of"], []).append(e)
    for (step, save_id), held in sorted(by_save.items(), reverse=True):
        if len(held) == world_size:
            return step, save_id, {q: min(copies, key=lambda e: (e["holder"] != q, (e["holder"] - q) % world_size))
                                   for q, copies in held.items()}
    return None


def _explain(entries: list[dict[str, Any]], structures: list[str], world_size: int) -> None:
    """Which copies cannot be used at all and why (rank 0 says it once for all ranks)."""
    for e in entries:
        if "bad" in e:
            log.warning("hot tier: skipping %s (kept by rank %d): %s", e["path"], e["holder"], e["bad"])
    usable = [e for e in entries if "bad" not in e]
    other = sorted({(e["step"], e["world_size"]) for e in usable if e["world_size"] != world_size})
    if other:
        log.warning("hot tier: steps %s were saved by %s ranks; this job has %d, so they are not used (a job on "
                    "another number of ranks resumes from the durable root)", ", ".join(str(s) for s, _ in other),
                    ", ".join(sorted({str(w) for _, w in other})), world_size)
    mesh = sorted({e["step"] for e in usable
                   if e["world_size"] == world_size and e["structure"] != structures[e["of"]]})
    if mesh:
        log.warning("hot tier: steps %s were saved for another layout of the model (mesh, placements or shapes); "
                    "they are not used (such a job resumes from the durable root)", ", ".join(map(str, mesh)))


def _check_own_newest(reports: list[dict[str, Any]], rank: int, world_size: int, structure: str, at_least: int,
                      open_copy: Callable[[str], T]) -> tuple[str, T] | None:
    """Before the vote: read and check this rank's own newest usable copy -- the one a recovery from the
    local tier takes -- and say in its report whether it checked out (``checked``) or why not (``bad``).
    When every rank's chosen source was checked so, the ranks agree from the reports alone (no second
    collective); otherwise the copy opened here is used or discarded in step 4."""
    own = [e for e in reports if e["holder"] == rank and e["of"] == rank and "bad" not in e
           and e["world_size"] == world_size and e["structure"] == structure and e["step"] >= at_least]
    if not own:
        return None
    newest = max(own, key=lambda e: (e["step"], e["save_id"]))
    try:
        opened = open_copy(newest["path"])
    except Exception as exc:  # noqa: BLE001 - reported as this copy's damage, as step 4 would
        newest["bad"] = f"{type(exc).__name__}: {exc}"
        return None
    newest["checked"] = True
    return newest["path"], opened


def recover(layout: NodeLayout, structure: str, open_copy: Callable[[str], T], discard: Callable[[T], None], *,
            at_least: int = 0, group: Any = None) -> Recovered[T] | None:
    """Steps 1-4 of the module docstring (collective); ``None`` when no hot step qualifies.

    ``open_copy(path)`` reads and checks one copy for this rank without writing a target (raising when it
    is damaged or does not fit: any exception marks the copy bad); ``discard`` drops an opened
    copy that another rank's failure made unusable."""
    dist = Dist(group)
    dist.phase = "vote"  # which step every rank can assemble; then each rank reads its copy
    rank = dist.rank
    try:
        reports = hot_reports(layout, rank)
    except OSError as exc:  # an unreadable directory holds no usable copy; every rank must still gather
        log.warning("hot tier: cannot list %s (%s); its copies are not used", layout.node_dir(rank), exc)
        reports = []
    early = _check_own_newest(reports, rank, layout.world_size, structure, at_least, open_copy)
    gathered = dist.all_gather_json({"reports": reports, "structure": structure, "nonce": uuid.uuid4().hex[:6]})
    entries = [e for g in gathered for e in g["reports"]]
    structures = [g["structure"] for g in gathered]
    if rank == 0:
        _explain(entries, structures, layout.world_size)
    bad: set[str] = set()
    for attempt in range(len(entries) + 1):
        chosen = _choose(entries, structures, layout.world_size, at_least, bad)
        if chosen is None:
            if early is not None:
                discard(early[1])
            if entries and rank == 0:
                log.warning("hot tier: %d copies found, but no step at or above %d that every rank can assemble "
                            "from verified copies", len(entries), at_least)
            return None
        step, save_id, sources = chosen
        token = f"{gathered[0]['nonce']}{attempt % 256:02x}"  # the same on every rank, new for every recovery
        fetch_dir = os.path.join(layout.node_dir(rank), step_dir(step), copy_name("fetched", rank, save_id, token))
        moves = [DirectoryMove(src=e["holder"], source_dir=e["path"], dst=q,
                               target_dir=os.path.join(layout.node_dir(q), step_dir(step),
                                                       copy_name("fetched", q, save_id, token)))
                 for q, e in sorted(sources.items()) if e["holder"] != q]
        # a receiver's outcome is all it needs (the check below tells every rank): no confirming collective
        # and the listings came with the reports: the move needs no exchange of its own before the bytes
        listed = [sources[m.dst]["files"] for m in moves]
        failures = {res.move.source_dir: res.error for res in move_directories(moves, group=group, confirm=False,
                                                                               listings=listed)
                    if not res.ok} if moves else {}
        mine = sources[rank]
        path = mine["path"] if mine["holder"] == rank else fetch_dir
        opened, meta, problem = None, None, failures.get(mine["path"]) if mine["holder"] != rank else None
        if early is not None and early[0] == path:
            opened, early = early[1], None  # checked before the vote
        elif early is not None:
            discard(early[1])
            early = None
        if problem is None:
            try:
                meta = copy_meta(path)
                opened = open_copy(path) if opened is None else opened
            except Exception as exc:  # noqa: BLE001 - any failure makes this copy unusable; every rank must learn it
                problem = f"{type(exc).__name__}: {exc}"
        if attempt == 0 and not moves and all(e.get("checked") for e in sources.values()):
            failed = []  # every rank's source was checked before the vote and reported so: nothing left to agree on
        else:
            reported = dist.all_gather_json(None if problem is None else {"path": sources[rank]["path"],
                                                                          "why": problem})
            failed = [r for r in reported if r is not None]
        if not failed:
            source = "local" if all(e["holder"] == q for q, e in sources.items()) else "peer"
            used = ", ".join(f"rank {q} from rank {e['holder']}'s {os.path.basename(e['path'])}"
                             for q, e in sorted(sources.items()))
            if rank == 0:
                log.info("hot tier: step %d (%s) assembled from %s", step, source, used)
            return Recovered(step, save_id, source, opened, path, mine["holder"] != rank, meta)
        if opened is not None:
            discard(opened)
        if mine["holder"] != rank:
            remove_copy(fetch_dir)
        for f in failed:
            bad.add(f["path"])
            log.warning("hot tier: not using %s for step %d: %s; trying the next copy", f["path"], step, f["why"])
    return None  # pragma: no cover - every attempt marks a copy bad, so the loop ends in a return above
