"""Checkpoint formats behind one reader interface (see ``formats/base.py``).

Each format module exposes ``detect(storage) -> bool`` and
``open_reader(storage) -> CheckpointReader``.  :func:`open_reader` here picks
the format of a URL (or takes ``format=``) so that ``load``, ``reshard``,
``convert``, ``inspect``, ``verify`` and ``diff`` accept any of them.

=========  ==========================================  =================
name       what                                         module
=========  ==========================================  =================
shardkit   native: manifest.json + safetensors chunks   ``native``
hf         Hugging Face safetensors file or folder      ``hf``
torch      ``torch.save`` file (``weights_only=True``)  ``torchsave``
dcp        torch.distributed.checkpoint directory       ``dcp``
=========  ==========================================  =================
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from shardkit.checkpoint.formats.base import CheckpointReader
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CheckpointNotFound, UnsupportedFormat

__all__ = ["FORMATS", "format_module", "detect_format", "open_reader"]

FORMATS: dict[str, str] = {
    "shardkit": "shardkit.checkpoint.formats.native.reader",
    "hf": "shardkit.checkpoint.formats.hf",
    "torch": "shardkit.checkpoint.formats.torchsave",
    "dcp": "shardkit.checkpoint.formats.dcp.checkpoint",
}


def format_module(name: str) -> Any:
    if name not in FORMATS:
        raise UnsupportedFormat(f"unknown checkpoint format {name!r}; known: {sorted(FORMATS)}")
    try:
        return importlib.import_module(FORMATS[name])
    except ImportError as exc:
        raise UnsupportedFormat(f"format {name!r} is not available in this installation ({exc})") from None


def detect_format(storage: Storage) -> str:
    """The name of the first format that recognises ``storage`` (native first)."""
    for name in FORMATS:
        try:
            module = format_module(name)
        except UnsupportedFormat:
            continue
        detect = getattr(module, "detect", None)
        if detect is not None and detect(storage):
            return name
    raise CheckpointNotFound(f"{storage.url} is not a checkpoint in any known format ({', '.join(FORMATS)}): "
                             f"no manifest.json, *.safetensors, .metadata or torch.save file found")


def open_reader(url: str | Storage, storage_options: Mapping[str, Any] | None = None, *,
                format: str | None = None) -> CheckpointReader:
    """Open ``url`` for reading in ``format`` (detected when ``None``)."""
    storage = url if isinstance(url, Storage) else Storage(url, storage_options)
    module = format_module(format or detect_format(storage))
    if not hasattr(module, "open_reader"):
        raise UnsupportedFormat(f"format {format!r} has no reader for {storage.url}")
    return module.open_reader(storage)
