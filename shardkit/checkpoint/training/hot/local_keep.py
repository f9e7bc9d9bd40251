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

from shardkit.checkpoint.formats.native import remove_owned, survey
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.hot.flat import remove_flat
from shardkit.checkpoint.training.hot.nodes import COMPLETE_NAME, is_marker_leftover, is_partial_copy, parse_copy_name
from shardkit.checkpoint.training.run_steps import step_of_dir
from shardkit.errors import ConfigurationError, ShardkitError

__all__ = ["retain_local", "read_marker", "check_space", "remove_copy", "held_bytes"]

log = logging.getLogger(__name__)


def read_marker(step_dir: str) -> str | None:
    """The save id ``complete.json`` records in ``step_dir``, or ``None`` (absent or unreadable)."""
    try:
        found = json.loads(Storage(step_dir).read_bytes(COMPLETE_NAME).decode("utf-8"))
        return found["save_id"] if isinstance(found.get("save_id"), str) else None
    except (ShardkitError, OSError, ValueError, KeyError, AttributeError):
        return None


def remove_copy(path: str) -> None:
    """Remove one copy directory's shardkit files (manifest first); foreign files stay, with a warning.
    A copy an earlier shardkit wrote as a native checkpoint (a ``data/`` directory) goes by that format's
    record of what it wrote."""
    storage = Storage(path)
    if not storage.is_dir():
        return
    if not storage.is_dir("data"):
        left = remove_flat(path)
        if left:
            log.warning("leaving %s in place: it holds files the hot tier did not write (%s)", path,
                        ", ".join(left[:3]))
        return
    found = survey(storage)
    if found.foreign:
        log.warning("leaving %s in place: it holds files the hot tier did not write (%s)", path,
                    ", ".join(found.foreign[:3]))
    remove_owned(storage, found)


def _remove_step(step: Storage, why: str) -> None:
    log.info("hot tier: removing %s (%s)", step.url, why)
    step.delete([COMPLETE_NAME])  # first: the step stops being complete at once
    for name in step.listdir():
        if parse_copy_name(name) is not None:
            remove_copy(step.child(name).url)
        elif is_marker_leftover(name):
            step.delete([name])
        elif is_partial_copy(name):
            step.delete_tree(name)
    if not step.remove_empty_dir():
        left = step.listdir()
        if left:
            log.warning("hot tier: %s keeps files it did not write: %s", step.url, ", ".join(left[:3]))


def _steps(node_dir: str) -> dict[int, Storage]:
    node = Storage(node_dir)
    return {step: node.child(name) for name in node.listdir()
            if (step := step_of_dir(name)) is not None and node.is_dir(name)}


def retain_local(node_dir: str, step: int, save_id: str, local_keep: int) -> None:
    """Retention after ``step`` (save ``save_id``) completed on this node (see the module docstring)."""
    steps = _steps(node_dir)
    complete = sorted((s for s, d in steps.items() if s <= step and read_marker(d.url) is not None), reverse=True)
    kept = set(complete[:max(local_keep, 1)]) | {step}
    incarnation = save_id[:12]  # this manager's saves: one above ``step`` is the next save, under way
    for s, d in sorted(steps.items()):
        if s > step and not _abandoned(d, incarnation):
            continue
        if s > step:
            _remove_step(d, f"above step {step}, which this run saved after resuming from below it")
        elif s not in kept:
            _remove_step(d, "older than the newest complete steps kept" if s in complete else "never completed")
        else:
            marker = save_id if s == step else read_marker(d.url)
            for name in d.listdir():
                parsed = parse_copy_name(name)
                if parsed is not None and (parsed.kind == "fetched" or parsed.save_id != marker):
                    remove_copy(d.child(name).url)
                elif is_marker_leftover(name):
                    d.delete([name])
                elif is_partial_copy(name) and not name[1:].split(".partial-")[0].endswith(save_id):
                    d.delete_tree(name)  # a killed transfer's leftovers


def _abandoned(step: Storage, incarnation: str) -> bool:
    """Whether a step above the one just completed is an earlier run's: it holds copies, none of them this
    manager's.  An empty one may be this manager's next save, whose ranks are creating it right now."""
    copies = [parsed for n in step.listdir() if (parsed := parse_copy_name(n)) is not None]
    return bool(copies) and not any(parsed.save_id.startswith(incarnation) for parsed in copies)


def held_bytes(node_dir: str) -> int:
    """Bytes the hot tier's step directories take in ``node_dir`` now."""
    return sum(d.tree_bytes() for d in _steps(node_dir).values())


def check_space(node_dir: str, step_bytes: int, local_keep: int) -> None:
    """Refuse, before the first hot save, a node directory that cannot hold ``local_keep`` complete steps plus
    the one being written (``step_bytes`` each: this node's own copies and the replicas it keeps)."""
    node = Storage(node_dir)
    node.makedirs()
    needed = (local_keep + 1) * step_bytes
    available = node.free_bytes() + held_bytes(node_dir)
    if available < needed:
        raise ConfigurationError(
            f"the hot tier's directory {node_dir} cannot hold local_keep={local_keep} steps: each step takes "
            f"{step_bytes / 2**20:.1f} MiB on this node (its ranks' copies and the replicas it keeps), "
            f"{local_keep + 1} steps at once while a save runs need {needed / 2**20:.1f} MiB, and "
            f"{available / 2**20:.1f} MiB are free there; lower local_keep or replicas, or point local= at a "
            f"larger filesystem")
