"""Format version 4: chunks a checkpoint shares with an earlier checkpoint beside it, and chunk digests.

``CheckpointManager(dedup=True)`` stores, with every chunk it writes, a
digest of the chunk's raw bytes (row-major, little-endian, before any
compression): ``"digest": "<algorithm>:<hex>"``, where the algorithm is
``xxh3-128`` (XXH3's 128-bit hash, seed 0, canonical big-endian hex: 32
digits) or ``sha256`` (64 digits).  A later step whose chunk has the same key, box, dtype and
digest does not write it again: its record points at the earlier step's data
file through a *reference* ``../<step dir>/data/<file>`` -- a sibling under
the same root, exactly one level up (:func:`~shardkit.checkpoint.io.names.check_reference`).
Chains never form: a reference copied from a step that itself referenced
stays pointing at the step that wrote the bytes.

``manifest.json`` lists the sibling directories it references under
``"references"``, so retention can keep them without reading any chunk
record; every referenced file must lie in one of them.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from shardkit.checkpoint.io.names import check_name, check_reference, is_sibling_name, split_reference
from shardkit.errors import InvalidManifest, UnsafeCheckpoint

__all__ = ["REFERENCES_VERSION", "DIGEST_NAME", "DIGEST_ALGORITHMS", "check_file_name", "referenced_dirs",
           "parse_digest", "parse_references", "rebase_reference"]

REFERENCES_VERSION = 4   # the first format version whose files may be references
DIGEST_NAME = "digest"   # the chunk record field holding the digest of the chunk's raw bytes
DIGEST_ALGORITHMS = {"xxh3-128": 32, "sha256": 64}  # algorithm -> hex digits
_DIGEST = re.compile("^(" + "|".join(f"{re.escape(a)}:[0-9a-f]{{{n}}}" for a, n in DIGEST_ALGORITHMS.items()) + ")$")


def check_file_name(name: Any, where: str, version: int) -> str:
    """A data file name of a manifest of ``version``: a plain name inside the checkpoint, or (version 4
    on) a reference to a data file of a sibling checkpoint."""
    parts = split_reference(name)
    if parts is None:
        return check_name(name, where)
    if version < REFERENCES_VERSION:
        raise UnsafeCheckpoint(f"file name {name!r} in {where} points outside the checkpoint, which format version "
                               f"{version} never does; refusing to touch it")
    check_reference(name, where)
    if not parts[1].startswith("data/"):
        raise InvalidManifest(f"{where}: reference {name!r} must name a data file (../<step>/data/<file>)")
    return name


def referenced_dirs(files: Iterable[str]) -> tuple[str, ...]:
    """The sibling directories the file names reference, sorted."""
    return tuple(sorted({parts[0] for name in files if (parts := split_reference(name)) is not None}))


def parse_references(value: Any, where: str) -> tuple[str, ...]:
    """A manifest's ``"references"``: a list of sibling directory names."""
    if not isinstance(value, list) or len(value) > 1 << 20 or not all(is_sibling_name(d) for d in value):
        raise InvalidManifest(f"{where}: references must be a list of sibling directory names, got {value!r:.200}")
    return tuple(sorted(set(value)))


def parse_digest(value: Any, where: str) -> str | None:
    """A chunk record's optional ``"digest"``: ``xxh3-128:`` and 32 or ``sha256:`` and 64 lower-case hex digits."""
    if value is None:
        return None
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise InvalidManifest(f"{where}: {DIGEST_NAME} must be 'xxh3-128:<32 hex digits>' or 'sha256:<64 hex "
                              f"digits>', got {value!r:.100}")
    return value


def rebase_reference(name: str, sibling: str, own: str) -> str:
    """How checkpoint ``own`` names file ``name`` of its sibling ``sibling``: the sibling's own files become
    references into it, its references stay as they are (they already name a sibling) -- except one into
    ``own`` itself, which becomes a plain name again (so the cleanup after a commit sees it is used)."""
    parts = split_reference(name)
    if parts is None:
        return f"../{sibling}/{name}"
    return parts[1] if parts[0] == own else name
