"""One checkpoint directory at any fsspec URL: ranged reads, streamed writes, atomic commit.

Every byte shardkit moves goes through :class:`Storage`, so the rules live in
one place:

* **Names stay inside the checkpoint.**  Every name handed in (from our own
  writers or from a manifest read off disk) is checked by :func:`check_name`:
  relative, ``/``-separated, no ``..``, no absolute path, no URL scheme, no backslash or NUL
  (:class:`~shardkit.errors.UnsafeCheckpoint`); reads alone also take a sibling's file (:meth:`Storage.read_path`).
* **Commit is one atomic step.**  :meth:`Storage.put_atomic` writes a small
  object so that readers see either the old or the new one: temporary file +
  fsync + ``os.replace`` + directory fsync on local disks, a single PUT on
  object stores (never a rename, which S3/GCS implement as copy + delete).
* **No stale listings.**  s3fs/gcsfs cache directory listings; every listing and
  existence check here invalidates the cache first, so a committed step is
  never invisible and a deleted one never visible.
* **One bounded retry layer.**  Transient failures are retried a few times
  (``storage_options={"shardkit": {"retries": N}}``, default 3) with jittered
  backoff, logged at DEBUG; then :class:`~shardkit.errors.StorageError` names the
  URL.  The backend's own retries are off and its timeouts short
  (``"timeout"``, default 8 s): see ``storage_backends.py``.  Missing files,
  permissions, missing credentials, a missing bucket and a full disk are not
  retried, and each fails with its own one-line error.
* **Local disk is special-cased** for speed: ``pread`` straight into the target
  tensor's memory, buffered writes of tensor memory with no copy, optional
  fsync.  Other filesystems use fsspec's ranged ``cat_file`` and streamed
  ``open(..., "wb")`` (multipart uploads on S3).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import time
import uuid
from typing import Any, BinaryIO, Callable, Iterable, Mapping, Sequence, TypeVar

import numpy as np
import torch

from shardkit.checkpoint.io.storage_backends import Backend, classify
from shardkit.errors import (
    CheckpointNotFound,
    ConfigurationError,
    CorruptCheckpoint,
    ShardkitError,
    UnsafeCheckpoint,
)

__all__ = ["Storage", "split_file"]

T = TypeVar("T")

_BACKOFF_S = 0.2
_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
from shardkit.checkpoint.io.names import check_name, check_reference, join_url, split_reference

log = logging.getLogger(__name__)


class Storage:
    """A checkpoint directory (``url``) on an fsspec filesystem."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec

        if not isinstance(url, (str, os.PathLike)):
            raise ConfigurationError(f"checkpoint URL must be a string or path, got {type(url).__name__}")
        url = os.fspath(url)
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        backend = Backend.for_url(protocol, storage_options or {})
        try:
            fs, path = fsspec.core.url_to_fs(url, **backend.options)
        except ImportError as exc:
            extra = f"; pip install 'shardkit[{_EXTRA[protocol]}]'" if protocol in _EXTRA else ""
            raise ConfigurationError(f"cannot open checkpoint URL {url!r}: {exc}{extra}") from None
        except ValueError as exc:
            if backend.has_buckets and "account_name" in str(exc):  # adlfs: no account, key or connection string
                raise backend.missing_credentials(f"opening {url}") from None
            raise ConfigurationError(f"cannot open checkpoint URL {url!r}: {exc}") from None
        backend.tune(fs)
        self.backend = backend
        self.url = url.rstrip("/") or url
        self.fs = fs
        self.root = path.rstrip("/") or path
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.is_local = "file" in protocols or "local" in protocols
        self.in_this_process = "memory" in protocols  # no other process sees it
        self.is_object_store = not self.is_local and not self.in_this_process
        self.storage_options = dict(storage_options or {})

    # -- names ---------------------------------------------------------
    def path(self, name: str) -> str:
        """The filesystem path of ``name`` (checked: see :func:`check_name`)."""
        return self.root + "/" + check_name(name)

    def read_path(self, name: str) -> str:
        """:meth:`path`, or a sibling checkpoint's file for a reference ``../<sibling>/<name>`` (reads only)."""
        if (parts := split_reference(name)) is None:
            return self.path(name)
        if not (parent := self.root.rpartition("/")[0]):
            raise UnsafeCheckpoint(f"{self.url} has no parent directory, so {name!r} cannot name a sibling checkpoint")
        check_reference(name)
        return f"{parent}/{parts[0]}/{parts[1]}"

    def _path_or_root(self, name: str) -> str:
        """``""`` is the checkpoint directory (or file) itself, for the calls that take it."""
        return self.path(name) if name else self.root

    def where(self, name: str) -> str:
        parts = split_reference(name)
        return join_url(self.url.rpartition("/")[0] if parts else self.url, "/".join(parts) if parts else name)

    def child(self, name: str) -> "Storage":
        """The storage of a sub-directory (e.g. one step under a manager root)."""
        other = object.__new__(Storage)
        other.__dict__.update(self.__dict__)
        other.url = join_url(self.url, check_name(name))
        other.root = self.path(name)
        return other

    # -- retries -------------------------------------------------------
    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` with the storage rules: transient failures retried with jittered backoff (logged at
        DEBUG), then a :class:`~shardkit.errors.StorageError` naming ``what``; "not found" raises
        :class:`~shardkit.errors.CheckpointNotFound` (``BucketNotFound`` for a missing bucket) at once."""
        attempts = self.backend.retries + 1
        for attempt in range(1, attempts + 1):
            try:
                result = fn()
            except ShardkitError:
                raise
            except Exception as exc:  # noqa: BLE001 - backend errors (botocore, aiohttp, azure) vary
                failure = classify(exc)
                if failure.kind == "fatal":
                    raise
                if failure.kind == "not_found":
                    raise self._not_found(what) from None
                retryable = failure.kind == "transient" or (failure.kind in ("unreachable", "no_answer") and (
                    not self.is_object_store or self.backend.has_answered()))  # a never-answering endpoint fails fast
                if attempt == attempts or not retryable:
                    raise self.backend.error(failure, what, attempt) from exc
                delay = _BACKOFF_S * 2 ** (attempt - 1) * (0.5 + random.random())
                log.debug("%s: attempt %d of %d failed (%s); retrying in %.2f s", what, attempt, attempts,
                          failure.detail, delay)
                time.sleep(delay)
            else:
                if self.is_object_store:
                    self.backend.answered()
                return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _not_found(self, what: str) -> ShardkitError:
        return self.backend.bucket_error(self.fs, self.root, what) or CheckpointNotFound(f"{what}: not found")

    # -- metadata ------------------------------------------------------
    def _fresh(self, path: str) -> None:
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - not every filesystem caches
            pass

    def exists(self, name: str = "") -> bool:
        """Whether ``name`` (default: this URL itself) exists."""
        return self._probe(name, os.path.exists, "exists")

    def is_dir(self, name: str = "") -> bool:
        """Whether ``name`` (default: this URL itself) is a directory; ``False`` when missing."""
        return self._probe(name, os.path.isdir, "isdir")

    def _probe(self, name: str, local: Callable[[str], bool], method: str) -> bool:
        """Only "not found" means no: any other failure (a 403, a timeout) raises StorageError."""
        path = self.read_path(name) if name else self.root
        if self.is_local:
            return local(path)
        self._fresh(path)

        def probe() -> bool:
            try:
                return bool(getattr(self.fs, method)(path))
            except FileNotFoundError:
                return False
        what = f"checking {self.where(name) if name else self.url}"
        found = self.retry(what, probe)
        if not found and (missing := self.backend.bucket_error(self.fs, self.root, what)):
            raise missing
        return found

    def size(self, name: str) -> int:
        path = self.read_path(name)
        if self.is_local:
            try:
                return os.stat(path).st_size
            except FileNotFoundError:
                raise CheckpointNotFound(f"{self.where(name)} is missing; the checkpoint is incomplete") from None
        self._fresh(path)
        return int(self.retry(f"size of {self.where(name)}", lambda: self.fs.size(path)))

    def listdir(self, name: str = "") -> list[str]:
        """Entry names (not paths) directly under ``name``; empty when it does not exist."""
        path = self._path_or_root(name)
        if self.is_local:
            try:
                return sorted(os.listdir(path))
            except (FileNotFoundError, NotADirectoryError):
                return []
        self._fresh(path)

        def ls() -> list[str]:
            try:
                return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)]
            except FileNotFoundError:
                return []

        what = f"listing {self.where(name) if name else self.url}"
        names = self.retry(what, ls)
        if not names and (missing := self.backend.bucket_error(self.fs, self.root, what)):
            raise missing
        return sorted(set(names))

    # -- reads ---------------------------------------------------------
    def read_bytes(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self.read_path(name)
        what = f"reading {self.where(name)}"
        if self.is_local:
            def local() -> bytes:
                with open(path, "rb") as f:
                    if start:
                        f.seek(start)
                    return f.read() if end is None else f.read(end - (start or 0))
            return self.retry(what, local)
        return self.retry(what, lambda: self.fs.cat_file(path, start=start, end=end))

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fill the flat uint8 tensor ``out`` with bytes ``[start, start + len(out))`` of ``name``."""
        self.read_parts(name, start, [out])

    def prefetch(self, name: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Ask the OS to start reading ``[start, end)`` ranges of a local file now (a hint; never fails).

        Issued for everything a load will read before the first read, so the
        disk streams at full depth while the reads copy and verify.
        """
        if not self.is_local or not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = os.open(self.read_path(name), os.O_RDONLY)
        except OSError:
            return
        try:
            for start, end in ranges:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def read_parts(self, name: str, start: int, parts: Sequence[torch.Tensor]) -> None:
        """Fill flat uint8 tensors ``parts`` with consecutive bytes of ``name`` from ``start``.

        Local files use one ``preadv`` straight into the parts' memory (the
        target tensor's, when a reader loads in place); other filesystems fetch
        the range with one ranged request and copy it into the parts.
        """
        parts = [p for p in parts if p.numel()]
        n = sum(p.numel() for p in parts)
        if n == 0:
            return
        path = self.read_path(name)
        what = f"reading {n} bytes at {start} of {self.where(name)}"
        truncated = f"{self.where(name)} ends before byte {start + n}; the file is truncated"
        if self.is_local:
            views = [memoryview(p.numpy()).cast("B") for p in parts]

            def local() -> None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    pos, i, off = start, 0, 0
                    while i < len(views):
                        bufs = [views[i][off:]] + views[i + 1:]
                        got = os.preadv(fd, bufs, pos)
                        if got == 0:
                            raise CorruptCheckpoint(truncated)
                        pos += got
                        while got and i < len(views):
                            left = len(views[i]) - off
                            if got >= left:
                                got -= left
                                i, off = i + 1, 0
                            else:
                                off += got
                                got = 0
                finally:
                    os.close(fd)
            self.retry(what, local)
            return
        data = self.retry(what, lambda: self.fs.cat_file(path, start=start, end=start + n))
        if len(data) != n:
            raise CorruptCheckpoint(truncated)
        flat = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        for p in parts:
            p.numpy()[:] = flat[pos:pos + p.numel()]
            pos += p.numel()

    # -- writes --------------------------------------------------------
    def write_stream(self, name: str, produce: Callable[[BinaryIO], T], *, fsync: bool = True,
                     direct: bool = True) -> T:
        """Create ``name`` and let ``produce(fileobj)`` stream into it; retried from scratch on failure.

        On local disks the file is written with ``O_DIRECT`` when ``direct``
        and the filesystem allows it (see ``direct_io.py``), else buffered, and
        fsynced when ``fsync`` is true (durability of the data before the
        manifest commits it).  On object stores closing the file completes the
        (multipart) upload.
        """
        path = self.path(name)
        what = f"writing {self.where(name)}"
        if self.is_local:
            def local() -> T:
                from shardkit.checkpoint.io.direct_io import open_direct

                os.makedirs(os.path.dirname(path), exist_ok=True)
                raw = open_direct(path) if direct else None
                if raw is not None:
                    try:
                        result = produce(raw)  # type: ignore[arg-type]
                        raw.close(fsync=fsync)
                        return result
                    except OSError as exc:
                        raw.abort()
                        if exc.errno != errno.EINVAL:  # EINVAL: O_DIRECT accepted at open, refused on write
                            raise
                    except BaseException:
                        raw.abort()
                        raise
                with open(path, "wb") as f:
                    result = produce(f)
                    f.flush()
                    if fsync:
                        os.fsync(f.fileno())
                return result
            return self.retry(what, local)

        def remote() -> T:
            with self.fs.open(path, "wb") as f:
                return produce(f)
        self.backend.reach(self.fs, self.root, what)
        return self.retry(what, remote)

    def put_atomic(self, name: str, data: bytes) -> None:
        """Publish ``data`` under ``name`` in one atomic step (the commit of a checkpoint)."""
        path = self.path(name)
        what = f"committing {self.where(name)}"
        if self.is_local:
            def local() -> None:
                directory = os.path.dirname(path)
                os.makedirs(directory, exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                _fsync_dir(directory)
            self.retry(what, local)
            return
        self.backend.reach(self.fs, self.root, what)
        self.retry(what, lambda: self.fs.pipe_file(path, data))
        self._fresh(path)

    def makedirs(self, name: str = "") -> None:
        path = self._path_or_root(name)
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        elif not self.is_object_store:
            self.retry(f"creating {path}", lambda: self.fs.makedirs(path, exist_ok=True))

    def sync_dir(self, name: str = "") -> None:
        """fsync a local directory so that new entries in it survive a power loss."""
        if self.is_local:
            _fsync_dir(self._path_or_root(name))

    # -- deletes -------------------------------------------------------
    def delete(self, names: Iterable[str]) -> None:
        paths = [self.path(n) for n in names]
        if not paths:
            return
        if self.is_local:
            for p in paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            return

        def rm() -> None:
            try:
                self.fs.rm(paths)
            except FileNotFoundError:
                pass
        self.retry(f"deleting {len(paths)} files under {self.url}", rm)
        for p in paths:
            self._fresh(p)

    def delete_tree(self, name: str = "") -> None:
        """Remove a directory and everything under it (missing is fine)."""
        path = self._path_or_root(name)
        if self.is_local:
            shutil.rmtree(path, ignore_errors=True)
            return

        def rm() -> None:
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
        self.retry(f"deleting {path}", rm)
        self._fresh(path)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def split_file(storage: Storage) -> tuple[Storage, str]:
    """(storage of the parent directory, file name) for a storage that points at one file."""
    url = storage.url
    parent, _, name = url.rpartition("/")
    if not parent:
        parent = "."
    elif parent.endswith(":/") or parent.endswith("://"):
        parent = url[: len(parent) + 1]
    return Storage(parent, storage.storage_options), name
