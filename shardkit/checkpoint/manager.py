"""``CheckpointManager``: numbered steps under one root URL, newest committed wins.

Layout: ``<root>/step-<N>/`` is one native checkpoint (``N`` zero-padded so
listings sort).  The rules that make it crash-safe:

* A step exists only once its ``manifest.json`` is committed; a directory
  without one (an interrupted save) is never chosen, and listings are fresh
  (object-store listing caches are invalidated), so what ``steps()`` shows is
  what storage holds.
* Retention (``keep_last``) runs only after a newer step has committed, deletes
  a step's manifest first (so it stops being a checkpoint at once) and its data
  after, and never touches the newest committed step.  Uncommitted leftovers
  older than the newest committed step are removed too.
* ``load_latest`` lets rank 0 choose the step and tells the others (JSON over
  the process group), so every rank loads the same one.  When the newest
  committed step turns out damaged (checksum, missing file) it falls back to
  the next older one and says so.
"""

from __future__ import annotations

import re
import warnings
from concurrent.futures import Future
from typing import Any, Mapping

import torch
import torch.nn as nn

from shardkit.checkpoint.api import async_save as _async_save
from shardkit.checkpoint.api import load, save
from shardkit.checkpoint.comm import Dist
from shardkit.checkpoint.flatten import to_json_value
from shardkit.checkpoint.manifest import MANIFEST_NAME
from shardkit.checkpoint.state_dict import get_state_dict, set_state_dict
from shardkit.checkpoint.storage import Storage
from shardkit.errors import ConfigurationError, CorruptCheckpoint, ShardkitError

__all__ = ["CheckpointManager", "step_dir"]

_STEP_RE = re.compile(r"^step-(\d{1,19})$")


def step_dir(step: int) -> str:
    return f"step-{step:010d}"


class CheckpointManager:
    """Save numbered steps under ``root_url``, resume from the newest committed one.

    ``keep_last``: keep only the newest ``keep_last`` committed steps (``None``
    keeps all).  ``async_save``: ``save`` returns once the state is on the host
    and uploads in the background (the next ``save`` or :meth:`wait` waits for
    it).  ``compression`` and ``storage_options`` are passed to every save/load.
    """

    def __init__(self, root_url: str, *, keep_last: int | None = None, async_save: bool = False,
                 compression: Any = None, storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None, **save_options: Any) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigurationError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        self.root = Storage(root_url, storage_options)
        self.root_url = self.root.url
        self.keep_last = keep_last
        self.async_save = async_save
        self.compression = compression
        self.storage_options = dict(storage_options or {})
        self.process_group = process_group
        self.save_options = save_options
        self._pending: Future | None = None
        self._pending_step: int | None = None

    # -- listing ---------------------------------------------------------
    def url_of(self, step: int) -> str:
        return self.root.child(step_dir(step)).url

    def _all_step_dirs(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for name in self.root.listdir():
            m = _STEP_RE.match(name)
            if m:
                found[int(m.group(1))] = name
        return found

    def steps(self) -> list[int]:
        """Committed steps, ascending (read fresh from storage on each call)."""
        return sorted(step for step, name in self._all_step_dirs().items()
                      if self.root.child(name).exists(MANIFEST_NAME))

    # -- saving ----------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: Any = None) -> Future | None:
        """Save ``model`` (and ``optimizer``) as step ``step`` with JSON ``extra``; collective.

        Returns the future of the background save with ``async_save=True``, else ``None``.
        """
        if not isinstance(step, int) or step < 0:
            raise ConfigurationError(f"step must be a non-negative integer, got {step!r}")
        meta = {"step": step, "extra": to_json_value(extra, "extra")}
        self.wait()
        state = get_state_dict(model, optimizer)
        url = self.url_of(step)
        opts = dict(compression=self.compression, storage_options=self.storage_options, meta=meta,
                    **self.save_options)
        if self.async_save:
            future = _async_save(state, url, **opts)
            self._pending, self._pending_step = future, step
            future.add_done_callback(lambda f, s=step: self._after_commit(s, f))
            return future
        save(state, url, process_group=self.process_group, **opts)
        self._retain(step)
        return None

    def wait(self) -> None:
        """Wait for the background save in flight (re-raising its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _after_commit(self, step: int, future: Future) -> None:
        if future.exception() is None:
            try:
                self._retain(step)
            except ShardkitError as exc:  # retention is housekeeping; never fail a good save over it
                warnings.warn(f"checkpoint retention under {self.root_url} failed: {exc}", stacklevel=1)

    def _retain(self, committed: int) -> None:
        """After ``committed`` landed: drop steps beyond ``keep_last`` and older uncommitted leftovers."""
        if Dist().rank != 0:
            return
        dirs = self._all_step_dirs()
        committed_steps = [s for s, name in sorted(dirs.items()) if self.root.child(name).exists(MANIFEST_NAME)]
        newest = max(committed_steps, default=committed)
        doomed = [s for s in dirs if s < newest and s not in committed_steps and s != self._pending_step]
        if self.keep_last is not None:
            doomed += [s for s in committed_steps[:-self.keep_last] if s != newest]
        for s in sorted(set(doomed)):
            step_store = self.root.child(dirs[s])
            step_store.delete([MANIFEST_NAME])  # stops being a checkpoint first
            step_store.delete_tree()

    # -- loading ---------------------------------------------------------
    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             *, strict: bool = True) -> Any:
        """Load committed step ``step`` into ``model``/``optimizer`` (any world size); return its ``extra``."""
        self.wait()
        state = get_state_dict(model, optimizer)
        meta = load(state, self.url_of(step), strict=strict, storage_options=self.storage_options,
                    process_group=self.process_group)
        set_state_dict(model, optimizer, state, strict=strict)
        return meta.get("extra")

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, strict: bool = True) -> tuple[int, Any] | None:
        """Load the newest committed step into ``model``/``optimizer``; ``(step, extra)`` or ``None``."""
        self.wait()
        dist = Dist(self.process_group)
        candidates = dist.broadcast_json(self.steps() if dist.rank == 0 else None)
        if not candidates:
            return None
        state = get_state_dict(model, optimizer)
        for step in reversed(candidates):
            try:
                meta = load(state, self.url_of(step), strict=strict, storage_options=self.storage_options,
                            process_group=self.process_group)
            except CorruptCheckpoint as exc:
                warnings.warn(f"step {step} under {self.root_url} is damaged ({exc}); trying an older step",
                              stacklevel=2)
                continue
            set_state_dict(model, optimizer, state, strict=strict)
            return step, meta.get("extra")
        return None
