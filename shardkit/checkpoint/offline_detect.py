"""Which format is at a URL, and a reader for it, with messages a user can act on.

Detection itself is the engine's (:func:`shardkit.checkpoint.formats.detect_format`:
native first, then HF, torch.save, DCP).  This module adds what a command-line
user needs around it: a missing path is :class:`~shardkit.errors.CheckpointNotFound`;
a path that exists but is no checkpoint is :class:`~shardkit.errors.UnsupportedFormat`
saying what was found there (e.g. data files without a manifest: an
interrupted write).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from shardkit.checkpoint.formats import format_module
from shardkit.checkpoint.formats import detect_format as engine_detect
from shardkit.checkpoint.formats.base import CheckpointReader
from shardkit.checkpoint.offline_blocks import is_dir, split_file
from shardkit.checkpoint.storage import Storage
from shardkit.errors import CheckpointNotFound, UnsupportedFormat

__all__ = ["FORMATS", "detect", "open_source", "normalize_format", "exists"]

FORMATS = ("shardkit", "hf", "torch", "dcp")
_ALIASES = {"native": "shardkit", "shardkit": "shardkit", "hf": "hf", "huggingface": "hf", "safetensors": "hf",
            "torch": "torch", "pt": "torch", "torch.save": "torch", "dcp": "dcp"}


def normalize_format(name: str) -> str:
    try:
        return _ALIASES[name.lower()]
    except KeyError:
        raise UnsupportedFormat(f"format {name!r} is unknown; use one of {', '.join(FORMATS)}") from None


def exists(storage: Storage) -> bool:
    if storage.is_local:
        return os.path.exists(storage.root)
    try:
        storage.fs.invalidate_cache(storage.root)
    except Exception:  # noqa: BLE001
        pass
    return bool(storage._retry(f"checking {storage.url}", lambda: storage.fs.exists(storage.root)))


def detect(storage: Storage) -> str:
    """The format at ``storage``; raises with a useful message when there is none."""
    if not exists(storage):
        raise CheckpointNotFound(f"{storage.url}: no such file or directory")
    try:
        return engine_detect(storage)
    except CheckpointNotFound:
        pass
    if is_dir(storage):
        names = storage.listdir()
        if "data" in names or any(n.endswith(".safetensors") or n.endswith(".distcp") for n in names):
            raise UnsupportedFormat(f"{storage.url}: holds data files but no manifest/index/metadata: an "
                                    "uncommitted (interrupted) checkpoint; rerun the command that wrote it") from None
        shown = (", ".join(names[:5]) + (", ..." if len(names) > 5 else "")) if names else "an empty directory"
        raise UnsupportedFormat(f"{storage.url}: not a checkpoint shardkit reads (found {shown}); expected a "
                                "shardkit checkpoint, a DCP directory, an HF safetensors folder or a torch.save "
                                "file") from None
    parent, name = split_file(storage)
    parent.read_bytes(name, 0, 8)  # an unreadable file says so (permission denied) instead of "unknown format"
    raise UnsupportedFormat(f"{storage.url}: unknown file format (neither safetensors nor a torch.save zip)") from None


def open_source(url: str, storage_options: Mapping[str, Any] | None = None,
                fmt: str | None = None) -> CheckpointReader:
    """Open ``url`` as a :class:`CheckpointReader`, detecting the format unless ``fmt`` is given."""
    storage = Storage(url, storage_options)
    fmt = normalize_format(fmt) if fmt else detect(storage)
    return format_module(fmt).open_reader(storage)
