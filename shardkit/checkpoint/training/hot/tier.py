"""``HotTier``: the manager's node-local tier (a :class:`~shardkit.checkpoint.training.tiers.Tier`), what
:class:`~shardkit.checkpoint.training.manager.CheckpointManager` holds when given ``local=``.  It turns
the manager's options into a :class:`~.nodes.NodeLayout`, names every save, checks once per state
structure that each node's directory can hold what it is asked to keep, copies the state to host for a
background save (which the durable save of the same step shares), and resumes from recovered copies.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from shardkit.checkpoint.geometry.boxes import is_dtensor
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.state.tree import from_json_value
from shardkit.checkpoint.training.hot.copies import HostCopy, LocalState
from shardkit.checkpoint.training.hot.layout_cache import LayoutCache
from shardkit.checkpoint.training.hot.local_keep import check_space
from shardkit.checkpoint.training.hot.nodes import NodeLayout
from shardkit.checkpoint.training.hot.replicate import HotSave, run_hot_save
from shardkit.checkpoint.training.hot.restore import resume_hot
from shardkit.checkpoint.training.hot.roots import survey_node
from shardkit.checkpoint.training.tiers import LoadTargets, Resumed, Staged
from shardkit.data.resume import InputSnapshot
from shardkit.errors import ConfigurationError
from shardkit.wire.collectives import raise_any_failure

__all__ = ["HotTier", "durable_view"]

log = logging.getLogger(__name__)


class HotTier:
    """The hot tier's options and per-run state (see :mod:`shardkit.checkpoint.training.hot`)."""

    def __init__(self, local: str, *, root_url: str, local_world_size: int | None, replicas: int, local_keep: int,
                 process_group: Any = None) -> None:
        if not isinstance(local_keep, int) or isinstance(local_keep, bool) or local_keep < 1:
            raise ConfigurationError(f"local_keep must be a positive integer, got {local_keep!r}")
        if local_world_size is not None and (not isinstance(local_world_size, int) or isinstance(local_world_size, bool)
                                             or local_world_size < 1):
            raise ConfigurationError(f"local_world_size must be a positive integer or None, got {local_world_size!r}")
        NodeLayout.of(local, 1, 1, 0 if isinstance(replicas, int) and not isinstance(replicas, bool) else replicas)
        # (the path and the option types now; the node arithmetic against the job at first use)
        self.local = local
        self.root_url = root_url
        self.local_world_size = local_world_size
        self.replicas = replicas
        self.local_keep = local_keep
        self.process_group = process_group
        self._layout: NodeLayout | None = None
        self._incarnation: str | None = None
        self._saves = 0
        self._space_checked: str | None = None
        self._host = HostCopy()
        self._layouts = LayoutCache()  # the state's flattened view, reused while its layout repeats

    def layout(self) -> NodeLayout:
        """The node arithmetic for this job (checked against the world size on first use)."""
        if self._layout is None:
            dist = Dist(self.process_group)
            if dist.group_size != dist.world_size:
                raise ConfigurationError(f"the node-local tier needs a process group of every rank (its node "
                                         f"arithmetic counts global ranks); process_group has {dist.group_size} of "
                                         f"{dist.world_size}")
            self._layout = NodeLayout.of(self.local, dist.world_size, self.local_world_size, self.replicas,
                                         self.root_url)
            survey_node(self._layout, dist.rank)  # adopt, record the root, warn of other roots' copies
        return self._layout

    def prepare(self, step: int, state: dict[str, Any], meta: dict[str, Any], *,
                to_host: bool, inputs: InputSnapshot | None = None) -> tuple[HotSave, LocalState]:
        """On the training thread, on every rank: name the save, take the state's flattened view (its layout reused
        from the last save while it holds: :mod:`.layout_cache`), check space when the structure is new, and
        (``to_host``) copy the local tensors into reused host buffers so training may go on.  No collective
        but on the first save and when the structure changes: the ranks check that they agree on the save's
        name when they vote on its completion, off the training thread.  ``inputs``: the RNG state taken
        for this save, gathered over the ranks by the save itself (``state`` then holds no input state)."""
        layout = self.layout()
        dist = Dist(self.process_group)
        local = self._layouts.local_state(state)
        self._saves += 1
        # once: rank 0's clock, so a later run's saves of a step sort after an earlier one's
        if self._incarnation is None:
            self._incarnation = dist.broadcast_json(f"{int(time.time() * 1000) % 16**12:012x}" if dist.rank == 0
                                                    else None)
        save_id = f"{self._incarnation}{self._saves % 10**6:06d}"  # checked to agree when the ranks vote (save.py)
        # the model's and optimizer's layout: it changes on every rank at once
        if local.structure != self._space_checked:
            self._check_space(layout, dist, local.nbytes)
            self._space_checked = local.structure
        on_device = any(t.device.type != "cpu" for t in local.tensors.values())
        tensors = self._host.copy(local) if to_host or on_device else local.tensors
        job = HotSave(step, save_id, tensors, local.values, local.inputs, local.structure, meta, self.local_keep,
                      inputs)
        return job, local

    def plan(self, step: int, meta: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Every step goes to the hot tier."""
        return step, meta

    def stage(self, plan: tuple[int, dict[str, Any]], state: dict[str, Any], *, background: bool,
              inputs: InputSnapshot | None = None) -> Staged:
        """The hot save of ``state`` (:meth:`prepare`: a host copy in a ``background`` save, which the tiers
        after this one save too, through :func:`durable_view`; ``inputs`` only when no tier follows)."""
        step, meta = plan
        job, local = self.prepare(step, state, meta, to_host=background, inputs=inputs)
        layout = self.layout()
        return Staged(lambda group: run_hot_save(layout, job, group),
                      (lambda: durable_view(local, job.tensors)) if background else (lambda: state))

    def committed(self, plan: tuple[int, dict[str, Any]], pending: int | None) -> None:
        """Nothing to do: each node's retention ran with the save (``local_keep``)."""

    def resume(self, targets: LoadTargets, candidates: list[int]) -> Resumed | None:
        """The newest hot step at or above the newest durable candidate that every rank can assemble."""
        done = resume_hot(self.layout(), self.process_group, targets.model, targets.optimizer, data=targets.data,
                          stateful=targets.stateful, rng=targets.rng, at_least=candidates[-1] if candidates else 0)
        return None if done.found is None else Resumed(*done.found)

    def resume_listing(self, targets: LoadTargets, listing: Callable[[], list[int]],
                       where: str) -> tuple[Resumed | None, list[int], bool]:
        """As :meth:`resume`, with the durable candidates listed by rank 0 (``listing``) inside the hot tier's
        own exchange (one collective fewer); ``(resumed, candidates, touched)`` -- ``touched``: a damaged copy
        was found after it had written targets (see :mod:`.recover`), so the caller must load a step whole
        or raise."""
        done = resume_hot(self.layout(), self.process_group, targets.model, targets.optimizer, data=targets.data,
                          stateful=targets.stateful, rng=targets.rng, listing=listing, where=where)
        return (None if done.found is None else Resumed(*done.found)), list(done.listed), done.touched

    def _check_space(self, layout: NodeLayout, dist: Dist, nbytes: int) -> None:
        """Every node's leader checks its directory for ``local_keep`` + 1 steps of its ranks' copies and the
        replicas it keeps; a refusal is raised on every rank."""
        sizes = dist.all_gather_json(nbytes)
        problem = None
        if layout.is_node_leader(dist.rank):
            node = [r for r in range(layout.world_size) if layout.node_of(r) == layout.node_of(dist.rank)]
            kept = node + [q for r in node for q in layout.replicated_here(r)]
            try:
                check_space(layout.node_dir(dist.rank), sum(sizes[r] for r in kept), self.local_keep)
            except (ConfigurationError, OSError) as exc:
                problem = exc
        raise_any_failure(dist.first_error, problem)


def durable_view(local: LocalState, staged: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state for a durable save of the same step from the hot save's host copy: each DTensor rebuilt
    around its staged local shard with the original's spec (global shape, mesh, placements), so the durable
    save shares the one host copy instead of making its own."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {key: from_json_value(v) for key, v in local.values.items()}
    out.update(local.inputs)  # nested, beside the flattened keys of model and optimizer: the same keys once saved
    for key, t in local.flat.tensors.items():
        out[key] = DTensor(staged[key], t._spec, requires_grad=False) if is_dtensor(t) else staged[key]
    return out
