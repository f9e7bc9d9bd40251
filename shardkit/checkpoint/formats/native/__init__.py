"""shardkit's own format (:mod:`~shardkit.checkpoint.formats.native.facade` names what the rest of shardkit uses).

Loaded on first use, so that importing one module of the format (the manifest's
parser, the journal) does not import the reader and torch with it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or any(m.name == name for m in pkgutil.iter_modules(__path__)):
        raise AttributeError(name)  # a submodule not imported yet: the import system imports it
    value = getattr(importlib.import_module(f"{__name__}.facade"), name)
    globals()[name] = value
    return value
