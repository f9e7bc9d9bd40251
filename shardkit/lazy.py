"""Lazy re-exports for package ``__init__`` files.

A package that re-exports names from its modules would import all of them on
``import package``; the checkpoint half alone pulls in fsspec, safetensors
parsing and the formats.  ``lazy_exports`` gives a package a module-level
``__getattr__`` that imports a name's module on first use and caches the name,
and, for the package's own ``submodules``, imports the submodule on first use
(``import shardkit`` then ``shardkit.checkpoint`` works without importing the
checkpoint half up front).  Every package ``__init__`` that re-exports lazily
goes through it, so there is one way names resolve.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Collection, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str],
                 submodules: Collection[str] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, resolving each name of ``exports`` (name -> module) and
    each of ``submodules`` (``package.<name>``, imported on first use)."""
    namespace = sys.modules[package].__dict__

    def getattr_(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")  # the import binds it on the package too
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(exports) | set(submodules) | set(namespace))

    return getattr_, dir_
