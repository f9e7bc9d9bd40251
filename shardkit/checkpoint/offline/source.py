"""Which source a run read, for resume and for the SRC/DST overlap check: :func:`canonical_location`
(one spelling per place, so ``./ckpt`` and ``/abs/ckpt`` are the same source)
and :func:`source_fingerprint` (changes when the source's contents change, so
a rerun never keeps data written from an older version of SRC), and what a conversion makes of them:
:func:`check_distinct` (a DST that would clobber SRC is refused) and :func:`source_id` (where SRC is and what
it holds, in one string: resume keeps only data written from the same id).  Asked by the engine and by the
byte passthrough alike, neither needs torch.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from shardkit.checkpoint.formats import handler_for
from shardkit.checkpoint.io.location import canonical_location
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import ConfigurationError

__all__ = ["canonical_location", "overlap", "source_fingerprint", "check_distinct", "source_id",
           "source_id_meanwhile"]


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


def check_distinct(src: str, dst: str, storage_options: Mapping[str, Any] | None,
                   dst_storage_options: Mapping[str, Any] | None) -> None:
    """Refuse a DST that is SRC, or lies inside it, or holds it.

    Writing DST drops its old commit marker first and deletes stale files
    after the commit, so with an overlap a failure (or even success) would
    destroy the very checkpoint being read.
    """
    a, b = Storage(src, storage_options), Storage(dst, dst_storage_options)
    if overlap(a, b):
        raise ConfigurationError(f"DST {dst!r} is SRC {src!r} or overlaps it ({canonical_location(b)} vs "
                                 f"{canonical_location(a)}); write to a separate location, then move it")


def source_id(src: str, storage_options: Mapping[str, Any] | None, fmt: str, source: Any = None) -> str:
    """Where SRC is and what it holds: a resumed run keeps only data written from the same id.  Asked
    through the open ``source``'s storage when that is SRC's, with the same options (its client made
    already: on an object store a new one costs a tenth of a second), else through a new one."""
    storage = Storage(src, storage_options)
    opened = getattr(source, "storage", None)
    if (isinstance(opened, Storage) and opened.url == storage.url
            and opened.storage_options == storage.storage_options):
        storage = opened
    return f"{canonical_location(storage)}#{source_fingerprint(storage, fmt)}"


def source_id_meanwhile(src: str, storage_options: Mapping[str, Any] | None, source: Any) -> Callable[[], str]:
    """:func:`source_id`, asked now on a thread when SRC is an object store (its GET of the manifest overlaps
    the selection and DST's checks, not the first write); the call returned waits for it or raises its error."""
    storage = getattr(source, "storage", None)
    if not getattr(storage, "is_object_store", False):
        return lambda: source_id(src, storage_options, source.info.format, source)
    pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-source-id")
    asked = pool.submit(source_id, src, storage_options, source.info.format, source)
    pool.shutdown(wait=False)
    return asked.result
