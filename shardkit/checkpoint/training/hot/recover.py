"""Recovery from the hot tier: the ranks agree on the newest step they can assemble from verified copies.

1. **Report.**  Each rank reads the manifests of the copies it keeps -- its own ``rank-<r>`` and the
   ``replica-<q>`` it holds for other nodes -- and the ranks exchange the reports with the structure each
   rank's state has now (one JSON all-gather).  A copy whose manifest cannot be read is reported as such.
2. **Choose.**  Every rank computes the same answer from the same reports: the newest (step, save) at or
   above ``at_least`` (the newest durable step) saved by this world size, for which every rank has a copy
   of its own layout that was not found bad.  Each rank's source is its own copy when it has one, else the
   replica on the nearest node.
3. **Fetch.**  A rank without a usable copy of its own receives one from its replica holder over the
   process group (:class:`~.fetch.PeerFetch`): its manifest first, then -- once the ranks agreed -- its
   bytes straight into the targets, every tensor's crc32c checked as its bytes arrive; nothing is written
   to any disk (the next save writes this node's copy again).
4. **Check, then agree.**  Before step 1 each rank checks its own newest copy as far as it can without
   writing a target -- manifest, keys, dtypes and shapes against its state, the input state read and
   checked, whether that input state can be restored as asked -- and says so in its report.  When every
   rank's chosen source is such a copy of its own (a recovery from the local tier), the reports settle it:
   every rank reads its copy straight into its targets, every byte's crc32c checked as it lands (one pass,
   :meth:`~.flat.PendingCopy.fill`), applies the rest of the state, and one agreement tells every rank
   whether all of them did.  Otherwise the ranks without a copy fetch theirs (step 3, every byte checked as
   it arrives, no target written), the ranks exchange what failed (holders that could not send included)
   and who refuses, and only then write their targets -- the fetched bytes copied in, an own copy read
   straight in and checked as before -- and agree once more.  A failed copy is marked bad, named
   in the log with the reason, and step 2 runs again -- the next copy of that rank, then an older step --
   until every rank's copy checks out, or no hot step is left (the caller then loads the durable root).
   A refused input state is not damage: once the ranks agreed on the step, before any target is written,
   every rank raises the first refusing rank's error.

**Targets touched.**  A byte found damaged while it was read into the targets (step 4, from the local
tier) leaves the targets written with part of that step: the ranks learn it in the agreement, go on to the
next copy, and the :class:`Recovery` says ``touched`` (the same on every rank) -- its caller must then load
some step whole, or raise: never report "nothing to resume" over a half-written model.

**Rank 0's listing** (``listing=``: the durable root's steps) rides in the exchange of step 1, so a resume
pays one collective for both; a failure there is raised on every rank, as rank 0 raised it.

Collectives: one all-gather and one small agreement for a recovery from the local tier; the all-gather,
a round of transfers (the manifests), one all-gather, a round of transfers (the data, into the targets) and
one agreement for a recovery from peers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import torch

from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.training.hot.copies import checked_meta, is_input_key
from shardkit.checkpoint.training.hot.fetch import PeerFetch, Pull, Received
from shardkit.checkpoint.training.hot.flat import (
    FlatCopy,
    PendingCopy,
    open_pending,
    read_manifest,
)
from shardkit.checkpoint.training.hot.nodes import NodeLayout
from shardkit.checkpoint.training.hot.reports import choose_step, explain_unusable, hot_reports
from shardkit.errors import CorruptCheckpoint, error_record, from_record
from shardkit.wire.collectives import raise_any_failure

__all__ = ["Recovered", "Recovery", "Steps", "recover"]

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


@dataclass
class Recovery(Generic[T]):
    """What :func:`recover` found (``None``: no hot step), rank 0's ``listing()`` on every rank (``None``
    without one), and whether a failed attempt wrote targets (see the module docstring; every rank agrees)."""

    found: Recovered[T] | None
    listed: Any
    touched: bool


@dataclass(frozen=True)
class Steps:
    """The hooks :func:`recover` runs on an opened copy: ``fill`` reads a pending copy into the targets
    (raising for damage: the copy is bad, the targets touched), ``apply`` writes the rest of the state
    (raising: the resume fails on every rank), ``discard`` drops an opened copy that is not used,
    ``receive`` runs the second round of a fetch on every rank (:meth:`~.fetch.PeerFetch.data`), a peer's
    copy received straight into its targets (its problem then raised by ``fill``)."""

    fill: Callable[[Any], None]
    apply: Callable[[Any], None]
    discard: Callable[[Any], None]
    receive: Callable[[Any, PeerFetch], None]


def _check_own_newest(reports: list[dict[str, Any]], rank: int, world_size: int, structure: str, at_least: int,
                      manifests: dict[str, dict[str, Any]], open_copy: Callable[[FlatCopy | PendingCopy], T],
                      refusal: Callable[[T], BaseException | None] | None) -> _Opened[T] | None:
    """Before the vote: check this rank's own newest usable copy -- the one a recovery from the local tier
    takes -- as far as it can without writing a target (its input state read and checked, the rest of its
    bytes left for :meth:`~.flat.PendingCopy.fill`), and say in its report whether it checked out
    (``checked``, and ``refused`` when its input state cannot be restored as asked) or why not (``bad``)."""
    own = [e for e in reports if e["holder"] == rank and e["of"] == rank and "bad" not in e
           and e["world_size"] == world_size and e["structure"] == structure and e["step"] >= at_least]
    if not own:
        return None
    newest = max(own, key=lambda e: (e["step"], e["save_id"]))
    path = newest["path"]
    found = _open(newest, lambda: open_pending(path, manifests.get(path) or read_manifest(path), is_input_key),
                  open_copy, refusal)
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


def _open(entry: dict[str, Any], read: Callable[[], FlatCopy | PendingCopy],
          open_copy: Callable[[FlatCopy | PendingCopy], T],
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


def recover(layout: NodeLayout, structure: str, open_copy: Callable[[FlatCopy | PendingCopy], T], steps: Steps, *,
            at_least: int = 0, group: Any = None, refusal: Callable[[T], BaseException | None] | None = None,
            listing: Callable[[], list[int]] | None = None, where: str = "") -> Recovery[T]:
    """Steps 1-4 of the module docstring (collective).

    ``open_copy(copy)`` checks one copy against this rank's state without writing a target (a read one, every
    byte's crc32c checked; or a pending one, its manifest and input state) and raises when it does not fit:
    any exception marks the copy bad.  ``refusal(opened)``: why this rank cannot take the state of a copy
    that is sound (input state that cannot be restored as asked) -- not damage, so it is raised on every
    rank (the first refusing rank's error) once the ranks agreed on the step, before any target is written.
    ``steps``: writing an opened copy into the targets (:class:`Steps`).  ``listing``: run on rank 0 and
    its answer handed to every rank (:attr:`Recovery.listed`); the newest step it lists is the ``at_least``
    (a failure there raised on every rank, naming ``where``)."""
    dist = Dist(group)
    dist.phase = "vote"  # which step every rank can assemble; then each rank reads its copy
    rank = dist.rank
    manifests: dict[str, dict[str, Any]] = {}
    try:
        reports = hot_reports(layout, rank, manifests=manifests)
    except OSError as exc:  # an unreadable directory holds no usable copy; every rank must still gather
        log.warning("hot tier: cannot list %s (%s); its copies are not used", layout.node_dir(rank), exc)
        reports = []
    early = _check_own_newest(reports, rank, layout.world_size, structure, at_least if listing is None else 0,
                              manifests, open_copy, refusal)
    listed, failure = None, None
    if listing is not None and rank == 0:
        try:
            listed = {"value": listing()}
        except Exception as exc:  # noqa: BLE001 - sent to every rank, then re-raised as it was
            failure, listed = exc, {"error": error_record(exc)}
    gathered = dist.all_gather_json({"reports": reports, "structure": structure, "listed": listed})
    if listing is not None:
        listed = gathered[0]["listed"]
        if "error" in listed:
            if early is not None:
                steps.discard(early.opened)
            if failure is not None:
                raise failure
            raise from_record(listed["error"], f"rank 0 failed under {where}: {listed['error']['message']}")
        listed = listed["value"]
        at_least = max(listed, default=0)
    entries = [e for g in gathered for e in g["reports"]]
    structures = [g["structure"] for g in gathered]
    if rank == 0:
        explain_unusable(entries, structures, layout.world_size)
    bad: set[str] = set()
    touched = False
    for attempt in range(len(entries) + 1):
        chosen = choose_step(entries, structures, layout.world_size, at_least, bad)
        if chosen is None:
            if early is not None:
                steps.discard(early.opened)
            if entries and rank == 0:
                log.warning("hot tier: %d copies found, but no step at or above %d that every rank can assemble "
                            "from verified copies", len(entries), at_least)
            return Recovery(None, listed, touched)
        step, save_id, sources = chosen
        mine = sources[rank]
        found: _Opened[T] | str | None = None
        if early is not None and early.path == mine["path"]:
            found = early  # checked before the vote
        elif early is not None:
            steps.discard(early.opened)
        early = None
        if attempt == 0 and all(e["holder"] == q and e.get("checked") for q, e in sources.items()):
            # every rank's source was checked before the vote and reported so: read straight into the targets
            assert isinstance(found, _Opened)
            _raise_refusals(step, found, [e.get("refused") for _, e in sorted(sources.items())], steps)
            failed = _fill_apply_and_agree(dist, step, mine["path"], found, steps)
            if not failed:
                return Recovery(_recovered(step, save_id, sources, found, mine, rank), listed, touched)
            touched = True
        else:
            found, failed, refusals, fetch = _fetch_and_agree(dist, sources, found, manifests, open_copy, refusal,
                                                              group)
            if not failed:
                assert isinstance(found, _Opened)
                _raise_refusals(step, found, refusals, steps)
                if fetch is not None:  # every rank: the peers' data, received straight into the targets
                    steps.receive(found.opened, fetch)
                failed = _fill_apply_and_agree(dist, step, mine["path"], found, steps)
                if not failed:
                    return Recovery(_recovered(step, save_id, sources, found, mine, rank), listed, touched)
                touched = True
            elif isinstance(found, _Opened):
                steps.discard(found.opened)
        dist.phase = "vote"
        for f in failed:
            bad.add(f["path"])
            log.warning("hot tier: not using %s for step %d: %s; trying the next copy", f["path"], step, f["why"])
    return Recovery(None, listed, touched)  # pragma: no cover - every attempt marks a copy bad


def _recovered(step: int, save_id: str, sources: dict[int, dict[str, Any]], found: _Opened[T],
               mine: dict[str, Any], rank: int) -> Recovered[T]:
    source = "local" if all(e["holder"] == q for q, e in sources.items()) else "peer"
    if rank == 0:
        used = ", ".join(f"rank {q} from rank {e['holder']}'s {os.path.basename(e['path'])}"
                         for q, e in sorted(sources.items()))
        log.info("hot tier: step %d (%s) assembled from %s", step, source, used)
    return Recovered(step, save_id, source, found.opened, mine["path"], found.meta)


def _raise_refusals(step: int, found: _Opened[T], refusals: list[Any], steps: Steps) -> None:
    """A sound copy whose input state cannot be restored as asked: raised on every rank (no target written)."""
    if any(refusals):
        steps.discard(found.opened)
        raise_any_failure(lambda _: next((q, r) for q, r in enumerate(refusals) if r), found.refused,
                          lambda q, text: f"resuming hot step {step} failed on rank {q}: {text}")


def _fill_apply_and_agree(dist: Dist, step: int, path: str, found: _Opened[T], steps: Steps) -> list[dict[str, str]]:
    """Every rank reads its own copy into its targets and applies the rest; one agreement.  The copies found
    damaged on the way (every rank's list the same; their targets touched), or raises on every rank the
    first error of an apply."""
    why, problem = None, None
    try:
        steps.fill(found.opened)
    except Exception as exc:  # noqa: BLE001 - the copy is bad; every rank learns of it below
        why = f"{type(exc).__name__}: {exc}"
    if why is None:
        try:
            steps.apply(found.opened)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it below
            problem = exc
    else:
        steps.discard(found.opened)
    dist.phase = "read"
    if not dist.any_failed(why is not None or problem is not None):
        return []
    reported = dist.all_gather_json({"path": path, "why": why,
                                     "error": None if problem is None else error_record(problem)})
    first = next(((q, r["error"]) for q, r in enumerate(reported) if r["error"] is not None), None)
    if first is not None:
        if problem is not None:
            raise problem
        raise from_record(first[1], f"resuming hot step {step} failed on rank {first[0]}: {first[1]['message']}")
    return [{"path": r["path"], "why": r["why"]} for r in reported if r["why"] is not None]


def _fetch_and_agree(dist: Dist, sources: dict[int, dict[str, Any]], found: _Opened[T] | None,
                     manifests: dict[str, dict[str, Any]], open_copy: Callable[[FlatCopy | PendingCopy], T],
                     refusal: Callable[[T], BaseException | None] | None,
                     group: Any) -> tuple[_Opened[T] | str, list[dict[str, str]], list[Any], PeerFetch | None]:
    """Steps 3 and 4 for a choice the reports alone do not settle: the ranks without a copy of their own
    receive their holders' manifests (the first round of :class:`~.fetch.PeerFetch`), every other rank checks
    its own copy as before the vote (unless it did then: ``found``), and one exchange tells every rank what
    failed -- a copy that did not check out, a holder that could not send -- and which rank refuses the
    input state.  No target is written; the data follow (:func:`_receive`) once nothing failed."""
    rank = dist.rank
    mine = sources[rank]
    pulls = [Pull(e["holder"], e["path"], q, [(str(n), int(size)) for n, size in e["files"]])
             for q, e in sorted(sources.items()) if e["holder"] != q]
    fetch = PeerFetch(pulls, group) if pulls else None
    received = fetch.manifests() if fetch is not None else None
    opened: _Opened[T] | str
    if found is not None:
        opened = found
    elif mine["holder"] != rank:
        assert received is not None
        opened = received.problem if received.problem is not None else _open(
            mine, lambda: _remote(received, mine["path"]), open_copy, refusal)
    else:
        path = mine["path"]
        opened = _open(mine, lambda: open_pending(path, manifests.get(path) or read_manifest(path), is_input_key),
                       open_copy, refusal)
    refused = opened.refused if isinstance(opened, _Opened) else None
    reported = dist.all_gather_json({"path": mine["path"], "why": opened if isinstance(opened, str) else None,
                                     "refused": None if refused is None else error_record(refused),
                                     "sends": fetch.failed_sends if fetch is not None else {}})
    failed = [{"path": r["path"], "why": r["why"]} for r in reported if r["why"] is not None]
    failed += [{"path": path, "why": why} for r in reported for path, why in r["sends"].items()
               if path not in {f["path"] for f in failed}]
    return opened, failed, [r["refused"] for r in reported], fetch


def _remote(received: Received, path: str) -> PendingCopy:
    """A peer's copy as its manifest describes it, its tensors to arrive in the fetch's second round (the
    input state's into tensors of their own, placeholders until then: a refusal looks only at their
    structure)."""
    manifest = received.manifest
    entries = {e.key: e for e in received.entries}
    small = {key: torch.empty(e.shape, dtype=e.dtype) for key, e in entries.items() if is_input_key(key)}
    return PendingCopy(path, manifest["meta"], small, manifest["values"], entries, manifest["size"], remote=True)
