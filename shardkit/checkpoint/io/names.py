"""Names inside a checkpoint: every relative name a manifest, index or user gives is checked to stay
inside the checkpoint before any file is opened under it.

The one exception is a *reference* (format version 4, ``CheckpointManager(dedup=True)``): a data
file of a sibling checkpoint under the same root, spelled ``../<sibling>/<name>`` -- exactly one
level up, one plain directory name, then a plain relative name.  References are only ever read.
"""

from __future__ import annotations

import re
from typing import Any

from shardkit.errors import UnsafeCheckpoint

__all__ = ["check_name", "join_url", "REFERENCE_PREFIX", "RESUME_DIR", "split_reference", "check_reference",
           "is_sibling_name"]

# the folder of resume records an interrupted native write keeps under its output (formats/native/journal.py),
# named here, below both, for the conversion's head start, which must not import the native format to find it
RESUME_DIR = ".shardkit-resume"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-+=@,]+(/[A-Za-z0-9_.\-+=@,]+)*$")


def check_name(name: Any, where: str = "") -> str:
    """Validate a relative name inside a checkpoint; return it unchanged."""
    ok = (isinstance(name, str) and 0 < len(name) <= 1024 and _NAME_RE.match(name) is not None
          and not any(part in (".", "..") for part in name.split("/")))
    if not ok:
        raise UnsafeCheckpoint(f"file name {name!r}{' in ' + where if where else ''} points outside the "
                               f"checkpoint or is not a plain relative path; refusing to touch it")
    return name


REFERENCE_PREFIX = "../"
_SIBLING_RE = re.compile(r"^[A-Za-z0-9_\-+=@,][A-Za-z0-9_.\-+=@,]*$")


def split_reference(name: str) -> tuple[str, str] | None:
    """``(sibling, name inside it)`` for a reference ``../<sibling>/<name>``; ``None`` for any other name
    (unchecked: see :func:`check_reference`)."""
    if not isinstance(name, str) or not name.startswith(REFERENCE_PREFIX):
        return None
    sibling, _, inner = name[len(REFERENCE_PREFIX):].partition("/")
    return sibling, inner


def check_reference(name: Any, where: str = "") -> str:
    """Validate a reference ``../<sibling>/<plain relative name>``; return it unchanged."""
    parts = split_reference(name)
    if parts is None or not is_sibling_name(parts[0]):
        raise UnsafeCheckpoint(f"file name {name!r}{' in ' + where if where else ''} is not a reference of the "
                               f"form ../<sibling checkpoint>/<file>; refusing to touch it")
    check_name(parts[1], where)
    return name


def is_sibling_name(name: str) -> bool:
    """Whether a directory entry's name could be named by a reference (so whether to look at it at all)."""
    return isinstance(name, str) and _SIBLING_RE.match(name) is not None and name not in (".", "..") \
        and len(name) <= 255


def join_url(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def split_url(url: str) -> tuple[str, str]:
    """``(parent, name)`` of ``url``, the inverse of :func:`join_url` (``parent`` empty for a bare name)."""
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent, name
