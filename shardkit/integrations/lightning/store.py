"""Where a Lightning strategy's checkpoints go: shardkit's save/load, or a ``CheckpointManager`` behind pointers.

Two modes, chosen by the strategy's options:

* **One checkpoint per path** (the default).  Each path Lightning names
  (``ModelCheckpoint``'s ``epoch=0-step=4.ckpt``, ``last.ckpt``, the path of
  ``trainer.save_checkpoint``) is one shardkit checkpoint directory, at any
  fsspec URL, written by :func:`shardkit.checkpoint.save` (or ``async_save``),
  with the loop's state as JSON in its manifest.  ``shardkit verify PATH``
  checks it; ``remove`` deletes its manifest first, so a half-removed folder
  is never taken for a checkpoint.
* **Managed** (``keep_last``, ``dedup`` or ``local=``).  The sharded state goes
  to a :class:`~shardkit.checkpoint.CheckpointManager` rooted at the folder of
  Lightning's path, as ``step-<global step>`` (written once however many
  Lightning names point at it), and each Lightning path becomes a small JSON
  pointer file holding the step and the loop's state.  Retention, dedup and
  the node-local hot tier are the manager's; removing a pointer leaves the
  step to ``keep_last``.

Loading reads any of the three kinds a path can hold: a shardkit checkpoint,
a pointer, or the DCP folder Lightning's own ``ModelParallelStrategy`` writes
(``meta.pt`` read with ``weights_only=True``).
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from shardkit.checkpoint import (  # resolved now, not inside the first timed save or resume
    CheckpointManager,
    get_training_state,
    load,
    save,
    set_training_state,
)
from shardkit.checkpoint import (
    async_save as save_in_background,
)
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.names import split_url
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CheckpointNotFound, ConfigurationError, IncompatibleStateDict, UnsafeCheckpoint
from shardkit.integrations.lightning.state import META_KEY, decode_rest, encode_rest

__all__ = ["CheckpointStore", "lightning_meta"]

log = logging.getLogger(__name__)

POINTER_FORMAT = "shardkit-lightning-pointer"
MANIFEST = "manifest.json"
DCP_METADATA, LIGHTNING_META = ".metadata", "meta.pt"  # what Lightning's ModelParallelStrategy writes
MANAGER_ONLY = ("local_world_size", "replicas", "local_keep", "durable_every")


def _split_url(url: str) -> tuple[str, str]:
    parent, name = split_url(url)
    return (parent or "."), name  # a bare name is in the working directory


class CheckpointStore:
    """Saves, loads and removes the checkpoints of one strategy (see the module docstring for the two modes)."""

    def __init__(self, *, async_save: bool = False, keep_last: int | None = None, dedup: bool | str = False,
                 local: str | None = None, compression: Any = None,
                 storage_options: Mapping[str, Any] | None = None, **hot_tier: Any) -> None:
        unknown = set(hot_tier) - set(MANAGER_ONLY)
        if unknown:
            raise ConfigurationError(f"unknown checkpoint option(s) {sorted(unknown)}")
        if local is None and hot_tier:
            raise ConfigurationError(f"{', '.join(sorted(hot_tier))} configure the node-local hot tier: pass "
                                     f"local= (a directory path, e.g. '/dev/shm/run/node{{node}}') too")
        self.async_save = async_save
        self.compression = compression
        self.storage_options = dict(storage_options or {})
        self.managed = keep_last is not None or bool(dedup) or local is not None
        self.manager_options = dict(keep_last=keep_last, dedup=dedup, local=local, async_save=async_save,
                                    compression=compression, **hot_tier)
        self._managers: dict[str, CheckpointManager] = {}
        self._saved_step: dict[str, int] = {}  # per manager root: the step this process last saved there
        self._pending: tuple[str, Future] | None = None
        self._pointer: Future | None = None  # rank 0: the pointer file written once its background step commits
        self.agree: Callable[[Any], Any] = lambda value: value  # rank 0's value on every rank (the strategy's
        # broadcast): decisions read from storage must not differ between ranks

    def set_ranks_per_node(self, ranks: int) -> None:
        """The hot tier's ranks per node, when not given: the strategy's devices per node (Lightning's own
        launcher does not set torchrun's ``LOCAL_WORLD_SIZE``, which the manager would read)."""
        if self.manager_options.get("local") is not None and self.manager_options.get("local_world_size") is None:
            self.manager_options["local_world_size"] = ranks

    # -- saving ------------------------------------------------------------
    def save(self, url: str, tensors: dict[str, Any], rest: dict[str, Any], *, step: int, model: nn.Module,
             optimizers: Sequence[torch.optim.Optimizer], storage_options: Mapping[str, Any] | None = None) -> None:
        """Save ``tensors`` (live, sharded) and the loop's ``rest`` as the checkpoint ``url``; collective."""
        text = encode_rest(rest, where=f"the Lightning state saved to {url}")
        options = {**self.storage_options, **(storage_options or {})}
        self.wait()
        if self.managed:
            self._save_managed(url, text, step, model, optimizers, options)
            return
        kwargs = dict(compression=self.compression, storage_options=options or None, meta={META_KEY: text})
        if self.async_save:
            self._pending = (url, save_in_background(tensors, url, **kwargs))
        else:
            save(tensors, url, **kwargs)

    def _save_managed(self, url: str, text: str, step: int, model: nn.Module,
                      optimizers: Sequence[torch.optim.Optimizer], options: dict[str, Any]) -> None:
        if len(optimizers) > 1:
            raise ConfigurationError(f"saving {url}: keep_last, dedup and local= keep one optimizer's state per "
                                     f"step, and this run has {len(optimizers)}; leave those options unset")
        root, name = _split_url(url)
        manager = self._manager(root, options)
        committed = None
        if self._saved_step.get(manager.root_url) != step:  # ModelCheckpoint's top-k and last share one step
            committed = manager.save(step, model, optimizers[0] if optimizers else None)  # a Future when async
            self._saved_step[manager.root_url] = step
        if Dist().rank != 0:
            return
        pointer = json.dumps({"format": POINTER_FORMAT, "step": step, META_KEY: text}).encode()

        def write() -> None:
            Storage(root, options or None).write_then_replace(name, lambda out: out.write(pointer))
            log.info("%s points at step %d under %s", url, step, manager.root_url)

        if committed is None:
            write()
        else:  # a pointer never names a step before it committed
            self._pointer = _after(committed, write)

    def _manager(self, root: str, options: Mapping[str, Any]) -> CheckpointManager:
        if root not in self._managers:
            opts = self.manager_options if self.managed else {}
            self._managers[root] = CheckpointManager(root, storage_options=dict(options) or None, **opts)
        return self._managers[root]

    def wait(self) -> None:
        """Wait for the background save in flight (re-raising its error), and every manager's."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].result()
            log.info("background save to %s committed", pending[0])
        for manager in self._managers.values():
            manager.wait()
        pointer, self._pointer = self._pointer, None
        if pointer is not None:
            pointer.result()

    # -- loading -----------------------------------------------------------
    def load(self, url: str, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], *,
             model_key: str = "state_dict", strict: bool = True,
             storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Load ``url`` into the model and the optimizers (by the key each is stored under) in place, at any
        world size; return the loop's state."""
        self.wait()
        options = {**self.storage_options, **(storage_options or {})}
        storage = Storage(url, options or None)
        if storage.exists(MANIFEST):
            meta = self._load_tensors(url, model, model_key, optimizers, strict, options)
            if META_KEY not in meta:
                raise IncompatibleStateDict(f"{url} is a shardkit checkpoint without Lightning's loop state "
                                            f"(manifest meta has no {META_KEY!r} entry): it was not written by "
                                            f"ShardkitStrategy; load it with shardkit.checkpoint.load instead")
            return decode_rest(meta[META_KEY], where=url)
        if storage.exists(DCP_METADATA):
            self._load_tensors(url, model, model_key, optimizers, strict, options)  # the format is detected
            return lightning_meta(storage, url)
        if storage.fs.isfile(storage.root):
            return self._load_pointer(url, model, list(optimizers.values()), strict, options)
        raise CheckpointNotFound(f"no checkpoint at {url}: neither a shardkit checkpoint ({MANIFEST}), a Lightning "
                                 f"distributed checkpoint ({DCP_METADATA} and {LIGHTNING_META}) nor a pointer file")

    def _load_tensors(self, url: str, model: nn.Module, model_key: str,
                      optimizers: Mapping[str, torch.optim.Optimizer], strict: bool,
                      options: Mapping[str, Any]) -> dict[str, Any]:
        targets: dict[str, Any] = {model_key: get_training_state(model)["model"]}
        targets.update({key: get_training_state(model, o)["optim"] for key, o in optimizers.items()})
        # without optimizers (validate, test) the stored optimizer states are not wanted: only the model's keys
        meta = load(targets, url, strict=strict and bool(optimizers), storage_options=options or None)
        for key, optimizer in optimizers.items():
            set_training_state(model, optimizer, {"model": targets[model_key], "optim": targets[key]},
                                   strict=strict)
        return meta

    def _load_pointer(self, url: str, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
                      options: Mapping[str, Any]) -> dict[str, Any]:
        root, name = _split_url(url)
        try:
            doc = json.loads(Storage(root, options or None).read_bytes(name))
            step, text = doc["step"], doc[META_KEY]
            if doc.get("format") != POINTER_FORMAT or not isinstance(step, int):
                raise ValueError(f"format {doc.get('format')!r}, step {step!r}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise IncompatibleStateDict(f"{url} is a file but not a checkpoint pointer ShardkitStrategy wrote "
                                        f"({exc}); a torch.save .ckpt file is not read (pickle)") from exc
        if len(optimizers) > 1:
            raise ConfigurationError(f"loading {url}: a managed step holds one optimizer's state, this run has "
                                     f"{len(optimizers)}")
        manager = self._manager(root, options)
        optimizer = optimizers[0] if optimizers else None
        newest = self.agree(max(manager.steps(), default=-1) if Dist().rank == 0 else None)
        strict = strict and optimizer is not None  # validate/test: the step's optimizer state is not wanted
        resumed = manager.load_latest(model, optimizer, strict=strict) if step >= newest else None
        if resumed is None or resumed[0] != step:  # an older pointer (a top-k "best"), or the hot tier lacked it
            manager.load(step, model, optimizer, strict=strict)
        log.info("loaded %s: step %d under %s (%s)", url, step, manager.root_url,
                 manager.last_load.source if manager.last_load and resumed else "durable")
        return decode_rest(text, where=url)

    def last_load(self, url: str) -> Any:
        """The manager's record of how the last pointer load under ``url``'s folder resumed (tier, seconds)."""
        root, _ = _split_url(url)
        manager = self._managers.get(root)
        return None if manager is None else manager.last_load

    # -- removing ----------------------------------------------------------
    def remove(self, url: str) -> None:
        """Remove the checkpoint (or pointer) at ``url``; rank 0 deletes, every rank waits for saves first."""
        self.wait()
        if Dist().rank != 0:
            return
        storage = Storage(url, self.storage_options or None)
        if storage.is_local and os.path.islink(storage.root):  # save_last="link": the link goes, not its target
            os.unlink(storage.root)
        elif storage.fs.isfile(storage.root):
            parent, name = _split_url(url)
            Storage(parent, self.storage_options or None).delete([name])
        elif storage.exists(MANIFEST):
            storage.delete([MANIFEST])  # it stops being a checkpoint before any data goes
            storage.delete_tree()
        elif storage.exists(DCP_METADATA) and storage.exists(LIGHTNING_META):  # ModelParallelStrategy's own
            storage.delete([DCP_METADATA])
            storage.delete_tree()
        elif storage.exists(""):  # not a checkpoint either engine wrote: someone else's, never deleted
            log.warning("not removing %s: it holds neither a shardkit checkpoint (%s) nor a Lightning distributed "
                        "checkpoint (%s and %s), so it is not one this strategy wrote", url, MANIFEST, DCP_METADATA,
                        LIGHTNING_META)
            return
        else:
            return
        log.info("removed %s", url)


def _after(future: Future, action: Callable[[], None]) -> Future:
    """A future of ``action()``, run once ``future`` succeeded (skipped when it failed: its error is raised
    by whoever waits on ``future``)."""
    done: Future = Future()
    done.set_running_or_notify_cancel()

    def run(finished: Future) -> None:
        try:
            if finished.exception() is None:
                action()
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(exc)

    future.add_done_callback(run)
    return done


def lightning_meta(storage: Storage, url: str) -> dict[str, Any]:
    """The loop state Lightning's ModelParallelStrategy keeps in ``meta.pt``, read without running pickle code."""
    if not storage.exists(LIGHTNING_META):
        raise CheckpointNotFound(f"{url} is a DCP folder without Lightning's {LIGHTNING_META}: not a checkpoint "
                                 f"Lightning's ModelParallelStrategy wrote")
    with storage.fs.open(storage.path(LIGHTNING_META), "rb") as f:
        try:
            meta = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises UnpicklingError, RuntimeError or others for forbidden globals
            raise UnsafeCheckpoint(f"{url}/{LIGHTNING_META} holds objects that only pickle can rebuild, which "
                                   f"shardkit does not run ({exc}); keep hyper-parameters to plain types") from exc
    if not isinstance(meta, dict):
        raise IncompatibleStateDict(f"{url}/{LIGHTNING_META} holds a {type(meta).__name__}, not Lightning's dict")
    return meta
