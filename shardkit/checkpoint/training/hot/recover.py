"""Recovery from the hot tier: the ranks agree on the newest step they can assemble from verified copies.

1. **Report.**  Each rank reads the manifests of the copies it keeps -- its own ``rank-<r>`` and the
   ``replica-<q>`` it holds for other nodes -- and the ranks exchange the reports with the structure each
   rank's state has now (one JSON all-gather).  A copy whose manifest cannot be read is reported as such.
2. **Choose.**  Every rank computes the same answer from the same reports: the newest (step, save) at or
   above ``at_least`` (the newest durable step) saved by this world size, for which every rank has a copy
   of its own layout that was not found bad.  Each rank's source is its own copy when it has one, else the
   replica on the nearest node.
3. **Fetch.**  A rank without a usable copy of its own receives one from its replica holder over the
   process group straight into memory (:func:`~.fetch.fetch_copies`), every tensor's crc32c checked as
   its bytes arrive; nothing is written to any disk (the next save writes this node's copy again).
4. **Check, then agree.**  Each rank reads and checks every byte of its copy (checksums, sizes, keys,
   shapes) without writing any target, and asks the caller whether it can take the copy's input state as
   asked; the ranks exchange what failed (one all-gather, holders that could not send included).  A rank
   checks its own newest copy before step 1 already and reports the outcome with it, so when every rank's
   source is such a checked own copy (a recovery from the local tier) step 2 alone settles it, with no
   second exchange.  A failed copy is marked bad, named in the log with the reason, and step 2 runs again
   -- the next copy of that rank, then an older step -- until every rank's copy checks out, or no hot step
   is left (the caller then loads the durable root).  A refused input state is not damage: once the ranks
   agreed on the step, every rank raises the first refusing rank's error.

Nothing here writes a target: the caller applies the checked copies once this returns.  Collectives: one
all-gather for a recovery from the local tier; the all-gather, one round of transfers and one all-gather
for a recovery from peers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.io.transfer_files import list_directory
from shardkit.checkpoint.training.hot.copies import checked_meta
from shardkit.checkpoint.training.hot.fetch import Pull, fetch_copies
from shardkit.checkpoint.training.hot.flat import MANIFEST_NAME, FlatCopy, read_flat, read_manifest
from shardkit.checkpoint.training.hot.nodes import NodeLayout, parse_copy_name
from shardkit.checkpoint.training.run_steps import step_of_dir
from shardkit.errors import CorruptCheckpoint, ShardkitError, error_record
from shardkit.wire.collectives import raise_any_failure

__all__ = ["Recovered", "recover", "hot_reports"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Recovered(Generic[T]):
    """The agreed step: its number and save, whether any rank needed a peer's copy, this rank's copy
    (checked, ready to apply), where it came from (on the rank that holds it) and its manifest's meta."""

    step: int
    save_id: str
    source: str          # "local" | "peer"
    opened: T
    path: str
    meta: dict[str, Any]


def hot_reports(layout: NodeLayout, rank: int, *,
                manifests: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Step 1 for this rank: one entry per copy it keeps (see the module docstring); each readable copy's
    manifest is kept in ``manifests`` by path, so reading the copy later does not read it again."""
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
                manifest = read_manifest(path)
                hot = checked_meta(manifest["meta"], path)["hot"]
                if manifests is not None:
                    manifests[path] = manifest
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
                      manifests: dict[str, dict[str, Any]], open_copy: Callable[[FlatCopy], T],
                      refusal: Callable[[T], BaseException | None] | None) -> _Opened[T] | None:
    """Before the vote: read and check this rank's own newest usable copy -- the one a recovery from the
    local tier takes -- and say in its report whether it checked out (``checked``, and ``refused`` when its
    input state cannot be restored as asked) or why not (``bad``).  When every rank's chosen source was
    checked so, the ranks agree from the reports alone (no second collective); otherwise the copy opened
    here is used or discarded in step 4."""
    own = [e for e in reports if e["holder"] == rank and e["of"] == rank and "bad" not in e
           and e["world_size"] == world_size and e["structure"] == structure and e["step"] >= at_least]
    if not own:
        return None
    newest = max(own, key=lambda e: (e["step"], e["save_id"]))
    found = _open(newest, lambda: read_flat(newest["path"], manifests.get(newest["path"])), open_copy,
                  refusal)
    if isinstance(found, str):
        newest["bad"] = found
        return None
    newest["checked"] = True
    if found.refused is not None:
        newest["refused"] = error_record(found.refused)
    return found


@dataclass
class _Opened(Generic[T]):
    path: str
    opened: T
    meta: dict[str, Any]
    refused: BaseException | None


def _open(entry: dict[str, Any], read: Callable[[], FlatCopy], open_copy: Callable[[FlatCopy], T],
          refusal: Callable[[T], BaseException | None] | None) -> _Opened[T] | str:
    """The copy ``read()`` returns (``entry``'s, as its manifest must say), checked by ``open_copy`` and asked
    for a ``refusal``; or why it cannot be used (any exception makes the copy unusable: every rank must
    learn it)."""
    path = entry["path"]
    try:
        copy = read()
        meta = checked_meta(copy.meta, path)
        said = meta["hot"]
        if (said["step"], said["save_id"], said["rank"]) != (entry["step"], entry["save_id"], entry["of"]):
            raise CorruptCheckpoint(f"{path}: its manifest says step {said['step']}, save {said['save_id']}, rank "
                                    f"{said['rank']}; it was listed as step {entry['step']}, save "
                                    f"{entry['save_id']}, rank {entry['of']}")
        opened = open_copy(copy)
    except Exception as exc:  # noqa: BLE001 - reported as this copy's damage
        return f"{type(exc).__name__}: {exc}"
    return _Opened(path, opened, meta, refusal(opened) if refusal is not None else None)


def recover(layout: NodeLayout, structure: str, open_copy: Callable[[FlatCopy], T], discard: Callable[[T], None], *,
            at_least: int = 0, group: Any = None,
            refusal: Callable[[T], BaseException | None] | None = None) -> Recovered[T] | None:
    """Steps 1-4 of the module docstring (collective); ``None`` when no hot step qualifies.

    ``open_copy(copy)`` checks one copy (read, every byte's crc32c checked) against this rank's state without
    writing a target (raising when it does not fit: any exception marks the copy bad); ``discard`` drops an
    opened copy that another rank's failure made unusable.  ``refusal(opened)``: why this rank cannot take
    the state of a copy that is sound (input state that cannot be restored as asked) -- not damage, so it
    is raised on every rank (the first refusing rank's error) once the ranks agreed on the step."""
    dist = Dist(group)
    dist.phase = "vote"  # which step every rank can assemble; then each rank reads its copy
    rank = dist.rank
    manifests: dict[str, dict[str, Any]] = {}
    try:
        reports = hot_reports(layout, rank, manifests=manifests)
    except OSError as exc:  # an unreadable directory holds no usable copy; every rank must still gather
        log.warning("hot tier: cannot list %s (%s); its copies are not used", layout.node_dir(rank), exc)
        reports = []
    early = _check_own_newest(reports, rank, layout.world_size, structure, at_least, manifests, open_copy, refusal)
    gathered = dist.all_gather_json({"reports": reports, "structure": structure})
    entries = [e for g in gathered for e in g["reports"]]
    structures = [g["structure"] for g in gathered]
    if rank == 0:
        _explain(entries, structures, layout.world_size)
    bad: set[str] = set()
    for attempt in range(len(entries) + 1):
        chosen = _choose(entries, structures, layout.world_size, at_least, bad)
        if chosen is None:
            if early is not None:
                discard(early.opened)
            if entries and rank == 0:
                log.warning("hot tier: %d copies found, but no step at or above %d that every rank can assemble "
                            "from verified copies", len(entries), at_least)
            return None
        step, save_id, sources = chosen
        mine = sources[rank]
        found: _Opened[T] | str | None = None
        if early is not None and early.path == mine["path"]:
            found = early  # checked before the vote
        elif early is not None:
            discard(early.opened)
        early = None
        if attempt == 0 and all(e["holder"] == q and e.get("checked") for q, e in sources.items()):
            # every rank's source was checked before the vote and reported so: nothing left to agree on
            failed, refusals = [], [e.get("refused") for _, e in sorted(sources.items())]
        else:
            found, failed, refusals = _fetch_and_agree(dist, sources, found, manifests, open_copy, refusal, group)
        if not failed:
            assert isinstance(found, _Opened)
            if any(refusals):  # a sound copy whose input state cannot be restored as asked: raised everywhere
                discard(found.opened)
                raise_any_failure(lambda _: next((q, r) for q, r in enumerate(refusals) if r), found.refused,
                                  lambda q, text: f"resuming hot step {step} failed on rank {q}: {text}")
            source = "local" if all(e["holder"] == q for q, e in sources.items()) else "peer"
            used = ", ".join(f"rank {q} from rank {e['holder']}'s {os.path.basename(e['path'])}"
                             for q, e in sorted(sources.items()))
            if rank == 0:
                log.info("hot tier: step %d (%s) assembled from %s", step, source, used)
            return Recovered(step, save_id, source, found.opened, mine["path"], found.meta)
        if isinstance(found, _Opened):
            discard(found.opened)
        for f in failed:
            bad.add(f["path"])
            log.warning("hot tier: not using %s for step %d: %s; trying the next copy", f["path"], step, f["why"])
    return None  # pragma: no cover - every attempt marks a copy bad, so the loop ends in a return above


def _fetch_and_agree(dist: Dist, sources: dict[int, dict[str, Any]], found: _Opened[T] | None,
                     manifests: dict[str, dict[str, Any]], open_copy: Callable[[FlatCopy], T],
                     refusal: Callable[[T], BaseException | None] | None,
                     group: Any) -> tuple[_Opened[T] | str, list[dict[str, str]], list[Any]]:
    """Steps 3 and 4 for a choice the reports alone do not settle: the ranks without a copy of their own
    receive their holders' copies into memory (checked as they arrive), every other rank reads and checks its
    own (unless it did before the vote), and one exchange tells every rank what failed -- a copy that did
    not check out, a holder that could not send -- and which rank refuses the input state."""
    rank = dist.rank
    mine = sources[rank]
    pulls = [Pull(e["holder"], e["path"], q, [(str(n), int(size)) for n, size in e["files"]])
             for q, e in sorted(sources.items()) if e["holder"] != q]
    fetched = fetch_copies(pulls, group) if pulls else None
    if found is None:
        if mine["holder"] != rank:
            copy, problem = fetched.copy, fetched.problem
            found = problem if copy is None else _open(mine, lambda: copy, open_copy, refusal)
        else:
            found = _open(mine, lambda: read_flat(mine["path"], manifests.get(mine["path"])), open_copy, refusal)
    refused = found.refused if isinstance(found, _Opened) else None
    reported = dist.all_gather_json({"path": mine["path"], "why": found if isinstance(found, str) else None,
                                     "refused": None if refused is None else error_record(refused),
                                     "sends": fetched.failed_sends if fetched is not None else {}})
    failed = [{"path": r["path"], "why": r["why"]} for r in reported if r["why"] is not None]
    failed += [{"path": path, "why": why} for r in reported for path, why in r["sends"].items()
               if path not in {f["path"] for f in failed}]
    return found, failed, [r["refused"] for r in reported]
