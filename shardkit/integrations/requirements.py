"""The one way an integration imports its framework: a clear error naming the extra when it is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from shardkit.errors import IntegrationUnavailable

__all__ = ["import_framework"]


def import_framework(module: str, extra: str) -> ModuleType:
    """Import ``module`` (the framework), or raise naming ``pip install shardkit[extra]``.

    Why: an integration imported without its framework would otherwise fail
    with a bare ``ModuleNotFoundError`` deep inside a subclass statement.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.split(".")[0] != exc.name.split(".")[0]:
            raise
        raise IntegrationUnavailable(
            f"shardkit's {extra} integration needs {module!r}, which is not installed: "
            f"pip install 'shardkit[{extra}]'") from exc
