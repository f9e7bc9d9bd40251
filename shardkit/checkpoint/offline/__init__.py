"""Offline checkpoint tools as library calls: reshard, convert, inspect, verify, diff.

None of these needs a process group or a GPU (``reshard``/``convert`` to native
can split the work over a torchrun launch, see ``scaleout``).  The ``shardkit``
command is a thin shell over them.  Names resolve lazily.
"""

from __future__ import annotations

from shardkit.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "reshard": "shardkit.checkpoint.offline.convert",
    "convert": "shardkit.checkpoint.offline.convert",
    "inspect": "shardkit.checkpoint.offline.convert",
    "verify": "shardkit.checkpoint.offline.verify",
    "diff": "shardkit.checkpoint.offline.diff",
    "ConvertResult": "shardkit.checkpoint.offline.result",
    "VerifyReport": "shardkit.checkpoint.offline.verify",
    "DiffReport": "shardkit.checkpoint.offline.diff",
    "DEFAULT_MAX_MEMORY": "shardkit.checkpoint.offline.options",
    "parse_memory": "shardkit.checkpoint.offline.options",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
