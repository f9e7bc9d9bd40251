"""``ShardkitCheckpointManager``: torchtitan's checkpoint seam (``BaseCheckpointManager``) on shardkit.

torchtitan's trainer builds whatever ``config.checkpoint`` is
(``Trainer.Config.checkpoint: BaseCheckpointManager.Config``; ``build()``
constructs the class that declares the config), so this manager is chosen by
putting its ``Config`` there -- in a config_registry function, or with
``--override.imports shardkit.integrations.torchtitan.override.shardkit_checkpoint``
(:mod:`~shardkit.integrations.torchtitan.override`).

It keeps torchtitan's contract: ``<dump_folder>/<folder>/step-N``, ``interval``,
``enable_first_step_checkpoint``, ``keep_latest_k``, ``load_step``,
``initial_load_path`` / ``initial_load_model_only`` / ``initial_load_in_hf``,
``last_save_model_only`` / ``export_dtype`` / ``last_save_in_hf``,
``exclude_from_loading``, ``load_only``, ``async_mode``, a model-only step 0
(seed checkpoint).  What changes is the engine: each step is a shardkit
checkpoint (checksummed, committed by its manifest, any fsspec URL, loadable at
another world size), a step without a commit is never resumed, and torchtitan's
own DCP steps load too (their data loader position, pickle bytes, is not read).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

import shardkit.checkpoint as skc
from shardkit.checkpoint.formats import NATIVE
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CheckpointNotFound, ConfigurationError, IncompatibleStateDict, error_record, from_record
from shardkit.integrations.requirements import import_framework
from shardkit.integrations.torchtitan import hf, steps
from shardkit.integrations.torchtitan.state import (
    DATALOADER_KEY,
    MODEL_KEY,
    flat_keys,
    model_state,
    restore_dataloader,
    saved_names,
    training_state,
)
from shardkit.wire.collectives import all_gather_json

_base = import_framework("torchtitan.components.checkpointer.base", "torchtitan")
_titan_config = import_framework("torchtitan.config", "torchtitan")

__all__ = ["ShardkitCheckpointManager", "ASYNC_MODES"]

log = logging.getLogger(__name__)

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


def _agreed(probe: Callable[[], Any]) -> Any:
    """``probe()`` (JSON) as rank 0 found it, on every rank: one listing of the folder (not one per rank,
    which on an object store is a request per rank) decides which step every rank loads.  What rank 0
    raised, every rank raises, as the same shardkit error class."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return probe()
    answer, failure = None, None
    if dist.get_rank() == 0:
        try:
            answer = {"value": probe()}
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the gather for it
            answer, failure = {"error": error_record(exc)}, exc
    first = all_gather_json(answer)[0]
    if failure is not None:
        raise failure
    if "error" in first:
        raise from_record(first["error"])
    return first["value"]


class ShardkitCheckpointManager(_base.BaseCheckpointManager):
    """torchtitan's checkpoint manager with shardkit as the engine (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_base.BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: save returns once committed; ``async``: once the state is on the host, the files written
        by a thread; ``async_with_pinned_mem``: the same, the files written by shardkit's writer process."""

        compression: str | None = None
        """``None``, ``"zstd"`` or ``"zstd:LEVEL"`` for every chunk saved."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """fsspec options for a remote ``folder`` / ``initial_load_path`` (s3://, gs://, az://, ...)."""

        verify_first: bool = False
        """Check every byte of a step before any rank writes a target (all or nothing)."""

        def __post_init__(self) -> None:
            _base.BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in ASYNC_MODES:
                raise ConfigurationError(f"Invalid async_mode: {self.async_mode!r}; use one of "
                                         f"{', '.join(ASYNC_MODES)}")
            self.async_mode = mode

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future: Future | None = None
        # set before anything below can raise: close() runs from __del__ of a manager whose __init__ failed
        self.purge_thread: threading.Thread | None = None
        if not self.enable:
            return
        self.folder = f"{base_folder.rstrip('/')}/{config.folder}" if base_folder else config.folder
        self.config = config
        self.interval = config.interval
        self.states = states
        self.states.update({_base.MODEL: _base.ModelWrapper(model_parts), _base.OPTIMIZER: optimizers,
                            _base.DATALOADER: dataloader, _base.LR_SCHEDULER: lr_schedulers})
        self.load_only = config.load_only
        self.exclude_from_loading = tuple(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.keep_latest_k = config.keep_latest_k
        self.export_dtype = _titan_config.TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ConfigurationError("checkpoint.last_save_in_hf is True, but the model has no state-dict adapter "
                                     f"to name its weights for Hugging Face (saving under {self.folder})")
        if config.initial_load_in_hf_quantized:
            raise ConfigurationError("checkpoint.initial_load_in_hf_quantized: packed quantized Hugging Face "
                                     f"weights ({config.initial_load_path}) need the model's own DCP storage "
                                     "reader; load them with torchtitan's CheckpointManager")
        self.async_mode = config.async_mode
        self.staging_future: Future | None = None
        self.purge_queue: queue.Queue[str | None] = queue.Queue()
        if self.keep_latest_k > 0:
            self.purge_thread = threading.Thread(target=_base.purge_thread,
                                                 args=(self.purge_queue, self._remove), daemon=True)
            self.purge_thread.start()
        log.info("shardkit checkpointing active: steps are loaded from and saved to %s", self.folder)

    def __del__(self) -> None:
        self.close()

    # -- where ---------------------------------------------------------
    def _options(self) -> dict[str, Any] | None:
        return dict(self.config.storage_options) or None

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return steps.step_url(folder or self.folder, step)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step under ``folder`` holding a committed checkpoint, or -1."""
        return steps.latest_step(folder or self.folder, self._options())

    def _remove(self, url: str) -> None:
        Storage(url, self._options()).delete_tree()

    # -- saving --------------------------------------------------------
    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        begin = time.monotonic()
        url = self._create_checkpoint_id(curr_step)
        options = {"storage_options": self._options(), "compression": self.config.compression,
                   "meta": {"step": curr_step, "engine": "torchtitan"}}
        if last_step and self.config.last_save_model_only:
            self._save_model_only(curr_step, url, options)
        else:
            state = training_state(self.states, model_only=False, for_save=True)
            if self.async_mode == "disabled" or last_step:  # the final save is synchronous, as torchtitan's
                skc.save(state, url, **options)
            else:
                writer = "process" if self.async_mode == "async_with_pinned_mem" else "thread"
                self.save_future = skc.async_save(state, url, writer=writer, **options)
                self.staging_future = Future()  # async_save returns once the state is staged on the host
                self.staging_future.set_result(None)
                log.info("staged step %d for %s in %.2f s", curr_step, url, time.monotonic() - begin)
                return True
        self._purge_stale_checkpoints()
        log.info("saved step %d to %s in %.2f s", curr_step, url, time.monotonic() - begin)
        return True

    def _save_model_only(self, curr_step: int, url: str, options: dict[str, Any]) -> None:
        state = model_state(self.states[_base.MODEL], self.export_dtype)
        if self.config.last_save_in_hf:
            hf.export_hf(state, url, self.sd_adapter, self.export_dtype, self._options())
        else:
            skc.save({MODEL_KEY: state}, url, **{**options, "meta": {**options["meta"], "model_only": True}})
        log.info("saved a model-only checkpoint in %s at the last step, step %d", self.export_dtype, curr_step)

    def _should_purge(self) -> bool:
        return self.keep_latest_k > 0 and Dist().rank == 0

    def _purge_stale_checkpoints(self) -> None:
        if self._should_purge():
            for name in steps.stale_steps(self.folder, self.keep_latest_k, self._options()):
                self.purge_queue.put(f"{self.folder}/{name}")

    def _wait_for_saving(self) -> None:
        future, self.save_future = self.save_future, None
        if future is not None:
            future.result()
            self._purge_stale_checkpoints()

    def _maybe_wait_for_staging(self) -> None:
        future, self.staging_future = self.staging_future, None
        if future is not None:
            future.result()

    def _close(self) -> None:
        try:
            if self.save_future is not None:
                self._wait_for_saving()
        finally:
            if self.purge_thread is not None and self.purge_thread.is_alive():
                self.purge_queue.put(None)
                self.purge_thread.join()

    # -- loading -------------------------------------------------------
    def _load(self, step: int = -1) -> bool:
        folder_exists = _agreed(lambda: Storage(self.folder, self._options()).is_dir())
        if step != -1 and not folder_exists:
            raise CheckpointNotFound(f"--checkpoint.load_step={step} not found because checkpoint.folder "
                                     f"{self.folder} does not exist")
        load_step = _agreed(self._find_load_step) if folder_exists and step == -1 else step
        if load_step == -1:
            return self._initial_load()
        url = self._create_checkpoint_id(load_step)
        if step != -1 and _agreed(lambda: steps.format_of(url, self._options())) is None:
            raise CheckpointNotFound(f"--checkpoint.load_step={step} not found at {url}: no committed checkpoint "
                                     "there (missing, or an interrupted save)")
        self._load_step(url, model_only=load_step == 0)
        return True

    def _initial_load(self) -> bool:
        path = self.initial_load_path
        from_hf = self.config.initial_load_in_hf
        if not path and from_hf and self.sd_adapter is not None and getattr(self.sd_adapter, "hf_assets_path", None):
            path = self.sd_adapter.hf_assets_path
        if not path:
            log.info("No checkpoint was provided, this is a fresh start.")
            return False
        if _agreed(lambda: steps.format_of(path, self._options())) is None:
            raise CheckpointNotFound(f"checkpoint.initial_load_path {path} holds no committed checkpoint")
        if from_hf:
            log.info("loading Hugging Face weights from %s", path)
            hf.load_hf(self.states[_base.MODEL], path, self.sd_adapter, self._options())
        else:
            self._load_step(path, model_only=self.config.initial_load_model_only)
        return True

    def _load_step(self, url: str, *, model_only: bool) -> None:
        begin = time.monotonic()
        for name in self.exclude_from_loading:
            if name not in self.states:
                raise ConfigurationError(f"checkpoint.exclude_from_loading names {name!r}, which is not one of "
                                         f"the states ({', '.join(sorted(self.states))})")
        fmt, meta, stored = _agreed(lambda: steps.describe(url, self._options()))
        model_only = model_only or bool(meta.get("model_only"))
        native = fmt == NATIVE.name
        # another engine's step (torchtitan's DCP) keeps its data position as pickle bytes: not read
        exclude = self.exclude_from_loading if native else (*self.exclude_from_loading, DATALOADER_KEY)
        state = training_state(self.states, model_only=model_only, exclude=exclude, for_save=False)
        missing = sorted(set(flat_keys(state)) - set(stored))
        if missing:  # checked before any target is written
            raise IncompatibleStateDict(f"{url} ({fmt}) lacks {len(missing)} key(s) this job loads: "
                                        f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}; "
                                        "exclude_from_loading names the states to leave out")
        # strict=False: what the job leaves out (excluded states, all but the model) stays in the step
        result = skc.load(state, url, storage_options=self._options(), verify_first=self.config.verify_first,
                          strict=False, dtype_cast=True)  # a bf16 export loads into an fp32 model, as with DCP
        if result.unexpected:
            log.info("%s: not loaded from the step: %s%s", url, ", ".join(result.unexpected[:8]),
                     ", ..." if len(result.unexpected) > 8 else "")
        dataloader = self.states.get(DATALOADER_KEY)
        saved = saved_names(self.states)[DATALOADER_KEY] if DATALOADER_KEY in self.states else None
        if saved in state and dataloader is not None:
            restore_dataloader(dataloader, state[saved], url)
        log.info("loaded %s from %s in %.2f s", "the model" if model_only else "the training state", url,
                 time.monotonic() - begin)
