"""The format registry and the one door to read any checkpoint (:mod:`~shardkit.checkpoint.formats.registry`).

Its names (``FORMATS``, ``NATIVE``, ``open_reader``, ...) are resolved on first
use: the registry imports every format's handler, and torch with them, which a
byte passthrough between native checkpoints never needs.
"""

from __future__ import annotations

from shardkit.lazy import lazy_exports

_EXPORTS = {name: f"{__name__}.registry" for name in (
    "FormatHandler", "FORMATS", "WRITABLE", "COMMIT_MARKERS", "CHECKPOINT_FILE_PATTERNS",
    "CHECKPOINT_FOLDERS", "NATIVE", "WriteJob", "Written", "Scaleout", "referenced_by_siblings",
    "normalize_format", "handler_for", "writer_for", "foreign_kind", "detect_format", "open_reader",
)}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
