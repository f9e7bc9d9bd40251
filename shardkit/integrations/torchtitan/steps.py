"""torchtitan's ``step-N`` folders: their names, which hold a committed checkpoint, which retention removes.

torchtitan names a step ``<folder>/step-<N>`` (no zero padding) and counts a
folder as a checkpoint when it holds DCP's ``.metadata`` or an HF index.  Here
a folder counts when one of shardkit's formats recognises a *committed*
checkpoint in it (the format registry decides: a shardkit manifest, a DCP
metadata file, an HF index or single file), so a save that crashed half way --
data files without their commit -- is never chosen on resume, whichever engine
wrote it.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

from shardkit.checkpoint.formats import detect_format, open_reader
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ShardkitError

__all__ = ["STEP_NAME", "step_url", "step_numbers", "format_of", "describe", "committed_steps", "latest_step",
           "stale_steps"]

log = logging.getLogger(__name__)

STEP_NAME = re.compile(r"step-(\d+)")  # the whole name: torchtitan's own step folders, nothing else


def step_url(folder: str, step: int) -> str:
    """``<folder>/step-<step>``, the name torchtitan's managers give a step."""
    return f"{folder.rstrip('/')}/step-{step}"


def step_numbers(folder: str, storage_options: Mapping[str, Any] | None = None) -> dict[int, str]:
    """Every ``step-N`` entry under ``folder`` (committed or not), by step; empty when the folder is absent."""
    storage = Storage(folder, storage_options)
    if not storage.is_dir():
        return {}
    found = {}
    for name in storage.listdir():
        match = STEP_NAME.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found[int(match.group(1))] = match.group(0)
    return found


def format_of(url: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The format of the committed checkpoint at ``url``, or ``None`` when there is none (absent, empty, or
    data files without their commit: an interrupted save)."""
    try:
        return detect_format(Storage(url, storage_options))
    except (ShardkitError, OSError) as exc:
        log.debug("%s holds no committed checkpoint: %s", url, exc)
        return None


def describe(url: str, storage_options: Mapping[str, Any] | None = None
             ) -> tuple[str | None, dict[str, Any], list[str]]:
    """(format, the ``meta`` a shardkit save stored, every stored key) of the checkpoint at ``url``; ``meta``
    is empty for another engine's checkpoint (a torchtitan DCP step), the format ``None`` when nothing is
    committed there."""
    fmt = format_of(url, storage_options)
    if fmt is None:
        return None, {}, []
    reader = open_reader(url, storage_options, format=fmt)
    try:
        reader.focus({})  # dtypes and shapes only: no chunk record is read
        return fmt, dict(reader.info.meta or {}), sorted({*reader.tensors(), *reader.values()})
    finally:
        reader.close()


def committed_steps(folder: str, storage_options: Mapping[str, Any] | None = None) -> list[int]:
    """The steps under ``folder`` that hold a committed checkpoint, ascending."""
    steps = step_numbers(folder, storage_options)
    good = [s for s in sorted(steps) if format_of(step_url(folder, s), storage_options) is not None]
    partial = sorted(set(steps) - set(good))
    if partial:
        log.warning("%s: step folder(s) %s hold no committed checkpoint (an interrupted save?) and are not "
                    "resumed from", folder, ", ".join(steps[s] for s in partial))
    return good


def latest_step(folder: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """The newest committed step under ``folder``, or -1 (torchtitan's "none")."""
    steps = committed_steps(folder, storage_options)
    return steps[-1] if steps else -1


def stale_steps(folder: str, keep: int, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The step folders retention removes to keep the newest ``keep`` committed steps.

    Committed steps older than those kept go, and so do folders without a
    commit below the oldest kept step (a crash's leftovers); a folder without a
    commit above it may be a save still in flight and stays."""
    if keep <= 0:
        return []
    every = step_numbers(folder, storage_options)
    kept = committed_steps(folder, storage_options)[-keep:]
    if not kept:
        return []
    return [every[s] for s in sorted(every) if s < kept[0]]
