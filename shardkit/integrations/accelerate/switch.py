"""The one switch: every name bound to Accelerate's FSDP checkpoint functions points at shardkit's, and back.

Accelerate's functions are not called through one place: ``accelerate.accelerator``
(``save_state``/``load_state``), ``transformers.trainer`` (``_save_checkpoint``,
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``) and user code
each bound them by ``from accelerate.utils import save_fsdp_model``, and
``accelerate.utils`` re-exports them from ``accelerate.utils.fsdp_utils``.
Replacing the attribute of one module leaves the others calling DCP.  So the
switch walks every imported module and rebinds each name that is Accelerate's
function (``accelerate.utils.fsdp_utils``, ``accelerate.utils``,
``accelerate.accelerator``, ``transformers.trainer``, and any other); a module
imported later takes the rebound names from ``accelerate.utils``.  The undo
walks them again and puts back Accelerate's functions wherever shardkit's are.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import Any, Callable

from shardkit.integrations.accelerate.engine import NAMES, OPTIONS, ORIGINALS, REPLACEMENTS, EngineOptions

__all__ = ["use_shardkit", "ShardkitSwitch", "is_on", "rebind"]

logger = logging.getLogger(__name__)


def rebind(old: dict[str, Callable[..., Any]], new: dict[str, Callable[..., Any]]) -> list[str]:
    """In every imported module, bind ``new[name]`` wherever ``old[name]`` is bound to ``name``; return the
    modules changed (``module.name``).  Only module dictionaries are read: no lazy module is imported."""
    changed = []
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(__package__ + "."):
            continue  # the engine defines shardkit's functions under these names: they stay its own
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name in NAMES:
            if namespace.get(name) is old[name]:
                setattr(module, name, new[name])
                changed.append(f"{module_name}.{name}")
    return changed


def is_on() -> bool:
    """Whether Accelerate's own module now calls shardkit's functions."""
    return all(getattr(sys.modules["accelerate.utils.fsdp_utils"], name) is REPLACEMENTS[name] for name in NAMES)


def _turn(on: bool) -> None:
    changed = rebind(ORIGINALS, REPLACEMENTS) if on else rebind(REPLACEMENTS, ORIGINALS)
    logger.info("shardkit %s Accelerate's FSDP checkpoints (%d bindings: %s)",
                "now writes and reads" if on else "no longer writes or reads", len(changed), ", ".join(changed))


class ShardkitSwitch:
    """What :func:`use_shardkit` returns: as a context manager, the state before the call comes back on exit."""

    def __init__(self, was_on: bool, was_options: EngineOptions) -> None:
        self.was_on = was_on
        self.was_options = was_options

    def __enter__(self) -> ShardkitSwitch:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the engine and options in force before the ``use_shardkit`` call that returned this."""
        _set_options(self.was_options)
        if is_on() != self.was_on:
            _turn(self.was_on)


def _set_options(options: EngineOptions) -> None:
    OPTIONS.compression = options.compression
    OPTIONS.io_threads = options.io_threads
    OPTIONS.verify_first = options.verify_first
    OPTIONS.save_options = dict(options.save_options)


def use_shardkit(enable: bool = True, *, compression: str | None = None, io_threads: int | None = None,
                 verify_first: bool = False, **save_options: Any) -> ShardkitSwitch:
    """Make shardkit the engine of Accelerate's and the Trainer's FSDP2 checkpoints (``False``: Accelerate's
    own DCP again).

    Call it once, before ``save_state``/``load_state`` or ``Trainer.train``;
    or use it as ``with use_shardkit(): ...``, which restores the previous
    engine on exit.  ``compression`` (``"zstd"``), ``io_threads`` and other
    ``save_options`` (``digests=True``, ``fsync=False``...) go to every
    :func:`shardkit.checkpoint.save`; ``verify_first=True`` makes each load
    check every byte before it writes a parameter.  Folder names, the RNG,
    sampler, scheduler and scaler files, ``total_limit`` and
    ``save_total_limit`` stay Accelerate's and the Trainer's.
    """
    switch = ShardkitSwitch(is_on(), EngineOptions(OPTIONS.compression, OPTIONS.io_threads, OPTIONS.verify_first,
                                                   dict(OPTIONS.save_options)))
    if enable:
        _set_options(EngineOptions(compression, io_threads, verify_first, dict(save_options)))
    else:
        _set_options(EngineOptions())
    if is_on() != enable:
        _turn(enable)
    return switch
