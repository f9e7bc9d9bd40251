"""``CheckpointManager``: numbered steps under one root URL, newest committed wins.

Layout: ``<root>/step-<N>/`` is one native checkpoint (``N`` zero-padded so
listings sort).  The rules that make it crash-safe:

* A step exists only once its ``manifest.json`` is committed; a directory
  without one (an interrupted save) is never chosen, and listings are fresh
  (object-store listing caches are invalidated), so what ``steps()`` shows is
  what storage holds.
* Retention (``keep_last``) runs only after a newer step has committed, deletes
  a step's manifest first (so it stops being a checkpoint at once) and its data
  after, and never touches the newest committed step.  Interrupted shardkit
  saves older than the newest committed step are removed too.
* ``dedup=True`` saves each step's unchanged chunks as references to the newest
  committed step's data files (``dedup.py``, format version 4).  Retention keeps
  every step a kept step references, whole, however old; it reads only the kept
  steps' ``manifest.json`` to know which, and deletes no committed step in a
  round where one of them cannot be read.
* The manager only ever deletes what it can prove it wrote
  (:mod:`~shardkit.checkpoint.formats.native.ownership`): a ``step-<N>`` that holds a torch DCP
  or Hugging Face checkpoint, or any file shardkit did not write, is left alone
  and named in a warning; inside a shardkit step only shardkit's files go.
* A manager never replaces a committed step it did not write itself in this
  process, nor saves below one (a resume would choose the older run's step
  over this run's): ``save`` refuses with
  :class:`~shardkit.errors.CheckpointExists` naming those steps, on every
  rank, unless it is the step this manager resumed from, or ``overwrite=True``
  says this run takes their place (:mod:`.run_steps`: a step of the same
  number is replaced by this run's commit; those above are recorded as
  superseded before the save, never resumed from once it has committed, and
  removed after).  ``keep_last`` counts only this run's steps: those it
  wrote, the one it resumed from and the history below it.  ``dedup``
  references only a step this manager committed or resumed from, never merely
  the highest number on disk.
* With ``local=`` every save also goes to a node-local hot tier (own copies, replicas on other nodes) and
  only every ``durable_every``-th to the root; ``load_latest`` resumes from whichever tier holds the newer
  step every rank can assemble from verified copies (:mod:`~shardkit.checkpoint.training.hot`), and
  :attr:`CheckpointManager.last_load` says which.
* ``load_latest`` lets rank 0 choose the step and tells the others (JSON over
  the process group), so every rank loads the same one.  When the newest
  committed step turns out damaged (checksum, missing file) it falls back to
  the next older one, reloading every target, and says so: a resume is all or
  nothing per step, though each ``load`` is one pass that may have written
  targets before it found the damage.  If every step fails after one wrote
  targets, it raises rather than report "nothing to resume" over a half-loaded
  model.  Finding nothing to resume is silent only on a fresh root; foreign or
  interrupted steps, or a root that cannot be created, are named in a warning,
  and ``required=True`` turns "nothing" into :class:`~shardkit.errors.CheckpointNotFound`.

The manager composes its tiers (:mod:`~shardkit.checkpoint.training.tiers`): the durable root
(:mod:`~shardkit.checkpoint.training.durable_tier`) and, with ``local=``, the hot tier
(:mod:`~shardkit.checkpoint.training.hot.tier`); ``load_latest`` is
:mod:`~shardkit.checkpoint.training.resume_latest`.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.nn as nn

from shardkit.checkpoint.io.deadline import checkpoint_deadline
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.training_state import get_training_state
from shardkit.checkpoint.state.tree import to_json_value
from shardkit.checkpoint.training.async_save.saver import background_saver
from shardkit.checkpoint.training.durable_tier import DurablePlan, DurableTier
from shardkit.checkpoint.training.hot.restore import LastLoad
from shardkit.checkpoint.training.hot.tier import HotTier
from shardkit.checkpoint.training.manager_options import ManagerOptions
from shardkit.checkpoint.training.restarts import check_restartable
from shardkit.checkpoint.training.resume_latest import resume_latest
from shardkit.checkpoint.training.run_steps import step_dir
from shardkit.checkpoint.training.tiers import LoadTargets, Tier
from shardkit.data import ElasticSampler, Stateful, data_state_dict
from shardkit.data.resume import InputSnapshot
from shardkit.errors import ConfigurationError, ShardkitError

__all__ = ["CheckpointManager", "step_dir"]

log = logging.getLogger(__name__)


class CheckpointManager:
    """Save numbered steps under ``root_url``, resume from the newest committed one.

    ``keep_last``: keep only the newest ``keep_last`` committed steps (``None``
    keeps all).  ``async_save``: ``save`` returns once the state is on the host
    and uploads in the background (the next ``save`` or :meth:`wait` waits for
    it), through ``writer`` (see :func:`~shardkit.checkpoint.async_save`).
    ``compression`` and ``storage_options`` are passed to every save/load.
    ``dedup``: store a digest of every chunk (``True``: xxh3-128; or name the
    algorithm, ``"sha256"``), and reference the chunks the newest committed
    step already stores instead of writing them again (a fine-tune's frozen
    base is then written once).  ``overwrite``: replace steps an earlier run
    committed under the root (see the module docstring); without it such a
    step makes ``save`` raise :class:`~shardkit.errors.CheckpointExists`.
    ``timeout`` (seconds or a ``timedelta``): how long a rank waits at a collective of a save, a load or the
    hot tier for the others before :class:`~shardkit.errors.CheckpointTimeout` (``save``'s default).
    ``retries``: how often a failed storage request is retried (the storage option ``{"shardkit": {"retries": N}}``).
    """

    def __init__(self, root_url: str, *, keep_last: int | None = None, async_save: bool = False,
                 dedup: bool | str = False, overwrite: bool = False,
                 compression: Any = None, storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None, writer: str | None = None, local: str | None = None,
                 local_world_size: int | None = None, replicas: int = 1, local_keep: int = 2,
                 durable_every: int = 1, timeout: float | timedelta | None = None, retries: int | None = None,
                 **save_options: Any) -> None:
        check_restartable()  # a torchrun restart that would hang says so in seconds (training/restarts.py)
        self.options = ManagerOptions.checked(
            keep_last=keep_last, async_save=async_save, dedup=dedup, overwrite=overwrite, compression=compression,
            storage_options=storage_options, process_group=process_group, writer=writer, local=local,
            local_world_size=local_world_size, replicas=replicas, local_keep=local_keep, durable_every=durable_every,
            timeout=timeout, retries=retries, save_options=save_options)
        hot = self.options.hot
        self.hot = None if hot is None else HotTier(hot.local, root_url=Storage(root_url, storage_options).url,
                                                    local_world_size=hot.local_world_size, replicas=hot.replicas,
                                                    local_keep=hot.local_keep, process_group=process_group)
        self.durable = DurableTier(Storage(root_url, storage_options), self.options)
        self.root_url = self.durable.root.url
        self.storage_options = self.options.storage_options
        self.last_load: LastLoad | None = None
        self._pending: Future | None = None
        self._pending_step: int | None = None

    @property
    def _tiers(self) -> list[Tier]:
        """The tiers a save goes to, in the order they decide (durable first: rank 0's refusal comes before
        any tier stages anything) -- and write (hot first, so the fast copy lands first)."""
        return [self.durable] + ([self.hot] if self.hot is not None else [])

    def url_of(self, step: int) -> str:
        return self.durable.url_of(step)

    def steps(self) -> list[int]:
        """Committed steps, ascending (read fresh from storage on each call)."""
        return self.durable.steps()

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: Any = None, *, data: ElasticSampler | None = None,
             stateful: Mapping[str, Stateful] | None = None, rng: bool = True) -> Future | None:
        """Save ``model`` (and ``optimizer``) as step ``step`` with JSON ``extra``; collective.

        ``data`` (an :class:`~shardkit.data.ElasticSampler`) saves the global
        data position, ``stateful`` the named objects (each global or per rank),
        and ``rng`` every rank's random generators (``shardkit.data``; stored as
        ``data.*`` and ``rng.*`` keys, JSON and tensors, no pickle).  Returns,
        with ``async_save=True``, a future that completes once the background
        save has committed *and* retention has run; else ``None``.
        """
        if not isinstance(step, int) or step < 0:
            raise ConfigurationError(f"step must be a non-negative integer, got {step!r}")
        meta = {"step": step, "extra": to_json_value(extra, "extra")}
        self.wait()
        with checkpoint_deadline("save", self.url_of(step), step, self.options.timeout):
            plans = [(tier, plan) for tier in self._tiers if (plan := tier.plan(step, meta)) is not None]
            durable = next((plan for tier, plan in plans if tier is self.durable), None)
            # a step for the hot tier alone takes the RNG state here and gathers it in the save's background
            # part (a collective the training thread need not wait for); a durable step plans with it whole
            alone = self.hot is not None and durable is None and data is None and not stateful
            deferred = InputSnapshot(rng=rng, called="CheckpointManager.save") if alone else None
            state = {**get_training_state(model, optimizer),
                     **(data_state_dict(data, stateful, rng=rng) if deferred is None else {})}
            if self.options.async_save and self.hot is None:  # async_save's own host copy and writer
                return self._track(step, self.durable.save_in_background(durable, state), durable)
            writes = []
            for i, (tier, plan) in enumerate(reversed(plans)):  # the hot tier first: a durable save shares its copy
                staged = (tier.stage(plan, state, background=self.options.async_save) if deferred is None
                          else self.hot.stage(plan, state, background=self.options.async_save, inputs=deferred))
                state = staged.state() if i + 1 < len(plans) else state
                writes.append((tier, plan, staged.write))
            if not self.options.async_save:
                for tier, plan, write in writes:
                    write(self.options.process_group)
                    tier.committed(plan, self._pending_step)
                return None
            return self._track(step, background_saver().run(lambda group: [w(group) for _, _, w in writes]),
                               durable)

    def _track(self, step: int, work: Future, durable: DurablePlan | None) -> Future:
        """The future :meth:`wait` waits on: ``work``, then the durable tier's retention."""
        done: Future = Future()
        done.set_running_or_notify_cancel()
        work.add_done_callback(lambda f: self._after_commit(f, done, durable))
        self._pending, self._pending_step = done, step if durable is not None else None
        return done

    def wait(self) -> None:
        """Wait for the background save in flight and the retention after it (re-raising a save's error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            finally:
                self._pending_step = None

    def _after_commit(self, upload: Future, done: Future, durable: DurablePlan | None) -> None:
        """Runs when the background save ends: retention first, then ``done`` (what :meth:`wait` waits on)."""
        error = upload.exception()
        if error is None and durable is None:
            done.set_result(None)
        elif error is None:
            log.info("step %d committed at %s (background save)", durable.step, durable.url)
            try:
                self.durable.committed(durable, self._pending_step)
            except ShardkitError as exc:  # retention is housekeeping; never fail a good save over it
                log.warning("checkpoint retention under %s failed: %s", self.root_url, exc)
            done.set_result(None)
        else:
            done.set_exception(error)

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             *, strict: bool = True, data: ElasticSampler | None = None,
             stateful: Mapping[str, Stateful] | None = None, rng: bool = True, verify_first: bool = False,
             from_dcp: str | None = None) -> Any:
        """Load committed step ``step`` into ``model``/``optimizer`` (any world size); return its ``extra``.

        ``data``, ``stateful``, ``rng`` and ``from_dcp`` as :meth:`load_latest` takes them; ``verify_first``
        as :func:`~shardkit.checkpoint.load` takes it (``True``: a damaged step leaves every target as it was).
        """
        self.wait()
        meta = self.durable.load_step(step, LoadTargets(model, optimizer, strict, data, stateful, rng, verify_first,
                                                        from_dcp))
        self.durable.run.resumed = step
        return meta.get("extra")

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, strict: bool = True, required: bool = False, data: ElasticSampler | None = None,
                    stateful: Mapping[str, Stateful] | None = None, rng: bool = True,
                    verify_first: bool = False, from_dcp: str | None = None) -> tuple[int, Any] | None:
        """Load the newest committed step into ``model``/``optimizer``; ``(step, extra)`` or ``None``.

        ``data`` continues an :class:`~shardkit.data.ElasticSampler` with exactly
        the next global batch (any world size); ``stateful`` restores named
        objects; ``rng`` restores every rank's random generators -- exactly at the
        world size that saved, by the documented re-seed rule at another (see
        docs/checkpoint.md, "Data position and RNG").  The RNG is restored last,
        after everything else, so nothing here draws from it afterwards.

        ``None`` means nothing to resume: silent on a fresh (empty or not yet
        created) root, a logged warning naming what was found otherwise (foreign
        checkpoints, interrupted saves, a root that cannot be created, only
        damaged steps).  ``required=True`` raises
        :class:`~shardkit.errors.CheckpointNotFound` instead, for jobs that must resume.

        A damaged step makes it try the next older one, which reloads every target.  Once a failed
        load had begun writing the targets (one pass, the default), it never reports a resume or a
        failure without saying so (:mod:`.step_fallback`): when every step is damaged, or the older
        step lacks a key the failed load touched (``strict=False``), it raises
        :class:`~shardkit.errors.CorruptCheckpoint`: the model is neither as it was nor any step.
        ``verify_first=True`` checks each step before writing (see ``load``).

        ``from_dcp``: the name a torch DCP loop saved model and optimizer under through a ``Stateful`` (the
        DCP tutorial's ``dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=f"{root}/step-{n}")``:
        ``from_dcp="app"``, keys ``app.model.*``, ``app.optim.*``).  With it, the ``step-<N>`` folders torch
        DCP committed count among the steps, and a step holding keys under that name loads model and
        optimizer from them; any other step (this manager's own saves) loads as usual.
        """
        self.wait()
        with checkpoint_deadline("load", self.root_url, None, self.options.timeout):
            found, how = resume_latest(self.durable, self.hot, LoadTargets(model, optimizer, strict, data, stateful,
                                                                           rng, verify_first, from_dcp), required)
        if how is not None:
            self.last_load = how
        return found
