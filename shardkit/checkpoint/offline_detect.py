"""Which format is at a URL, and a reader for it.

Detection looks only at names and a few header bytes, cheapest first:
``manifest.json`` (native), ``.metadata`` (DCP), ``model.safetensors[.index.json]``
or a ``.safetensors`` file (Hugging Face), a zip archive (torch.save).  A path
that is none of these raises :class:`~shardkit.errors.UnsupportedFormat` saying
what was found, and a path that does not exist raises
:class:`~shardkit.errors.CheckpointNotFound`.
"""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.offline_io import Location, open_location
from shardkit.checkpoint.offline_source import Source
from shardkit.errors import CheckpointNotFound, UnsupportedFormat

__all__ = ["FORMATS", "detect_format", "open_source", "normalize_format"]

FORMATS = ("shardkit", "hf", "torch", "dcp")
_ALIASES = {"native": "shardkit", "shardkit": "shardkit", "hf": "hf", "huggingface": "hf", "safetensors": "hf",
            "torch": "torch", "pt": "torch", "torch.save": "torch", "dcp": "dcp"}
MANIFEST_NAME = "manifest.json"


def normalize_format(name: str) -> str:
    try:
        return _ALIASES[name.lower()]
    except KeyError:
        raise UnsupportedFormat(f"format {name!r} is unknown; use one of {', '.join(FORMATS)}") from None


def detect_format(loc: Location) -> str:
    from shardkit.checkpoint.formats import dcp, hf, torchsave

    if not loc.exists():
        raise CheckpointNotFound(f"{loc.url}: no such file or directory")
    if loc.isdir():
        if loc.exists(MANIFEST_NAME):
            return "shardkit"
        if dcp.is_dcp(loc):
            return "dcp"
        if hf.is_hf(loc):
            return "hf"
        names = loc.listdir()
        if names and all(n.startswith("data") or n.endswith(".safetensors") for n in names):
            raise UnsupportedFormat(f"{loc.url}: holds data files but no manifest.json: an uncommitted (partial) "
                                    "checkpoint; re-run the command that wrote it")
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "") if names else "nothing"
        raise UnsupportedFormat(f"{loc.url}: not a checkpoint shardkit reads (found {shown}); expected a shardkit "
                                "checkpoint, a DCP directory, an HF safetensors folder or a torch.save file")
    if hf.is_hf(loc):
        return "hf"
    if torchsave.is_torch_save(loc):
        return "torch"
    raise UnsupportedFormat(f"{loc.url}: unknown file format (not safetensors, not a torch.save zip); "
                            "expected a checkpoint directory or file")


def open_source(url: str, storage_options: dict[str, Any] | None = None, fmt: str | None = None) -> Source:
    """Open ``url`` as a :class:`Source`, detecting the format unless ``fmt`` is given."""
    loc = open_location(url, storage_options)
    fmt = normalize_format(fmt) if fmt else detect_format(loc)
    if fmt == "shardkit":
        from shardkit.checkpoint.offline_native import NativeSource

        return NativeSource(loc, storage_options)
    if fmt == "dcp":
        from shardkit.checkpoint.formats.dcp import DcpSource

        return DcpSource(loc)
    if fmt == "hf":
        from shardkit.checkpoint.formats.hf import HfSource

        return HfSource(loc)
    from shardkit.checkpoint.formats.torchsave import TorchSaveSource

    return TorchSaveSource(loc)
