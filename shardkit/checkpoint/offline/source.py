"""Which source a run read, for resume and for the SRC/DST overlap check: :func:`canonical_location`
(one spelling per place, so ``./ckpt`` and ``/abs/ckpt`` are the same source)
and :func:`source_fingerprint` (changes when the source's contents change, so
a rerun never keeps data written from an older version of SRC).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from shardkit.checkpoint.formats import handler_for
from shardkit.checkpoint.io.location import canonical_location
from shardkit.checkpoint.io.storage import Storage

if TYPE_CHECKING:
    pass

__all__ = ["canonical_location", "overlap", "source_fingerprint"]


def overlap(a: Storage, b: Storage) -> bool:
    """Whether ``a`` and ``b`` are the same place or one lies inside the other."""
    x, y = canonical_location(a), canonical_location(b)
    x_path, _, x_end = x.partition("@")
    y_path, _, y_end = y.partition("@")
    if x_end != y_end:
        return False
    return (x_path == y_path or x_path.startswith(y_path.rstrip("/") + "/")
            or y_path.startswith(x_path.rstrip("/") + "/"))


def source_fingerprint(storage: Storage, fmt: str) -> str:
    """A digest that changes whenever the checkpoint at ``storage`` changes.

    A format whose handler names a ``content_pin`` (native: the manifest,
    which holds every chunk's crc32c) is pinned by that file's bytes.  Other
    formats record no checksums, so their files' names, sizes and change stamps (mtime locally,
    ETag/generation on object stores) stand in: a file replaced in place with
    the same shapes but new values still changes the digest.
    """
    digest = hashlib.sha256(fmt.encode())
    pin = handler_for(fmt).content_pin
    if pin is not None:
        digest.update(storage.read_bytes(pin))
    else:
        digest.update(json.dumps(storage.listing()).encode())
    return digest.hexdigest()[:16]
