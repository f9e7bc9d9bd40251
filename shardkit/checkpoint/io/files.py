"""Whole-file operations on top of :class:`~shardkit.checkpoint.io.storage.Storage`, with its retries
and errors: what a directory holds and when each file last changed, moving a finished file over
another, and fetching a remote file to local disk (to map it)."""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Mapping

from shardkit.checkpoint.io.storage import Storage

__all__ = ["listing", "replace", "write_then_replace", "temporary_name_prefix", "download"]


def _stamp(info: Mapping[str, Any]) -> str:
    """What changes when an object is rewritten: its ETag/generation remotely, else its mtime."""
    for key in ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""


def _local_stamp(st: os.stat_result) -> str:
    # inode and ctime too: a file replaced by rename, or rewritten within one mtime tick, still differs
    return f"ino={st.st_ino},mtime_ns={st.st_mtime_ns},ctime_ns={st.st_ctime_ns}"


def listing(storage: Storage) -> list[tuple[str, int, str]]:
    """(name, size, change stamp) of the files directly at ``storage`` (or of the file itself)."""
    if storage.is_local:
        if not os.path.isdir(storage.root):
            st = os.stat(storage.root)
            return [(os.path.basename(storage.root), st.st_size, _local_stamp(st))]
        out = []
        with os.scandir(storage.root) as entries:
            for e in entries:
                if e.is_file():
                    st = e.stat()
                    out.append((e.name, st.st_size, _local_stamp(st)))
        return sorted(out)
    try:
        storage.fs.invalidate_cache(storage.root)
    except Exception:  # noqa: BLE001 - not every filesystem caches listings
        pass
    if storage.is_dir():
        infos = storage.retry(f"listing {storage.url}", lambda: storage.fs.ls(storage.root, detail=True))
    else:
        infos = [storage.retry(f"checking {storage.url}", lambda: storage.fs.info(storage.root))]
    return sorted((str(i["name"]).rstrip("/").rsplit("/", 1)[-1], int(i.get("size") or 0), _stamp(i))
                  for i in infos if i.get("type", "file") == "file")


def replace(storage: Storage, src: str, dst: str) -> None:
    """Move the finished file ``src`` over ``dst`` in one step: a rename on local disks; on object stores
    a server-side copy, which replaces the old object only once complete, then the source is removed."""
    if storage.is_local:
        storage.retry(f"moving {storage.where(src)} to {storage.where(dst)}",
                      lambda: os.replace(storage.path(src), storage.path(dst)))
        return
    storage.retry(f"moving {storage.where(src)} to {storage.where(dst)}",
                  lambda: storage.fs.mv(storage.path(src), storage.path(dst)))


def temporary_name_prefix(name: str) -> str:
    """How the temporary names :func:`write_then_replace` streams ``name`` to begin (a hidden name, then
    the process id and a random part): what a killed writer leaves is recognisable by it."""
    return f".{name}.partial-"


def write_then_replace(storage: Storage, name: str, produce: Callable[[Any], Any],
                       before_replace: Callable[[], None] = lambda: None) -> None:
    """Write file ``name`` as its own commit marker: stream ``produce`` to a temporary name beside it,
    run ``before_replace``, then :func:`replace` it into place.  A file already at ``name`` (what
    ``--overwrite`` replaces) stays whole until then; on any failure the temporary file is removed."""
    temporary = f"{temporary_name_prefix(name)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        storage.write_stream(temporary, produce, fsync=storage.is_local)
        before_replace()
        replace(storage, temporary, name)
    except BaseException:
        try:
            storage.delete([temporary])
        except Exception:  # noqa: BLE001 - the original failure is what the user needs to see
            pass
        raise


def download(storage: Storage, name: str, path: str) -> None:
    """Copy ``name`` to the local file ``path``."""
    storage.retry(f"downloading {storage.where(name)}", lambda: storage.fs.get_file(storage.path(name), path))
