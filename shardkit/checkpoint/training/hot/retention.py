"""What a node's hot directory keeps, and whether it can hold what it is asked to keep.

After step ``S`` completed (its ``complete.json`` written on this node) the node's lowest rank keeps the
newest ``local_keep`` complete steps up to ``S`` and removes:

* complete steps older than those (the marker first, so the step stops being complete at once);
* steps without a marker older than ``S`` (saves that were killed, or whose replicas never arrived);
* steps *above* ``S`` that no save of this manager wrote: an abandoned history (the job resumed from below them
  and saved ``S`` again), which recovery must never prefer to this run's newer state;
* inside kept steps, copies of another save than the marker's (an earlier attempt at the same step),
  copies fetched from peers by a recovery that was killed, and what a killed transfer or marker write
  left (``.<copy>.partial-...``, the transport's staging directories; ``complete.json.tmp-...``).

Only what the hot tier can prove it wrote goes (:mod:`~shardkit.checkpoint.formats.native.ownership` for
the copies' files, this module's names for the rest); anything else in the directory is left alone and
named in a warning.  The newest complete step is never removed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from shardkit.checkpoint.formats.native import remove_owned, survey
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.hot.layout import COMPLETE_NAME, is_marker_leftover, is_partial_copy, parse_copy_name
from shardkit.checkpoint.training.run_steps import step_of_dir
from shardkit.errors import ConfigurationError

__all__ = ["retain_local", "read_marker", "check_space", "remove_copy", "held_bytes"]

log = logging.getLogger(__name__)


def read_marker(step_dir: str) -> str | None:
    """The save id ``complete.json`` records in ``step_dir``, or ``None`` (absent or unreadable)."""
    try:
        with open(os.path.join(step_dir, COMPLETE_NAME), "rb") as f:
            found = json.loads(f.read().decode("utf-8"))
        return found["save_id"] if isinstance(found.get("save_id"), str) else None
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def remove_copy(path: str) -> None:
    """Remove one copy directory's shardkit files (manifest first); foreign files stay, with a warning."""
    if not os.path.isdir(path):
        return
    storage = Storage(path)
    found = survey(storage)
    if found.foreign:
        log.warning("leaving %s in place: it holds files the hot tier did not write (%s)", path,
                    ", ".join(found.foreign[:3]))
    remove_owned(storage, found)


def _remove_step(step_dir: str, why: str) -> None:
    log.info("hot tier: removing %s (%s)", step_dir, why)
    marker = os.path.join(step_dir, COMPLETE_NAME)
    if os.path.exists(marker):
        os.unlink(marker)
    for name in sorted(os.listdir(step_dir)):
        if parse_copy_name(name) is not None:
            remove_copy(os.path.join(step_dir, name))
        elif is_marker_leftover(name):
            os.unlink(os.path.join(step_dir, name))
        elif is_partial_copy(name):
            shutil.rmtree(os.path.join(step_dir, name), ignore_errors=True)
    _rmdir_if_empty(step_dir)


def _rmdir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        left = [n for n in os.listdir(path)] if os.path.isdir(path) else []
        if left:
            log.warning("hot tier: %s keeps files it did not write: %s", path, ", ".join(left[:3]))


def _steps(node_dir: str) -> dict[int, str]:
    if not os.path.isdir(node_dir):
        return {}
    found = {}
    for name in os.listdir(node_dir):
        step = step_of_dir(name)
        if step is not None and os.path.isdir(os.path.join(node_dir, name)):
            found[step] = os.path.join(node_dir, name)
    return found


def retain_local(node_dir: str, step: int, save_id: str, local_keep: int) -> None:
    """Retention after ``step`` (save ``save_id``) completed on this node (see the module docstring)."""
    steps = _steps(node_dir)
    complete = sorted((s for s, path in steps.items() if s <= step and read_marker(path) is not None), reverse=True)
    kept = set(complete[:max(local_keep, 1)]) | {step}
    incarnation = save_id[:12]  # this manager's saves: one above ``step`` is the next save, under way
    for s, path in sorted(steps.items()):
        if s > step and not _abandoned(path, incarnation):
            continue
        if s > step:
            _remove_step(path, f"above step {step}, which this run saved after resuming from below it")
        elif s not in kept:
            _remove_step(path, "older than the newest complete steps kept" if s in complete else "never completed")
        else:
            marker = save_id if s == step else read_marker(path)
            for name in os.listdir(path):
                parsed = parse_copy_name(name)
                if parsed is not None and (parsed[0] == "fetched" or parsed[2] != marker):
                    remove_copy(os.path.join(path, name))
                elif is_marker_leftover(name):
                    os.unlink(os.path.join(path, name))
                elif is_partial_copy(name) and not name[1:].split(".partial-")[0].endswith(save_id):
                    shutil.rmtree(os.path.join(path, name), ignore_errors=True)  # a killed transfer's leftovers


def _abandoned(step_dir: str, incarnation: str) -> bool:
    """Whether a step above the one just completed is an earlier run's: it holds copies, none of them this
    manager's.  An empty one may be this manager's next save, whose ranks are creating it right now."""
    names = [parse_copy_name(n) for n in os.listdir(step_dir)]
    copies = [parsed for parsed in names if parsed is not None]
    return bool(copies) and not any(parsed[2].startswith(incarnation) for parsed in copies)


def held_bytes(node_dir: str) -> int:
    """Bytes the hot tier's step directories take in ``node_dir`` now."""
    total = 0
    for path in _steps(node_dir).values():
        for root, _, files in os.walk(path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.exists(os.path.join(root, f)))
    return total


def check_space(node_dir: str, step_bytes: int, local_keep: int) -> None:
    """Refuse, before the first hot save, a node directory that cannot hold ``local_keep`` complete steps plus
    the one being written (``step_bytes`` each: this node's own copies and the replicas it keeps)."""
    os.makedirs(node_dir, exist_ok=True)
    needed = (local_keep + 1) * step_bytes
    usage = shutil.disk_usage(node_dir)
    available = usage.free + held_bytes(node_dir)
    if available < needed:
        raise ConfigurationError(
            f"the hot tier's directory {node_dir} cannot hold local_keep={local_keep} steps: each step takes "
            f"{step_bytes / 2**20:.1f} MiB on this node (its ranks' copies and the replicas it keeps), "
            f"{local_keep + 1} steps at once while a save runs need {needed / 2**20:.1f} MiB, and "
            f"{available / 2**20:.1f} MiB are free there; lower local_keep or replicas, or point local= at a "
            f"larger filesystem")
