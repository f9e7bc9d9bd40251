"""One checkpoint directory at any fsspec URL: the front every byte shardkit moves goes through.

:class:`Storage` holds the rules that do not depend on where the bytes live, and
hands the byte work to a backend: ``local_disk.py`` (pread into tensor memory,
fsync, ``os.replace`` commits) or ``remote.py`` (ranged requests, streamed
uploads, single-PUT commits, fresh listings).  The rules:

* **Names stay inside the checkpoint.**  Every name handed in (from our own
  writers or from a manifest read off disk) is checked by :func:`check_name`:
  relative, ``/``-separated, no ``..``, no absolute path, no URL scheme, no
  backslash or NUL (:class:`~shardkit.errors.UnsafeCheckpoint`); reads alone
  also take a sibling's file (:meth:`Storage.read_path`).
* **Commit is one atomic step.**  :meth:`Storage.put_atomic` writes a small
  object so that readers see either the old or the new one.
* **One bounded retry layer.**  Transient failures (throttling: 503 SlowDown,
  429; 5xx; a connection reset; an answer cut short; an answer that did not come
  within ``timeout``) are retried up to ``storage_options={"shardkit":
  {"retries": N}}`` times (default 3), with exponential backoff and jitter
  (:func:`~shardkit.checkpoint.io.retries.backoff_delay`: at most 0.25, 0.5, 1, 2, 2, ... s, each wait at least
  half of that and never over 2 s, so that Ctrl-C is never held long).  The
  first retry of a URL in a process is logged once at WARNING, every other
  attempt at DEBUG; when the retries are spent
  :class:`~shardkit.errors.StorageError` names the URL, the attempts and the
  last error.  The backend's own retries are off and its timeouts short
  (``"timeout"``, default 8 s): see ``clouds.py``.  Missing files,
  permissions, missing credentials, a missing bucket and a full disk are not
  retried, and each fails with its own one-line error.
* **Policy questions, not "is it local?".**  Callers ask what they need to know
  (:attr:`Storage.fsync_worthwhile`, :attr:`Storage.reads_in_place`, ...), and
  the backend answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, ContextManager, Iterable, Mapping, Sequence, TypeVar

from shardkit.checkpoint.io.clouds import CloudProfile, classify
from shardkit.checkpoint.io.local_disk import LocalDisk
from shardkit.checkpoint.io.names import check_name, check_reference, join_url, split_reference
from shardkit.checkpoint.io.remote import RemoteFiles
from shardkit.checkpoint.io.retries import backoff_delay, first_retry_of, retries_interrupted, wait_unless_interrupted
from shardkit.errors import (
    CheckpointNotFound,
    ConfigurationError,
    ShardkitError,
    UnsafeCheckpoint,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Storage", "split_file"]

T = TypeVar("T")

_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}

log = logging.getLogger(__name__)


class Storage:
    """A checkpoint directory (``url``) on an fsspec filesystem."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec

        if not isinstance(url, (str, os.PathLike)):
            raise ConfigurationError(f"checkpoint URL must be a string or path, got {type(url).__name__}")
        url = os.fspath(url)
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        cloud = CloudProfile.for_url(protocol, storage_options or {})
        try:
            fs, path = fsspec.core.url_to_fs(url, **cloud.options)
        except ImportError as exc:
            extra = f"; pip install 'shardkit[{_EXTRA[protocol]}]'" if protocol in _EXTRA else ""
            raise ConfigurationError(f"cannot open checkpoint URL {url!r}: {exc}{extra}") from None
        except ValueError as exc:
            if cloud.has_buckets and "account_name" in str(exc):  # adlfs: no account, key or connection string
                raise cloud.missing_credentials(f"opening {url}") from None
            raise ConfigurationError(f"cannot open checkpoint URL {url!r}: {exc}") from None
        cloud.tune(fs)
        self.cloud = cloud
        self.url = url.rstrip("/") or url
        self.fs = fs
        self.root = path.rstrip("/") or path
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.is_local = "file" in protocols or "local" in protocols
        self.in_this_process = "memory" in protocols  # no other process sees it
        self.is_object_store = not self.is_local and not self.in_this_process
        self.files = self._file_mover()
        self.storage_options = dict(storage_options or {})

    def _file_mover(self) -> LocalDisk | RemoteFiles:
        """The backend that moves this storage's bytes, retrying through this storage's :meth:`retry`."""
        if self.is_local:
            return LocalDisk(self.retry)
        return RemoteFiles(self.fs, self.cloud, self.retry, is_object_store=self.is_object_store)

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
        other.files = other._file_mover()  # its retries name its own root
        return other

    # -- retries -------------------------------------------------------
    def retry(self, what: str, fn: Callable[[], T], url: str | None = None) -> T:
        """``fn()`` with the storage rules: transient failures retried with :func:`backoff_delay` waits,
        then a :class:`~shardkit.errors.StorageError` naming ``what`` and the last error; "not found"
        raises :class:`~shardkit.errors.CheckpointNotFound` (``BucketNotFound`` for a missing bucket) at
        once.  ``url`` (default: ``what``) is what the one WARNING per retried URL is keyed by; the
        other attempts are logged at DEBUG, so a throttled save of a thousand files warns once per
        file, not once per request."""
        attempts = self.cloud.retries + 1
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
                    not self.is_object_store or self.cloud.has_answered()))  # a never-answering endpoint fails fast
                if attempt == attempts or not retryable or retries_interrupted():
                    raise self.cloud.error(failure, what, attempt) from exc
                delay = backoff_delay(attempt)
                level = logging.WARNING if first_retry_of(f"{self.cloud.key} {url or what}") else logging.DEBUG
                log.log(level, "%s: attempt %d of %d failed (%s); retrying in %.2f s", what, attempt, attempts,
                        failure.detail, delay)
                if wait_unless_interrupted(delay):
                    raise self.cloud.error(failure, what, attempt) from exc
            else:
                if self.is_object_store:
                    self.cloud.answered()
                return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _not_found(self, what: str) -> ShardkitError:
        return self.cloud.bucket_error(self.fs, self.root, what) or CheckpointNotFound(f"{what}: not found")

    # -- policy: what callers ask instead of "is it local?" ---------------
    @property
    def fsync_worthwhile(self) -> bool:
        """Whether fsync makes written data durable before a commit names it (a local disk); elsewhere a
        write is durable once it returns."""
        return self.files.fsync_worthwhile

    @property
    def reads_in_place(self) -> bool:
        """Whether reads fill the target tensor's memory directly (pread), so a reader need not stage."""
        return self.files.reads_in_place

    @property
    def rereads_from_cache(self) -> bool:
        """Whether bytes just read stay in the page cache, so reading them again costs no I/O."""
        return self.files.rereads_from_cache

    @property
    def parallel_requests_help(self) -> bool:
        """Whether several requests at once go faster (remote latency); one thread streams a local disk."""
        return self.files.parallel_requests_help

    @property
    def small_reads_cheap(self) -> bool:
        """Whether a read of a few MiB costs little more than its bytes (no per-request latency)."""
        return self.files.small_reads_cheap

    @property
    def maps_files(self) -> bool:
        """Whether a file here can be memory-mapped where it lies (else it is downloaded first)."""
        return self.files.maps_files

    @property
    def paths_are_os_paths(self) -> bool:
        """Whether :attr:`root` is a path of this machine's filesystem (os.path functions apply)."""
        return self.files.paths_are_os_paths

    # -- metadata ------------------------------------------------------
    def exists(self, name: str = "") -> bool:
        """Whether ``name`` (default: this URL itself) exists."""
        what = f"checking {self.where(name) if name else self.url}"
        return self.files.exists(self.read_path(name) if name else self.root, self.root, what)

    def is_dir(self, name: str = "") -> bool:
        """Whether ``name`` (default: this URL itself) is a directory; ``False`` when missing."""
        what = f"checking {self.where(name) if name else self.url}"
        return self.files.is_dir(self.read_path(name) if name else self.root, self.root, what)

    def size(self, name: str) -> int:
        return self.files.size(self.read_path(name), self.where(name))

    def listdir(self, name: str = "") -> list[str]:
        """Entry names (not paths) directly under ``name``; empty when it does not exist."""
        what = f"listing {self.where(name) if name else self.url}"
        return self.files.listdir(self._path_or_root(name), self.root, what)

    def listing(self) -> list[tuple[str, int, str]]:
        """(name, size, change stamp) of the files directly at this URL (or of the file itself): a stamp
        changes whenever a file is rewritten (inode and times locally, ETag or generation remotely)."""
        return self.files.listing(self.root, self.url)

    # -- reads ---------------------------------------------------------
    def read_bytes(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.files.read_bytes(self.read_path(name), f"reading {self.where(name)}", start, end)

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fill the flat uint8 tensor ``out`` with bytes ``[start, start + len(out))`` of ``name``."""
        self.read_parts(name, start, [out])

    def prefetch(self, name: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Ask the OS to start reading ``[start, end)`` ranges of a local file now (a hint; never fails).

        Issued for everything a load will read before the first read, so the
        disk streams at full depth while the reads copy and verify.
        """
        if self.is_local:
            self.files.prefetch(self.read_path(name), ranges)

    def prefetch_files(self, hints: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> None:
        """:meth:`prefetch` of several files' ``(name, ranges)`` at once, in order: a load's data is handed to
        the hinting thread in one go (:meth:`LocalDisk.prefetch_files`)."""
        if self.is_local:
            self.files.prefetch_files([(self.read_path(name), ranges) for name, ranges in hints])

    def files_held_open(self) -> ContextManager[None]:
        """This thread's :meth:`read_parts` calls inside keep a local file open from one call to the next,
        so the kernel reads ahead of a stream of steps (:meth:`LocalDisk.files_held_open`); elsewhere a
        no-op."""
        return self.files.files_held_open() if self.is_local else contextlib.nullcontext()

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
        what = f"reading {n} bytes at {start} of {self.where(name)}"
        truncated = f"{self.where(name)} ends before byte {start + n}; the file is truncated"
        self.files.read_parts(self.read_path(name), what, start, parts, truncated)

    def download(self, name: str, path: str) -> None:
        """Copy ``name`` to the local file ``path``."""
        self.files.download(self.path(name), f"downloading {self.where(name)}", path)

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
        return self.files.write_stream(self.path(name), f"writing {self.where(name)}", produce, fsync=fsync,
                                      direct=direct, root=self.root)

    def put_atomic(self, name: str, data: bytes) -> None:
        """Publish ``data`` under ``name`` in one atomic step (the commit of a checkpoint)."""
        self.files.put_atomic(self.path(name), f"committing {self.where(name)}", data, self.root)

    def replace(self, src: str, dst: str) -> None:
        """Move the finished file ``src`` over ``dst`` in one step: a rename on local disks; on object stores
        a server-side copy, which replaces the old object only once complete, then the source is removed."""
        self.files.replace(self.path(src), self.path(dst), f"moving {self.where(src)} to {self.where(dst)}")

    @staticmethod
    def temporary_name_prefix(name: str) -> str:
        """How the temporary names :meth:`write_then_replace` streams ``name`` to begin (a hidden name, then
        the process id and a random part): what a killed writer leaves is recognisable by it."""
        return f".{name}.partial-"

    def write_then_replace(self, name: str, produce: Callable[[Any], Any],
                           before_replace: Callable[[], None] = lambda: None) -> None:
        """Write file ``name`` as its own commit marker: stream ``produce`` to a temporary name beside it,
        run ``before_replace``, then :meth:`replace` it into place.  A file already at ``name`` (what
        ``--overwrite`` replaces) stays whole until then; on any failure the temporary file is removed."""
        temporary = f"{self.temporary_name_prefix(name)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.write_stream(temporary, produce, fsync=self.fsync_worthwhile)
            before_replace()
            self.replace(temporary, name)
        except BaseException:
            try:
                self.delete([temporary])
            except Exception:  # noqa: BLE001 - the original failure is what the user needs to see
                pass
            raise

    def makedirs(self, name: str = "") -> None:
        self.files.makedirs(self._path_or_root(name))

    def sync_dir(self, name: str = "") -> None:
        """fsync a local directory so that new entries in it survive a power loss."""
        self.files.sync_dir(self._path_or_root(name))

    # -- deletes -------------------------------------------------------
    def delete(self, names: Iterable[str]) -> None:
        paths = [self.path(n) for n in names]
        if paths:
            self.files.delete(paths, f"deleting {len(paths)} files under {self.url}")

    def delete_tree(self, name: str = "") -> None:
        """Remove a directory and everything under it (missing is fine)."""
        self.files.delete_tree(self._path_or_root(name))

    def remove_empty_dir(self, name: str = "") -> bool:
        """Remove directory ``name`` (default: this URL) if it is empty; whether it is gone."""
        return self.files.remove_empty_dir(self._path_or_root(name))

    # -- space ---------------------------------------------------------
    def tree_bytes(self, name: str = "") -> int:
        """Bytes the files under directory ``name`` (default: this URL) take now (0 when it is missing)."""
        return self.files.tree_bytes(self._path_or_root(name))

    def free_bytes(self) -> int:
        """Bytes free on the filesystem this URL is on (an object store: unbounded, ``sys.maxsize``)."""
        return self.files.free_bytes(self.root)


def split_file(storage: Storage) -> tuple[Storage, str]:
    """(storage of the parent directory, file name) for a storage that points at one file."""
    url = storage.url
    parent, _, name = url.rpartition("/")
    if not parent:
        parent = "."
    elif parent.endswith(":/") or parent.endswith("://"):
        parent = url[: len(parent) + 1]
    return Storage(parent, storage.storage_options), name
