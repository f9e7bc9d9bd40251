"""A resume's fallback: the newest committed step first, the next older one while a step is damaged.

Each ``load`` is one verified pass, so damage may be found after the load
began writing its targets (its error's ``partly_written`` names what it may
have touched).  A resume stays all or nothing per step only when a later
attempt writes every one of those keys again, so this keeps the union of what
failed attempts touched and never lets it go unsaid:

* a step that loads but lacks a touched key (``strict=False``) is no resume:
  that key holds the damaged step's bytes, so :class:`~shardkit.errors.CorruptCheckpoint`
  names it;
* any other failure of a later attempt is raised with the same class, saying
  that an earlier attempt wrote the targets, its ``partly_written`` holding them;
* when every step is damaged, the final error holds them too.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

from shardkit.checkpoint.formats import foreign_kind
from shardkit.checkpoint.formats.native import DirectorySurvey, survey
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.load import LoadResult, name_some
from shardkit.errors import CorruptCheckpoint, ShardkitError, error_record, from_record
from shardkit.wire.job_log import warning_once_per_job

log = logging.getLogger(__name__)

__all__ = ["load_newest_intact", "why_nothing"]


def load_newest_intact(steps: Sequence[int], load_step: Callable[[int], LoadResult], root_url: str,
                       dist: Dist) -> tuple[int, LoadResult] | None:
    """``(step, result)`` of the newest of ``steps`` (ascending) that ``load_step`` loads, trying older ones
    while a step is damaged; ``None`` when every step is damaged and no failed load wrote a target.

    Raises as the module docstring says once a failed attempt may have written targets.  ``dist``: the
    group that loads, which agrees whether a loaded step lacks a touched key on any rank.
    """
    touched: set[str] = set()  # every key a failed attempt may have partly written
    touching: list[int] = []  # the steps whose failed load wrote targets
    for step in reversed(steps):
        try:
            result = load_step(step)
        except CorruptCheckpoint as exc:
            touched.update(exc.partly_written)
            touching += [step] if exc.partly_written else []
            warning_once_per_job(log, "step %d under %s is damaged (%s); trying an older step%s", step, root_url,
                                 exc, ", which reloads every target" if exc.partly_written else "")
            continue
        except Exception as exc:
            if touched:
                raise _after_touching(exc, step, touching, touched) from exc
            raise
        left = sorted(touched.intersection(result.missing))
        if touched and dist.any_failed(bool(left)):
            error = CorruptCheckpoint(
                f"cannot resume from step {step} under {root_url}: the failed load of {_steps(touching)} may have "
                f"partly written {name_some(left) if left else 'keys (on another rank)'} that step {step} does "
                f"not hold (a load with strict=False leaves them alone), so the model would hold neither step. "
                f"Repair {_steps(touching)} (shardkit verify names the damaged files) or rebuild the model")
            error.partly_written = tuple(left)
            raise error
        return step, result
    if touched:
        error = CorruptCheckpoint(
            f"cannot resume under {root_url}: every committed step ({', '.join(map(str, steps))}) is damaged, and "
            f"the failed load of {_steps(touching)} may have partly written the model and optimizer: they hold no "
            f"step, so do not train from them. Repair a step (shardkit verify names the damaged files) or rebuild "
            f"the model")
        error.partly_written = tuple(sorted(touched))
        raise error
    return None


def _after_touching(exc: Exception, step: int, touching: Sequence[int], touched: set[str]) -> ShardkitError:
    """``exc`` of loading ``step`` as the same class (:func:`~shardkit.errors.from_record`), saying that the failed
    load of ``touching`` before it may have written ``touched`` -- whatever ``exc`` says of its own attempt."""
    keys = sorted(touched.union(getattr(exc, "partly_written", ())))
    error = from_record(error_record(exc), f"{str(exc).rstrip('.')}. Loading step {step} was a fallback: the failed "
                                           f"load of {_steps(touching)} before it may have partly written "
                                           f"{name_some(keys)}, which hold no step; do not train from them")
    error.partly_written = tuple(keys)
    return error


def _steps(steps: Sequence[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def why_nothing(root: Storage, dirs: dict[int, str]) -> str | None:
    """What ``root`` (whose ``step-<N>`` directories are ``dirs``) holds instead of a committed step, or
    ``None`` for a fresh run's empty root: the words of a resume that finds nothing to load."""
    if not root.exists():
        if root.paths_are_os_paths and not _creatable(root.root):
            return "the root does not exist and cannot be created here (read-only or missing parent?)"
        return None
    if not dirs:
        others = [n for n in root.listdir() if not n.startswith(".")]
        if not others:
            return None
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        return f"no step-<N> directory; the root holds {shown}"
    surveys: list[DirectorySurvey] = [survey(root.child(dirs[s])) for s in sorted(dirs)]
    return "found " + "; ".join(found.describe(foreign_kind(found.foreign)) for found in surveys)


def _creatable(path: str) -> bool:
    """Whether a local directory could be created at ``path`` (its nearest existing ancestor is writable)."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            return False
        parent = up
    return os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)
