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
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from shardkit.checkpoint.formats.native import MANIFEST_NAME
from shardkit.checkpoint.io.deadline import checkpoint_deadline, resolve_timeout
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage, with_retries
from shardkit.checkpoint.state.training_state import get_training_state, set_training_state
from shardkit.checkpoint.state.tree import to_json_value
from shardkit.checkpoint.training.async_save.saver import async_save as _async_save
from shardkit.checkpoint.training.async_save.saver import background_saver
from shardkit.checkpoint.training.dedup import digest_algorithm
from shardkit.checkpoint.training.hot.resume import LastLoad, resume_hot
from shardkit.checkpoint.training.hot.save import run_hot_save
from shardkit.checkpoint.training.hot.tier import HotTier, durable_view
from shardkit.checkpoint.training.input_state import check_input_state, stored_step
from shardkit.checkpoint.training.load import load
from shardkit.checkpoint.training.restarts import check_restartable
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
from shardkit.checkpoint.training.step_fallback import load_newest_intact, why_nothing
from shardkit.data import ElasticSampler, Stateful, data_state_dict, load_data_state_dict
from shardkit.errors import (
    CheckpointExists,
    CheckpointNotFound,
    ConfigurationError,
    ShardkitError,
)
from shardkit.wire.job_log import warning_once_per_job

__all__ = ["CheckpointManager", "step_dir"]

log = logging.getLogger("shardkit.checkpoint.training.manager")

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
        if not isinstance(durable_every, int) or isinstance(durable_every, bool) or durable_every < 1:
            raise ConfigurationError(f"durable_every must be a positive integer, got {durable_every!r}")
        if local is None and (local_world_size, replicas, local_keep, durable_every) != (None, 1, 2, 1):
            raise ConfigurationError("local_world_size, replicas, local_keep and durable_every configure the "
                                     "node-local tier: pass local= (a directory path, e.g. '/dev/shm/run/node{node}')")
        self._hot = None if local is None else HotTier(local, root_url=Storage(root_url, storage_options).url,
                                                       local_world_size=local_world_size, replicas=replicas,
                                                       local_keep=local_keep, process_group=process_group)
        self.durable_every = durable_every
        self.timeout = resolve_timeout(timeout)  # None: SHARDKIT_CHECKPOINT_TIMEOUT, else 600 s (io/deadline.py)
        self.last_load: LastLoad | None = None
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigurationError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if writer is not None and not async_save:
            raise ConfigurationError(f"writer={writer!r} chooses how background saves are written; pass "
                                     f"async_save=True with it")
        self.writer = writer
        self.root = Storage(root_url, storage_options)
        self.root_url = self.root.url
        self.keep_last = keep_last
        self.async_save = async_save
        self.dedup = digest_algorithm(dedup) if dedup else None
        self.compression = compression
        self.storage_options = with_retries(storage_options, retries) or {}
        self.process_group = process_group
        self.save_options = save_options
        self._run = RunSteps(overwrite=bool(overwrite))  # which steps under the root are this run's
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._warned: set[str] = set()

    # -- listing ---------------------------------------------------------
    def url_of(self, step: int) -> str:
        return self.root.child(step_dir(step)).url

    def _all_step_dirs(self) -> dict[int, str]:
        return step_dirs(self.root)

    def steps(self) -> list[int]:
        """Committed steps, ascending (read fresh from storage on each call)."""
        return sorted(step for step, name in self._all_step_dirs().items()
                      if self.root.child(name).exists(MANIFEST_NAME))

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning(message)

    # -- saving ----------------------------------------------------------
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
        with checkpoint_deadline("save", self.url_of(step), step, self.timeout):
            return self._save(step, meta, model, optimizer, data, stateful, rng)

    def _save(self, step: int, meta: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None,
              data: ElasticSampler | None, stateful: Mapping[str, Stateful] | None, rng: bool) -> Future | None:
        durable = self._hot is None or step % self.durable_every == 0
        opts = self._durable_options(step, meta) if durable else None
        state = {**get_training_state(model, optimizer), **data_state_dict(data, stateful, rng=rng)}
        if self._hot is not None:
            return self._save_hot(step, state, meta, opts)
        url = self.url_of(step)
        if self.async_save:
            upload = _async_save(state, url, writer=self.writer, **opts)
            done: Future = Future()
            done.set_running_or_notify_cancel()
            upload.add_done_callback(lambda f, s=step: self._after_commit(s, f, done))
            self._pending, self._pending_step = done, step
            return done
        started = time.perf_counter()
        save(state, url, process_group=self.process_group, **opts)
        log.info("step %d committed at %s in %.2f s", step, url, time.perf_counter() - started)
        self._run.written.add(step)
        self._retain(step)
        return None

    def _durable_options(self, step: int, meta: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's decision about the durable root (refusing a step in the way), as ``save`` options."""
        plan = self._on_rank0(lambda: self._save_plan(step))  # one decision for all ranks
        if plan["in_the_way"] and not self._run.overwrite:
            raise CheckpointExists(self._run.refusal(step, plan["in_the_way"], self.root_url))
        if plan["supersedes"]:
            meta["run"] = self._run.run  # what makes the record of the steps it supersedes take effect
        # a step committed there meanwhile by someone else is refused at commit, not replaced
        opts = dict(compression=self.compression, storage_options=self.storage_options, meta=meta,
                    **self.save_options,
                    overwrite=self._run.may_replace(step, plan["in_the_way"]) or step in plan["superseded"])
        if self.dedup:
            base = plan["base"]
            opts.update(digests=self.dedup, reuse_from=None if base is None else self.url_of(base))
        return opts

    def _save_hot(self, step: int, state: dict[str, Any], meta: dict[str, Any],
                  durable: dict[str, Any] | None) -> Future | None:
        """A save with the node-local tier: the hot copies every time, the durable root when ``durable`` (its
        save options) is given -- from the same host copy when in the background."""
        assert self._hot is not None
        job, local = self._hot.prepare(step, state, meta, to_host=self.async_save)
        layout, url = self._hot.layout(), self.url_of(step)
        if not self.async_save:
            run_hot_save(layout, job, self.process_group)
            if durable is not None:
                save(state, url, process_group=self.process_group, **durable)
                self._run.written.add(step)
                self._retain(step)
            return None
        durable_state = durable_view(local, job.tensors) if durable is not None else None

        def in_background(group: Any) -> None:
            run_hot_save(layout, job, group)
            if durable_state is not None:
                save(durable_state, url, process_group=group, **durable)

        work = background_saver().run(in_background)
        done: Future = Future()
        done.set_running_or_notify_cancel()
        work.add_done_callback(lambda f, s=step: self._after_commit(s, f, done, durable=durable is not None))
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

    def _save_plan(self, step: int) -> dict[str, Any]:
        """Rank 0's view before saving ``step``: the committed steps in its way and the dedup base; with
        ``overwrite=True``, the steps above it recorded as superseded by it before anything is written.

        Only directories at or above ``step`` (and this run's own) are probed for a manifest, so a long
        history costs one listing.
        """
        dirs = self._all_step_dirs()
        known = (self._run.written | {self._run.resumed}) - {None}
        committed = {s for s in dirs if (s >= step or s in known) and committed_at(self.root, dirs, s)}
        recorded = read_superseded(self.root)
        gone = in_force(self.root, dirs, recorded)  # superseded by a committed step: not in anyone's way
        live = {old: rec for old, rec in recorded.items() if old in gone}  # the rest: saves that never committed
        in_the_way = self._run.in_the_way(step, committed - gone)
        supersedes = [old for old in in_the_way if old > step] if self._run.overwrite else []
        live.update({old: Supersession(step, self._run.run) for old in supersedes})
        if live != recorded:
            write_superseded(self.root, live)
        return {"in_the_way": in_the_way, "superseded": sorted(gone), "supersedes": bool(supersedes),
                "base": self._run.dedup_base(step, committed) if self.dedup else None}

    def _on_rank0(self, decide: Callable[[], Any]) -> Any:
        return Dist(self.process_group).decided_on_rank0(decide, self.root_url)

    def _after_commit(self, step: int, upload: Future, done: Future, durable: bool = True) -> None:
        """Runs when the background save ends: retention first, then ``done`` (what :meth:`wait` waits on)."""
        error = upload.exception()
        if error is None and not durable:
            done.set_result(None)
        elif error is None:
            log.info("step %d committed at %s (background save)", step, self.url_of(step))
            self._run.written.add(step)
            try:
                self._retain(step)
            except ShardkitError as exc:  # retention is housekeeping; never fail a good save over it
                log.warning("checkpoint retention under %s failed: %s", self.root_url, exc)
            done.set_result(None)
        else:
            done.set_exception(error)

    def _retain(self, committed: int) -> None:
        """After ``committed`` landed: retention on rank 0 (:func:`~.retention.retain`)."""
        if Dist().rank == 0:
            retain(self.root, committed, run=self._run, keep_last=self.keep_last, pending=self._pending_step,
                   warn_once=self._warn_once)

    # -- loading ---------------------------------------------------------
    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             *, strict: bool = True, data: ElasticSampler | None = None,
             stateful: Mapping[str, Stateful] | None = None, rng: bool = True, verify_first: bool = False,
             from_dcp: str | None = None) -> Any:
        """Load committed step ``step`` into ``model``/``optimizer`` (any world size); return its ``extra``.

        ``data``, ``stateful``, ``rng`` and ``from_dcp`` as :meth:`load_latest` takes them; ``verify_first``
        as :func:`~shardkit.checkpoint.load` takes it (``True``: a damaged step leaves every target as it was).
        """
        self.wait()
        meta = self._load_step(step, model, optimizer, strict, data, stateful, rng, verify_first, from_dcp)
        self._run.resumed = step
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
        with checkpoint_deadline("load", self.root_url, None, self.timeout):
            return self._load_latest(model, optimizer, strict, required, data, stateful, rng, verify_first, from_dcp)

    def _load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool, required: bool,
                     data: ElasticSampler | None, stateful: Mapping[str, Stateful] | None, rng: bool,
                     verify_first: bool, from_dcp: str | None) -> tuple[int, Any] | None:
        started = time.perf_counter()
        candidates = self._on_rank0(lambda: self._resumable_steps(dcp=from_dcp is not None))
        if self._hot is not None:
            hot = resume_hot(self._hot, model, optimizer, data=data, stateful=stateful, rng=rng,
                             at_least=candidates[-1] if candidates else 0)
            if hot is not None:
                step, extra, source = hot
                self._run.resumed = max((s for s in candidates if s <= step), default=None)
                self.last_load = LastLoad(step, source, time.perf_counter() - started)
                return step, extra
            log.info("resuming from the durable root %s (the hot tier has no newer step every rank can assemble)",
                     self.root_url)
        if not candidates:
            return self._nothing(self._on_rank0(lambda: why_nothing(self.root, self._all_step_dirs())), required)
        loaded = load_newest_intact(candidates, lambda s: self._load_step(
            s, model, optimizer, strict, data, stateful, rng, verify_first, from_dcp), self.root_url,
            Dist(self.process_group))
        if loaded is None:
            every = f"every committed step ({', '.join(map(str, candidates))}) is damaged"
            return self._nothing(f"{every}, and this manager will not save over them without overwrite=True", required)
        step, meta = loaded
        log.info("resumed from step %d at %s", step, self.url_of(step))
        self._run.resumed = step
        self.last_load = LastLoad(step, "durable", time.perf_counter() - started)
        return step, meta.get("extra")

    def _resumable_steps(self, dcp: bool = False) -> list[int]:
        """Committed steps (with ``dcp``, torch DCP's too), ascending, without those an ``overwrite=True`` run
        superseded (its step committed; their removal may not have happened yet)."""
        committed = sorted(set(self.steps()) | (dcp_steps(self.root, self._all_step_dirs()) if dcp else set()))
        superseded = in_force(self.root, self._all_step_dirs(), read_superseded(self.root))
        if superseded & set(committed):
            log.info("not resuming from steps %s under %s: superseded by a later run's steps (overwrite=True)",
                     ", ".join(map(str, sorted(superseded & set(committed)))), self.root_url)
        return [s for s in committed if s not in superseded]

    def _load_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool,
                   data: ElasticSampler | None, stateful: Mapping[str, Stateful] | None, rng: bool,
                   verify_first: bool, from_dcp: str | None = None) -> Any:
        """Model and optimizer in place, then -- once they loaded -- data position, objects, and the RNG last."""
        url = self.root.child(self._all_step_dirs().get(step, step_dir(step))).url  # a DCP loop's step-100 too
        with checkpoint_deadline("load", url, step, self.timeout):
            return self._load_step_at(url, step, model, optimizer, strict, data, stateful, rng, verify_first, from_dcp)

    def _load_step_at(self, url: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                      strict: bool, data: ElasticSampler | None, stateful: Mapping[str, Stateful] | None, rng: bool,
                      verify_first: bool, from_dcp: str | None) -> Any:
        inputs, under = stored_step(url, from_dcp, self.storage_options)
        restores_inputs = data is not None or bool(stateful) or (rng and "rng" in inputs)
        check_input_state(step, inputs, data, stateful, rng=rng and "rng" in inputs, restores=restores_inputs,
                          process_group=self.process_group)
        training = get_training_state(model, optimizer)
        state = {**({under: training} if under else training), **inputs}
        meta = load(state, url, strict=strict, storage_options=self.storage_options,
                    process_group=self.process_group, verify_first=verify_first)
        set_training_state(model, optimizer, training, strict=strict)
        if restores_inputs:
            load_data_state_dict({k: state[k] for k in inputs}, data, stateful, rng=rng and "rng" in state)
        return meta

    def _nothing(self, why: str | None, required: bool) -> None:
        if required:
            raise CheckpointNotFound(f"nothing to resume under {self.root_url}: "
                                     f"{why or 'no committed step-<N> directory'}")
        if why:
            warning_once_per_job(log, "nothing to resume under %s: %s; starting from scratch", self.root_url, why,
                                 process_group=self.process_group)
        return None
