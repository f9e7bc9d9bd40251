"""The manager's durable tier: numbered steps under the root URL, this run's ownership of them, retention and
dedup (the rules are :mod:`~shardkit.checkpoint.training.manager`'s docstring)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from shardkit.checkpoint.formats.native import MANIFEST_NAME
from shardkit.checkpoint.io.deadline import checkpoint_deadline
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.training_state import get_training_state, set_training_state
from shardkit.checkpoint.training.async_save.saver import async_save
from shardkit.checkpoint.training.input_state import check_input_state, stored_step
from shardkit.checkpoint.training.load import load
from shardkit.checkpoint.training.manager_options import ManagerOptions
from shardkit.checkpoint.training.retention import retain
from shardkit.checkpoint.training.run_steps import (
    RunSteps,
    Supersession,
    committed_at,
    dcp_steps,
    in_force,
    read_superseded,
    step_dir,
    step_dirs,
    write_superseded,
)
from shardkit.checkpoint.training.save import save
from shardkit.checkpoint.training.step_fallback import load_newest_intact
from shardkit.checkpoint.training.tiers import LoadTargets, Resumed, Staged
from shardkit.data import load_data_state_dict
from shardkit.errors import CheckpointExists

__all__ = ["DurableTier", "DurablePlan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DurablePlan:
    """Rank 0's decision about saving ``step`` under the root, as the options of its ``save``."""

    step: int
    url: str
    options: dict[str, Any] = field(default_factory=dict)


class DurableTier:
    """Steps under ``root``: which are this run's (:class:`~.run_steps.RunSteps`), what a save may replace,
    what retention removes, which step a dedup save references; and loading a step into the targets."""

    def __init__(self, root: Storage, options: ManagerOptions) -> None:
        self.root = root
        self.options = options
        self.dedup = options.dedup
        self.every = options.hot.durable_every if options.hot is not None else 1
        self.run = RunSteps(overwrite=options.overwrite)  # which steps under the root are this run's
        self._warned: set[str] = set()

    def url_of(self, step: int) -> str:
        return self.root.child(step_dir(step)).url

    def step_dirs(self) -> dict[int, str]:
        return step_dirs(self.root)

    def steps(self) -> list[int]:
        """Committed steps, ascending (read fresh from storage on each call)."""
        return sorted(step for step, name in self.step_dirs().items() if self.root.child(name).exists(MANIFEST_NAME))

    def on_rank0(self, decide: Callable[[], Any]) -> Any:
        return Dist(self.options.process_group).decided_on_rank0(decide, self.root.url)

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning(message)

    # -- saving ----------------------------------------------------------
    def plan(self, step: int, meta: dict[str, Any]) -> DurablePlan | None:
        """Rank 0's decision about the durable root (refusing a step in the way), as ``save`` options;
        ``None`` for a step that goes to the hot tier only (``durable_every``)."""
        if step % self.every:
            return None
        decided = self.on_rank0(lambda: self._decide(step))  # one decision for all ranks
        if decided["in_the_way"] and not self.run.overwrite:
            raise CheckpointExists(self.run.refusal(step, decided["in_the_way"], self.root.url))
        if decided["supersedes"]:
            meta["run"] = self.run.run  # what makes the record of the steps it supersedes take effect
        # a step committed there meanwhile by someone else is refused at commit, not replaced
        opts = dict(compression=self.options.compression, storage_options=self.options.storage_options, meta=meta,
                    **self.options.save_options,
                    overwrite=self.run.may_replace(step, decided["in_the_way"]) or step in decided["superseded"])
        if self.dedup:
            base = decided["base"]
            opts.update(digests=self.dedup, reuse_from=None if base is None else self.url_of(base))
        return DurablePlan(step, self.url_of(step), opts)

    def _decide(self, step: int) -> dict[str, Any]:
        """Rank 0's view before saving ``step``: the committed steps in its way and the dedup base; with
        ``overwrite=True``, the steps above it recorded as superseded by it before anything is written.

        Only directories at or above ``step`` (and this run's own) are probed for a manifest, so a long
        history costs one listing.
        """
        dirs = self.step_dirs()
        known = (self.run.written | {self.run.resumed}) - {None}
        committed = {s for s in dirs if (s >= step or s in known) and committed_at(self.root, dirs, s)}
        recorded = read_superseded(self.root)
        gone = in_force(self.root, dirs, recorded)  # superseded by a committed step: not in anyone's way
        live = {old: rec for old, rec in recorded.items() if old in gone}  # the rest: saves that never committed
        in_the_way = self.run.in_the_way(step, committed - gone)
        supersedes = [old for old in in_the_way if old > step] if self.run.overwrite else []
        live.update({old: Supersession(step, self.run.run) for old in supersedes})
        if live != recorded:
            write_superseded(self.root, live)
        return {"in_the_way": in_the_way, "superseded": sorted(gone), "supersedes": bool(supersedes),
                "base": self.run.dedup_base(step, committed) if self.dedup else None}

    def stage(self, plan: DurablePlan, state: dict[str, Any], *, background: bool) -> Staged:
        def write(group: Any) -> None:
            started = time.perf_counter()
            save(state, plan.url, process_group=group, **plan.options)
            if not background:
                log.info("step %d committed at %s in %.2f s", plan.step, plan.url, time.perf_counter() - started)
        return Staged(write, lambda: state)

    def save_in_background(self, plan: DurablePlan, state: dict[str, Any]) -> Future:
        """``async_save`` of the step: the host copy made here, written and committed in the background."""
        return async_save(state, plan.url, writer=self.options.writer, **plan.options)

    def committed(self, plan: DurablePlan, pending: int | None) -> None:
        """After the step landed: it is this run's, and retention runs on rank 0 (:func:`~.retention.retain`)."""
        self.run.written.add(plan.step)
        if Dist().rank == 0:
            retain(self.root, plan.step, run=self.run, keep_last=self.options.keep_last, pending=pending,
                   warn_once=self.warn_once)

    # -- loading ---------------------------------------------------------
    def resumable_steps(self, dcp: bool = False) -> list[int]:
        """Committed steps (with ``dcp``, torch DCP's too), ascending, without those an ``overwrite=True`` run
        superseded (its step committed; their removal may not have happened yet)."""
        committed = sorted(set(self.steps()) | (dcp_steps(self.root, self.step_dirs()) if dcp else set()))
        superseded = in_force(self.root, self.step_dirs(), read_superseded(self.root))
        if superseded & set(committed):
            log.info("not resuming from steps %s under %s: superseded by a later run's steps (overwrite=True)",
                     ", ".join(map(str, sorted(superseded & set(committed)))), self.root.url)
        return [s for s in committed if s not in superseded]

    def resume(self, targets: LoadTargets, candidates: list[int]) -> Resumed | None:
        """The newest intact step of ``candidates`` loaded into ``targets`` (older ones tried in turn)."""
        loaded = load_newest_intact(candidates, lambda s: self.load_step(s, targets), self.root.url,
                                    Dist(self.options.process_group))
        if loaded is None:
            return None
        step, meta = loaded
        log.info("resumed from step %d at %s", step, self.url_of(step))
        return Resumed(step, meta.get("extra"), "durable")

    def load_step(self, step: int, targets: LoadTargets) -> Any:
        """Model and optimizer in place, then -- once they loaded -- data position, objects, and the RNG last."""
        url = self.root.child(self.step_dirs().get(step, step_dir(step))).url  # a DCP loop's step-100 too
        with checkpoint_deadline("load", url, step, self.options.timeout):
            return self._load_at(url, step, targets)

    def _load_at(self, url: str, step: int, t: LoadTargets) -> Any:
        group, storage_options = self.options.process_group, self.options.storage_options
        inputs, under = stored_step(url, t.from_dcp, storage_options)
        rng = t.rng and "rng" in inputs
        restores_inputs = t.data is not None or bool(t.stateful) or rng
        check_input_state(step, inputs, t.data, t.stateful, rng=rng, restores=restores_inputs, process_group=group)
        training = get_training_state(t.model, t.optimizer)
        state = {**({under: training} if under else training), **inputs}
        meta = load(state, url, strict=t.strict, storage_options=storage_options, process_group=group,
                    verify_first=t.verify_first)
        set_training_state(t.model, t.optimizer, training, strict=t.strict)
        if restores_inputs:
            load_data_state_dict({k: state[k] for k in inputs}, t.data, t.stateful, rng=t.rng and "rng" in state)
        return meta
