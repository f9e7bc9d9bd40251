"""The format registry and the one door to read any checkpoint (:mod:`~shardkit.checkpoint.formats.registry`).

Its names (``FORMATS``, ``NATIVE``, ``open_reader``, ...) are loaded on first
use: the registry imports every format's handler, and torch with them, which a
byte passthrough between native checkpoints never needs.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or any(m.name == name for m in pkgutil.iter_modules(__path__)):
        raise AttributeError(name)  # a submodule not imported yet: the import system imports it
    value = getattr(importlib.import_module(f"{__name__}.registry"), name)
    globals()[name] = value
    return value
