"""Names inside a checkpoint: every relative name a manifest, index or user gives is checked to stay
inside the checkpoint before any file is opened under it."""

from __future__ import annotations

import re
from typing import Any

from shardkit.errors import UnsafeCheckpoint

__all__ = ["check_name", "join_url"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-+=@,]+(/[A-Za-z0-9_.\-+=@,]+)*$")


def check_name(name: Any, where: str = "") -> str:
    """Validate a relative name inside a checkpoint; return it unchanged."""
    ok = (isinstance(name, str) and 0 < len(name) <= 1024 and _NAME_RE.match(name) is not None
          and not any(part in (".", "..") for part in name.split("/")))
    if not ok:
        raise UnsafeCheckpoint(f"file name {name!r}{' in ' + where if where else ''} points outside the "
                               f"checkpoint or is not a plain relative path; refusing to touch it")
    return name


def join_url(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name
