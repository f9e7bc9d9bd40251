"""shardkit's own format (:mod:`~shardkit.checkpoint.formats.native.facade` names what the rest of shardkit uses).

The names are resolved on first use, each from the module that defines it
(``facade.EXPORTS``), so that importing one module of the format (the
manifest's parser, the journal) does not import the reader and torch with it.
"""

from __future__ import annotations

from shardkit.checkpoint.formats.native.facade import EXPORTS
from shardkit.lazy import lazy_exports

__all__ = sorted(EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
