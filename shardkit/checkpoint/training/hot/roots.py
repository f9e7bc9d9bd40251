"""Whose copies a node's ``local=`` directory holds, so recovery cannot be missed.

Each ``run-<digest>`` directory records the durable root it belongs to in ``root.json`` (its canonical URL),
written when the run first uses the node.  :func:`survey_node`, run once per manager on every rank before
any hot copy is read or written:

* **adopts** what an earlier shardkit left for this root: it keyed the directory by the digest of the
  root URL *as typed*, so the spellings this run could have used before (as typed now, the absolute path,
  ``file://`` of either) are looked for, and such a directory, holding no ``root.json``, is renamed to this
  root's canonical name.  A rename is atomic, so when several ranks of a node try it one wins and the
  others find it done.  A directory keyed by another spelling (a relative path from another working
  directory) cannot be told apart from another root's: it is reported, below, as a root not recorded;
* **warns** once per node (its first rank, the one that sees that disk) when the directory holds hot steps
  of *other* roots: one WARNING naming each ``run-*`` directory, the root it recorded, and what to do --
  point ``CheckpointManager`` at that root to resume from them, or remove them.  They are never read nor
  removed by this run, so without the warning a restart that named another root would resume from older
  durable steps and leave the newer hot copies on the disk for good.
"""

from __future__ import annotations

import json
import logging
import os
import re

from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.training.hot.nodes import NodeLayout
from shardkit.errors import ShardkitError

__all__ = ["ROOT_NAME", "recorded_root", "survey_node"]

log = logging.getLogger(__name__)

ROOT_NAME = "root.json"
_RUN = re.compile(r"^run-[0-9a-f]{12}$")
_STEP = re.compile(r"^step-(\d+)$")
_warned: set[str] = set()  # node directories warned about in this process


def recorded_root(run_dir: str) -> str | None:
    """The canonical root URL ``run_dir`` recorded (``None``: none recorded, or unreadable)."""
    storage = Storage(run_dir)
    try:
        if not storage.exists(ROOT_NAME):
            return None
        root = json.loads(storage.read_bytes(ROOT_NAME)).get("root")
    except (ShardkitError, OSError, ValueError, AttributeError):
        return None
    return root if isinstance(root, str) else None


def _record(run_dir: str, root: str) -> None:
    """Write ``root.json`` once, atomically (a reader sees it whole or not at all)."""
    if recorded_root(run_dir) == root:
        return
    storage = Storage(run_dir)
    storage.makedirs()
    storage.put_atomic(ROOT_NAME, json.dumps({"root": root}).encode("utf-8"))


def _adopt(parent: Storage, layout: NodeLayout) -> None:
    """Rename this root's directory as an earlier shardkit named it, when there is one and ours is not there."""
    for name in layout.legacy_runs:
        if not parent.is_dir(name) or recorded_root(parent.path(name)) is not None or parent.exists(layout.run):
            continue
        try:
            parent.replace(name, layout.run)
        except (ShardkitError, OSError):  # another rank of this node renamed it first (or the disk refused)
            continue
        log.info("hot tier: adopted %s (named by an earlier shardkit after the root as typed) as %s for %s",
                 parent.path(name), parent.path(layout.run), layout.root)


def _steps(run_dir: Storage) -> list[int]:
    try:
        names = run_dir.listdir()
    except (ShardkitError, OSError):
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP.match(n)))


def _others(parent: Storage, layout: NodeLayout) -> list[tuple[str, str | None, list[int]]]:
    """(directory, recorded root, steps) of every other run's directory in ``parent`` that holds steps."""
    try:
        names = sorted(parent.listdir())
    except (ShardkitError, OSError):
        return []
    found = []
    for name in names:
        if name == layout.run or not _RUN.match(name) or not (steps := _steps(parent.child(name))):
            continue
        found.append((parent.path(name), recorded_root(parent.path(name)), steps))
    return found


def _message(node_dir: str, root: str, others: list[tuple[str, str | None, list[int]]]) -> str:
    """The one WARNING about ``others`` (see :func:`survey_node`)."""
    parent = os.path.dirname(node_dir)
    listed = "; ".join(
        f"{path} (root {theirs}, step(s) {', '.join(map(str, steps))})" if theirs else
        f"{path} (root not recorded: written by an earlier shardkit; step(s) {', '.join(map(str, steps))})"
        for path, theirs, steps in others)
    return (f"hot tier: {parent} holds hot copies of other durable roots, which this run (root {root}) will "
            f"neither resume from nor remove: {listed}. To resume from them, point CheckpointManager at that "
            f"root (the same root_url, however spelled); if no job needs them, remove those directories "
            f"(rm -r {' '.join(path for path, _, _ in others)}) to free the space")


def survey_node(layout: NodeLayout, rank: int) -> None:
    """Adopt this root's directory from an earlier shardkit's name, record the root, and warn (once per node,
    from its first rank) about other roots' hot copies in the same ``local=`` directory.  No collective.

    Recording never fails the job: a directory that cannot be written fails the first save, with its own
    error, where it would anyway."""
    if not layout.root:
        return
    node_dir = layout.node_dir(rank)
    parent = Storage(os.path.dirname(node_dir))
    _adopt(parent, layout)
    try:
        _record(node_dir, layout.root)
    except (ShardkitError, OSError) as exc:
        log.debug("hot tier: could not record the root in %s: %s", node_dir, exc)
    if not layout.is_node_leader(rank) or node_dir in _warned:
        return
    _warned.add(node_dir)
    others = _others(parent, layout)
    if others:
        log.warning("%s", _message(node_dir, layout.root, others))
