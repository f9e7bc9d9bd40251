"""Where the hot tier keeps things: one directory per node, one step directory per saved step.

::

    <local>/                             "{node}" in the template replaced by the node index
      run-<12 hex>/                      one per durable root (a digest of its canonical URL): runs never mix
        root.json                        {"root": that canonical URL}: whose copies these are (``roots.py``)
        step-0000000017/
          rank-2.<save id>/              rank 2's own shards (a native checkpoint, manifest.json last)
          replica-0.<save id>/           rank 0's shards, kept here for when rank 0's node is lost
          fetched-2.<save id>.<token>/   left by an earlier version's recovery (a peer's copy staged on disk;
                                         now received into memory): retention removes it
          complete.json                  written once every rank's copy and replicas were written, everywhere

Step directories are named as under the durable root (:func:`~..run_steps.step_dir`).  A rank is on
node ``rank // local_world_size``.  Rank ``r``'s replicas go to the ranks with the same local
rank on the next ``replicas`` nodes (``r + k * local_world_size``, wrapping), so a node's loss costs
every rank on it one copy and no rank two.  The save id names one save of one manager (a token drawn
once per manager plus a counter), so copies of the same step from two runs -- a step saved, the job
killed, the step saved again -- are never mixed; the token is rank 0's clock in milliseconds when the
manager first saved, so of two complete saves of one step the later run's sorts last.  Two jobs that
share a ``local=`` directory but not a durable root keep apart in their ``run-<digest>`` directories, so
neither ever reads nor removes the other's copies.

The digest is of the root's canonical URL (:func:`~shardkit.checkpoint.io.location.canonical_url`: absolute
path, links resolved, fsspec's protocol name, no trailing slash), so a restart that spells the root
``./ckpt``, ``/abs/ckpt/`` or ``file:///abs/ckpt`` finds the same copies.  (Before, the digest was of the
URL as typed; :mod:`.roots` adopts such directories when they belong to this root.)

Under torchrun with restarts, the rendezvous store torchrun shares with its workers by default makes a
restarted attempt hang in ``init_process_group`` (torch #135712):
:mod:`shardkit.checkpoint.training.restarts` names that setting, and :meth:`NodeLayout.of` checks it, as
``import shardkit.checkpoint`` and every manager do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from typing import NamedTuple

from shardkit.checkpoint.io.location import canonical_url
from shardkit.checkpoint.training.restarts import check_restartable
from shardkit.errors import ConfigurationError
from shardkit.wire.job_log import warning_once_per_job

__all__ = ["NodeLayout", "COMPLETE_NAME", "CopyName", "copy_name", "parse_copy_name", "is_partial_copy",
           "is_marker_leftover", "run_name"]

log = logging.getLogger(__name__)

COMPLETE_NAME = "complete.json"
_COPY = re.compile(r"^(rank|replica|fetched)-(\d{1,9})\.([0-9a-f]{12}\d{6})(\.[0-9a-f]{8})?$")
_MARKER_TMP = re.compile(r"^" + re.escape(COMPLETE_NAME) + r"\.tmp-[0-9a-f]{12}$")


def run_name(spelling: str) -> str:
    """``run-<12 hex>``: the directory of the run whose root is spelled ``spelling`` (already canonical, or as
    an earlier shardkit keyed it: the URL as typed)."""
    return "run-" + hashlib.sha256(spelling.encode("utf-8")).hexdigest()[:12]


class CopyName(NamedTuple):
    """What a copy directory's name says: ``rank-2.<save id>[.<token>]``."""

    kind: str      # rank (a rank's own copy), replica (another node's rank's) or fetched (by a recovery)
    rank: int      # whose shards it holds
    save_id: str   # the save that wrote it
    token: str | None = None  # a fetched copy's: which recovery fetched it

    def __str__(self) -> str:
        return f"{self.kind}-{self.rank}.{self.save_id}" + (f".{self.token}" if self.token else "")


def copy_name(kind: str, rank: int, save_id: str, token: str | None = None) -> str:
    """``rank-2.<save id>``: the directory name of one copy (``kind``: rank, replica or fetched)."""
    return str(CopyName(kind, rank, save_id, token))


def is_marker_leftover(name: str) -> bool:
    """Whether ``name`` is what a killed write of ``complete.json`` leaves (``Storage.put_atomic``'s temporary)."""
    return _MARKER_TMP.match(name) is not None


def is_partial_copy(name: str) -> bool:
    """Whether ``name`` is what a killed transfer of a copy leaves: ``.<copy name>.partial-<pid>-<random>``
    (:meth:`~shardkit.checkpoint.io.storage.Storage.temporary_name_prefix`)."""
    head, marker, _ = name.partition(".partial-")
    return bool(marker) and head.startswith(".") and parse_copy_name(head[1:]) is not None


def parse_copy_name(name: str) -> CopyName | None:
    """What a copy directory's name says, or ``None`` for any other name: the one place names are read."""
    found = _COPY.match(name)
    if not found:
        return None
    return CopyName(found.group(1), int(found.group(2)), found.group(3), found.group(4)[1:] if found.group(4) else None)


@dataclass(frozen=True)
class NodeLayout:
    """The node arithmetic of a job: ``world_size`` ranks, ``local_world_size`` per node."""

    template: str
    world_size: int
    local_world_size: int
    replicas: int
    run: str = ""
    root: str = ""  # the durable root's canonical URL, recorded in each run directory
    legacy_runs: tuple[str, ...] = ()  # what an earlier shardkit named this root's run directory

    @classmethod
    def of(cls, template: str, world_size: int, local_world_size: int | None, replicas: int,
           root_url: str = "") -> "NodeLayout":
        """Check the options against the job; ``local_world_size=None`` takes torchrun's LOCAL_WORLD_SIZE.
        Under torchrun, also check that a restarted attempt can form its process group
        (:mod:`shardkit.checkpoint.training.restarts`)."""
        check_restartable()
        if not isinstance(template, (str, os.PathLike)) or not str(template):
            raise ConfigurationError(f"local= must be a local directory path, got {template!r}")
        template = os.fspath(template)
        if "://" in template and not template.startswith("file://"):
            raise ConfigurationError(f"local={template!r}: the hot tier lives on a node-local filesystem "
                                     f"(RAM disk or NVMe); give a path, not a URL")
        template = template.removeprefix("file://")
        if local_world_size is None:
            found = os.environ.get("LOCAL_WORLD_SIZE")
            if found is None and world_size > 1:
                raise ConfigurationError("local_world_size=None takes the ranks per node from torchrun's "
                                         "LOCAL_WORLD_SIZE, which is not set: pass local_world_size=")
            try:
                local_world_size = int(found) if found is not None else 1
            except ValueError:
                raise ConfigurationError(f"LOCAL_WORLD_SIZE={found!r} is not an integer: pass "
                                         f"local_world_size=") from None
        if not isinstance(local_world_size, int) or isinstance(local_world_size, bool) or local_world_size < 1 \
                or world_size % local_world_size:
            raise ConfigurationError(f"local_world_size={local_world_size!r} must be a positive integer dividing "
                                     f"the world size {world_size}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ConfigurationError(f"replicas must be a non-negative integer, got {replicas!r}")
        nodes = world_size // local_world_size
        if replicas > nodes - 1:  # e.g. a job restarted smaller after losing a node for good: not an error
            warning_once_per_job(log, "replicas=%d needs %d nodes; this job has %d (%d ranks, %d per node): "
                                 "keeping %d replica(s) of each rank's copy", replicas, replicas + 1, nodes,
                                 world_size, local_world_size, nodes - 1)
            replicas = nodes - 1
        root = canonical_url(root_url) if root_url else ""
        return cls(template, world_size, local_world_size, replicas, run_name(root), root,
                   _legacy_runs(root_url, root) if root_url else ())

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def node_dir(self, rank: int) -> str:
        """This run's directory on ``rank``'s node (the template with ``{node}`` replaced, then ``run-<digest>``)."""
        return os.path.join(os.path.abspath(self.template.replace("{node}", str(self.node_of(rank)))), self.run)

    def replica_holders(self, rank: int) -> list[int]:
        """The ranks that keep ``rank``'s replicas, nearest node first."""
        return [(rank + k * self.local_world_size) % self.world_size for k in range(1, self.replicas + 1)]

    def replicated_here(self, rank: int) -> list[int]:
        """The ranks whose replicas ``rank`` keeps."""
        return [(rank - k * self.local_world_size) % self.world_size for k in range(1, self.replicas + 1)]

    def is_node_leader(self, rank: int) -> bool:
        """The lowest rank of its node: the one that records completion and runs retention there."""
        return rank % self.local_world_size == 0


def _legacy_runs(typed: str, root: str) -> tuple[str, ...]:
    """The ``run-<digest>`` names an earlier shardkit gave this root: the digest of the URL as typed (as the
    manager kept it: no trailing slash), for the spellings of this place a user most likely typed."""
    spellings = {typed.rstrip("/") or typed}
    if root.startswith("file://"):
        path = typed.removeprefix("file://")
        spellings |= {os.path.abspath(path), root.removeprefix("file://"), root}
        spellings |= {"file://" + os.path.abspath(path)}
    else:
        spellings |= {root}
    return tuple(sorted(run_name(s) for s in spellings if run_name(s) != run_name(root)))
