"""fsspec access for the offline tools: one place that turns URLs into files and bytes.

Every reader and writer of the offline formats goes through :class:`Location`
so that a local path, ``memory://`` and ``s3://`` behave the same, ranged
reads are used instead of whole-file reads, and every storage failure comes
out as a :class:`shardkit.errors.StorageError` (or ``CheckpointNotFound``)
naming the URL — never a raw ``botocore`` or ``OSError`` trace.
"""

from __future__ import annotations

import errno
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import fsspec
from fsspec.core import url_to_fs

from shardkit.errors import CheckpointNotFound, StorageError, UnsafeCheckpoint

__all__ = ["Location", "open_location", "with_retries"]

T = TypeVar("T")

RETRIES = 4
_NOT_RETRIED = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def with_retries(what: str, fn: Callable[[], T], *, retries: int = RETRIES) -> T:
    """Run ``fn`` with bounded retries and jittered backoff; map failures to shardkit errors."""
    delay = 0.2
    for attempt in range(retries + 1):
        try:
            return fn()
        except FileNotFoundError as exc:
            raise CheckpointNotFound(f"{what}: not found ({exc}); check the path or URL") from exc
        except PermissionError as exc:
            raise StorageError(f"{what}: permission denied ({exc})") from exc
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(f"{what}: no space left on the device; free space or pick another DST") from exc
            if isinstance(exc, _NOT_RETRIED) or attempt == retries:
                raise StorageError(f"{what}: {exc}") from exc
        except (TimeoutError, ConnectionError) as exc:  # pragma: no cover - network only
            if attempt == retries:
                raise StorageError(f"{what}: {exc} after {retries} retries") from exc
        time.sleep(delay * (1 + random.random()))
        delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass
class Location:
    """A directory (or file) at an fsspec URL, with the filesystem that reaches it."""

    url: str
    fs: fsspec.AbstractFileSystem
    path: str

    def child(self, name: str) -> str:
        if name.startswith("/") or ".." in name.split("/"):
            raise UnsafeCheckpoint(f"{self.url}: file name {name!r} points outside the checkpoint")
        return f"{self.path.rstrip('/')}/{name}" if self.path else name

    def child_url(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def exists(self, name: str | None = None) -> bool:
        target = self.path if name is None else self.child(name)
        return with_retries(f"{self.url}", lambda: self.fs.exists(target))

    def isdir(self) -> bool:
        return with_retries(self.url, lambda: self.fs.isdir(self.path))

    def size(self, name: str | None = None) -> int:
        target = self.path if name is None else self.child(name)
        where = self.url if name is None else self.child_url(name)
        return int(with_retries(where, lambda: self.fs.size(target)))

    def read(self, name: str | None, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file (the whole file without a range)."""
        target = self.path if name is None else self.child(name)
        where = self.url if name is None else self.child_url(name)
        if start is None and end is None:
            return with_retries(where, lambda: self.fs.cat_file(target))
        data = with_retries(where, lambda: self.fs.cat_file(target, start=start, end=end))
        if end is not None and start is not None and len(data) != end - start:
            from shardkit.errors import CorruptCheckpoint

            raise CorruptCheckpoint(f"{where}: expected {end - start} bytes at offset {start}, got {len(data)} "
                                    "(file truncated?)")
        return data

    def listdir(self) -> list[str]:
        entries = with_retries(self.url, lambda: self.fs.ls(self.path, detail=False))
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def local_path(self, name: str | None = None) -> str | None:
        """The OS path when the location is on the local disk (for mmap), else ``None``."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if protocol not in ("file", "local"):
            return None
        return self.path if name is None else self.child(name)


def open_location(url: str, storage_options: dict[str, Any] | None = None) -> Location:
    """Resolve ``url`` (a path or any fsspec URL) with its storage options."""
    try:
        fs, path = url_to_fs(str(url), **(storage_options or {}))
    except (ValueError, ImportError) as exc:
        raise StorageError(f"{url}: cannot open this URL ({exc}); install the fsspec backend or fix the URL") from exc
    return Location(str(url).rstrip("/") or str(url), fs, path.rstrip("/") or path)
