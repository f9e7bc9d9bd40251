"""Which committed steps under a ``CheckpointManager`` root belong to the run that holds the manager.

A root outlives the jobs that write to it: a restarted job resumes its own steps, but a job that
starts over (it could not load them, or never asked) shares the root with an earlier run's steps.
Those are not the new run's to replace, to leave behind where a resume would choose them, or to
delete by retention.  :class:`RunSteps` keeps what decides it -- the steps this manager committed
in this process, the step it resumed from (and with it the history below), and whether the user
passed ``overwrite=True`` -- and answers the manager's questions.

With ``overwrite=True`` an earlier run's steps above a step this run saves are *superseded*: they
go once that step has committed.  Between the commit and their removal a kill must not let a
resume choose them, so before the save the manager records, in ``superseded.json`` at the root,
each old step with the new step and a token of this manager's run, which the new step's manifest
also carries (``meta.run``).  A recorded step whose superseding step has committed *with that
token* is never resumed from, and retention removes it; a record whose new step never committed
(the save was killed -- an old step of the same number does not count) means nothing and is dropped.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from shardkit.checkpoint.formats.dcp.reader import METADATA_NAME as DCP_METADATA_NAME
from shardkit.checkpoint.formats.native import MANIFEST_NAME, read_manifest
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ShardkitError

__all__ = ["RunSteps", "Supersession", "SUPERSEDED_NAME", "read_superseded", "write_superseded", "in_force",
           "step_dir", "step_dirs", "is_step_dir", "committed_at", "dcp_steps"]

SUPERSEDED_NAME = "superseded.json"

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d{1,19})$")


def step_dir(step: int) -> str:
    """The directory of step ``step`` under a manager's root (zero-padded, so listings sort)."""
    return f"step-{step:010d}"


def is_step_dir(name: str) -> bool:
    return _STEP_RE.match(name) is not None


def step_of_dir(name: str) -> int | None:
    """The step a ``step-<N>`` directory name stands for, or ``None`` for any other name."""
    found = _STEP_RE.match(name)
    return int(found.group(1)) if found else None


def committed_at(root: Storage, dirs: Mapping[int, str], step: int) -> bool:
    """Whether step ``step`` (a directory of ``dirs``) holds a committed checkpoint."""
    return step in dirs and root.child(dirs[step]).exists(MANIFEST_NAME)


def dcp_steps(root: Storage, dirs: Mapping[int, str]) -> set[int]:
    """The steps of ``dirs`` that torch DCP committed (its ``.metadata``, written last): a DCP training loop's
    ``step-<N>``, which ``load_latest(..., from_dcp=NAME)`` resumes from.  Not a step the manager replaces or
    deletes, nor one in a save's way: it is another tool's checkpoint (:func:`committed_at` is for ours)."""
    return {s for s, name in dirs.items() if root.child(name).exists(DCP_METADATA_NAME)}


def step_dirs(root: Storage) -> dict[int, str]:
    """``{step: directory name}`` of every ``step-<N>`` directory under ``root``, committed or not."""
    return {int(m.group(1)): name for name in root.listdir() if (m := _STEP_RE.match(name))}


@dataclass
class RunSteps:
    """What this manager may do with the committed steps under its root."""

    overwrite: bool = False
    written: set[int] = field(default_factory=set)  # committed by this manager, in this process
    resumed: int | None = None                      # the step this manager loaded last
    run: str = field(default_factory=lambda: uuid.uuid4().hex)  # names this manager's steps in a record

    def owns(self, step: int) -> bool:
        """Whether ``step`` is this run's: written here, the resumed step or its history, or anything
        under ``overwrite=True``."""
        return self.overwrite or step in self.written or (self.resumed is not None and step <= self.resumed)

    def in_the_way(self, step: int, committed: Iterable[int]) -> list[int]:
        """Committed steps at or above ``step`` that this manager did not write: saving ``step`` would
        replace one, or leave one above where a resume chooses it over this run's step.  The step this
        manager resumed from may be saved again (it is this run's latest state)."""
        return sorted(s for s in committed if s >= step and s not in self.written and not (s == step == self.resumed))

    def may_replace(self, step: int, in_the_way: list[int]) -> bool:
        """Whether a committed checkpoint found at ``step`` when the save commits may be replaced."""
        return step in self.written or step == self.resumed or (self.overwrite and step in in_the_way)

    def dedup_base(self, step: int, committed: Iterable[int]) -> int | None:
        """The newest committed step below ``step`` that this manager wrote or resumed from: a step it
        has read or written whole, never merely the highest number on disk."""
        known = (self.written | {self.resumed}) - {None}
        return max((s for s in committed if s < step and s in known), default=None)

    def refusal(self, step: int, in_the_way: list[int], root_url: str) -> str:
        shown = ", ".join(map(str, in_the_way[:8])) + (", ..." if len(in_the_way) > 8 else "")
        above = [s for s in in_the_way if s > step]
        harm = (["replace step {}".format(step)] if step in in_the_way else []) + \
               ([f"leave {'it' if len(above) == 1 else 'them'} above this run's step, where a resume would "
                 f"choose {'it' if len(above) == 1 else 'them'}"] if above else [])
        return (f"not saving step {step} under {root_url}: committed step(s) {shown} there were not written by "
                f"this manager (an earlier run's, or ones load_latest could not use), and saving would "
                f"{' and '.join(harm)}. To continue that run, resume from it first (load_latest(..., "
                f"required=True) raises instead of starting over, and says why a step cannot be loaded); to "
                f"start a new run, choose another root; to let this run take their place, pass "
                f"CheckpointManager(..., overwrite=True): a step of the same number is replaced when this run "
                f"commits it, and the ones above are removed once it has")


@dataclass(frozen=True)
class Supersession:
    """An old step is superseded once step ``by`` has committed with ``meta.run == run``."""

    by: int
    run: str


def read_superseded(root: Storage) -> dict[int, Supersession]:
    """What is recorded at ``root``: ``{old step: Supersession}`` (empty when nothing is)."""
    if not root.exists(SUPERSEDED_NAME):
        return {}
    try:
        doc = json.loads(root.read_bytes(SUPERSEDED_NAME))
        return {int(old): Supersession(int(rec["by"]), str(rec["run"])) for old, rec in doc["superseded"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring %s: it is not a record this manager wrote (%s)", root.where(SUPERSEDED_NAME), exc)
        return {}


def write_superseded(root: Storage, entries: Mapping[int, Supersession]) -> None:
    """Record ``entries`` at ``root`` in one atomic write (or remove the record when there are none)."""
    if not entries:
        if root.exists(SUPERSEDED_NAME):
            root.delete([SUPERSEDED_NAME])
        return
    doc = {"format": "shardkit-superseded", "version": 1,
           "superseded": {str(old): {"by": rec.by, "run": rec.run} for old, rec in sorted(entries.items())}}
    root.put_atomic(SUPERSEDED_NAME, json.dumps(doc, indent=1).encode())


def in_force(root: Storage, dirs: Mapping[int, str], entries: Mapping[int, Supersession]) -> set[int]:
    """The recorded old steps still under ``root`` whose superseding step has committed, written by the
    run that made the record (its manifest's ``meta.run``)."""
    runs: dict[int, str | None] = {}
    out = set()
    for old, rec in entries.items():
        if old not in dirs or rec.by not in dirs:
            continue
        if rec.by not in runs:
            runs[rec.by] = _run_of(root.child(dirs[rec.by]))
        if runs[rec.by] == rec.run:
            out.add(old)
    return out


def _run_of(step: Storage) -> str | None:
    """``meta.run`` of the checkpoint committed at ``step`` (``None``: none committed, none valid, or no token)."""
    try:
        run = read_manifest(step, chunks=False).meta.get("run")
    except ShardkitError:  # no manifest, or one that does not parse: no step of that run committed there
        return None
    return run if isinstance(run, str) else None
