"""Retention under a ``CheckpointManager`` root: which steps go once a newer one has committed.

Kept apart from the manager because it is the one place that deletes committed checkpoints, and
each rule that lets it is here: ``keep_last`` counts only this run's steps, a superseded step goes
only after the step that supersedes it committed, a step another kept checkpoint reads from stays,
and nothing shardkit did not write is ever removed.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from shardkit.checkpoint.formats import foreign_kind
from shardkit.checkpoint.formats.native import MANIFEST_NAME, DirectorySurvey, references_of, remove_owned, survey
from shardkit.checkpoint.io.names import is_sibling_name
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.run_steps import (
    RunSteps,
    committed_at,
    in_force,
    is_step_dir,
    read_superseded,
    step_dirs,
    write_superseded,
)
from shardkit.errors import UnknownReferences

__all__ = ["retain"]

log = logging.getLogger(__name__)


def retain(root: Storage, committed: int, *, run: RunSteps, keep_last: int | None, pending: int | None,
       warn_once: Callable[[str], None]) -> None:
    """After step ``committed`` landed under ``root``: remove this run's steps beyond ``keep_last``, steps
    an ``overwrite=True`` run superseded, and interrupted shardkit saves below the newest step.

    Only what :func:`~shardkit.checkpoint.formats.native.ownership.survey` proves shardkit wrote is
    deleted, a step's manifest first; foreign step directories, and committed steps that are not this
    run's (:meth:`RunSteps.owns`), are named in a warning and left alone.  ``pending``: a step whose
    save is in flight.  Runs on one rank.
    """
    dirs = step_dirs(root)
    on_disk = [s for s, name in sorted(dirs.items()) if root.child(name).exists(MANIFEST_NAME)]
    recorded = read_superseded(root)
    records = {old: rec for old, rec in recorded.items() if old != committed}  # saved again: this run's now
    superseded = in_force(root, dirs, records) & set(on_disk)
    staying = [s for s in on_disk if s not in superseded]
    ours = [s for s in staying if run.owns(s)]
    if len(ours) < len(staying):
        warn_once(f"retention leaves steps {', '.join(str(s) for s in staying if s not in ours)} under "
                        f"{root.url} alone: this manager did not write them or resume from them (an "
                        f"earlier run's); resume from them, or remove them yourself")
    newest = max(staying, default=committed)
    doomed = {s for s in ours[:-keep_last] if s != newest} if keep_last is not None else set()
    doomed |= superseded
    surveys: dict[int, DirectorySurvey] = {}
    for s in sorted(dirs):
        if s in on_disk or s >= newest or s == pending:
            continue
        found = surveys[s] = survey(root.child(dirs[s]))
        if found.interrupted_save:
            doomed.add(s)
        elif found.foreign:
            warn_once(f"left alone {found.describe(foreign_kind(found.foreign))}: the checkpoint manager only "
                            f"deletes what it wrote; move or delete it yourself")
    pinned = _pinned(root, {s: dirs[s] for s in on_disk}, doomed, warn_once)
    if pinned is None:
        return
    for s in sorted(doomed):
        if dirs[s] in pinned:
            log.info("retention keeps %s: a step it keeps reads data files from it", dirs[s])
            continue
        step_store = root.child(dirs[s])
        found = surveys[s] if s in surveys else survey(step_store)
        remove_owned(step_store, found)
        log.info("%s step %d at %s", "removed superseded" if s in superseded else "retention removed", s,
                 step_store.url)
        if found.foreign:
            warn_once(f"kept files shardkit did not write in {found.describe(foreign_kind(found.foreign))} after "
                      f"removing step {s}")
    if recorded:  # forget what retention removed; a superseded step kept for a reference stays recorded
        left = step_dirs(root)
        write_superseded(root, {old: rec for old, rec in records.items()
                                if old in superseded and committed_at(root, left, old)})


def _pinned(root: Storage, committed: Mapping[int, str], doomed: set[int],
            warn_once: Callable[[str], None]) -> set[str] | None:
    """The directories under ``root`` whose data a staying checkpoint reads -- a kept step, one kept
    for it, or any other checkpoint beside the steps (``save(..., reuse_from=<a step>)`` to
    ``<root>/best``); a directory whose manifest is gone counts too (its data files are what is
    read) -- or ``None`` when a staying manifest cannot be read, so nothing may go this time."""
    by_dir = {name: s for s, name in committed.items()}
    others = [name for name in root.listdir()
              if not is_step_dir(name) and is_sibling_name(name) and root.is_dir(name)]
    pinned: set[str] = set()
    todo = [name for s, name in committed.items() if s not in doomed] + others
    while todo:
        try:
            refs = references_of(root.child(todo.pop()))
        except UnknownReferences as exc:
            warn_once(f"retention deletes no step this time: {exc}")
            return None
        for name in set(refs) - pinned:
            pinned.add(name)
            if name in by_dir:
                todo.append(name)
    return pinned
