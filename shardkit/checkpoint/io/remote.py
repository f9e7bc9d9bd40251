"""The byte work of :class:`~shardkit.checkpoint.io.storage.Storage` on any other fsspec filesystem.

* **Reads** are ranged ``cat_file`` requests, copied into the target tensors;
  an offline conversion reads through a :class:`~shardkit.checkpoint.io.read_cache.BlockCache`
  instead (:meth:`RemoteFiles.read_through`: 8 MiB requests, each block fetched once, read ahead).
* **Writes** stream through ``open(..., "wb")``; on S3 through
  :class:`~shardkit.checkpoint.io.uploads.PartUploads` (8 MiB parts uploaded while the next one
  fills, one PUT for a smaller file); closing the file completes the upload.  A write that fails is discarded, never
  closed: closing would complete the upload with the parts sent so far (a
  partial object under the final name), so the multipart upload is aborted
  instead (retried like any request) and no parts are left behind, billed.
* **A read cut short is a failure**, retried like one: aiohttp checks every
  answer against its ``Content-Length``, and a ranged read that comes back
  shorter than asked for is a truncated file (``CorruptCheckpoint``).
* **A commit is a single PUT** (``pipe_file``), never a rename, which S3/GCS
  implement as copy + delete.
* **No stale listings.**  s3fs/gcsfs cache directory listings; every listing and
  existence check here invalidates the cache first, so a committed step is
  never invisible and a deleted one never visible.
* **A missing bucket is named** instead of a missing file (``clouds.py``), and
  the first write to an endpoint that has not answered yet checks the bucket
  first, so a wrong endpoint fails within the timeout.

Paths handed in are already checked by the front; ``retry`` is the front's
bounded retry layer (``retry(what, fn, url)``, warning once per retried
``url``); ``root`` is the checkpoint's root, whose bucket is the one checked.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Mapping, Sequence, TypeVar

import numpy as np

from shardkit.checkpoint.io import head_start
from shardkit.checkpoint.io.clouds import CloudProfile
from shardkit.checkpoint.io.read_cache import BlockCache
from shardkit.checkpoint.io.uploads import DEPTH as UPLOAD_DEPTH
from shardkit.checkpoint.io.uploads import PartUploads
from shardkit.errors import CorruptCheckpoint

if TYPE_CHECKING:  # the parts handed in are tensors; the byte work here needs only their buffers
    import torch

__all__ = ["RemoteFiles", "change_stamp"]

T = TypeVar("T")
log = logging.getLogger(__name__)
Retry = Callable[..., Any]  # Storage.retry(what, fn, url=None)


def change_stamp(info: Mapping[str, Any]) -> str:
    """What changes when an object is rewritten: its ETag/generation remotely, else its mtime."""
    for key in ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""


class RemoteFiles:
    """An fsspec filesystem other than the local disk: an object store, or ``memory://``."""

    # The answers to Storage's policy questions (see its properties for what each one means).
    fsync_worthwhile = False
    reads_in_place = False
    rereads_from_cache = False
    parallel_requests_help = True
    small_reads_cheap = False
    maps_files = False
    paths_are_os_paths = False

    def __init__(self, fs: Any, cloud: CloudProfile, retry: Retry, *, is_object_store: bool) -> None:
        self.fs = fs
        self.cloud = cloud
        self.retry = retry
        self.is_object_store = is_object_store
        self.cache: BlockCache | None = None
        self.upload_depth = UPLOAD_DEPTH  # S3 parts in flight per file (a writer of fewer files may send more)

    def read_through(self, budget: int, threads: int) -> BlockCache:
        """Serve ranged reads from now on from a :class:`BlockCache` of ``budget`` bytes reading ahead on
        ``threads`` threads (close it, and set ``cache`` back to ``None``, when done): the one a head start
        began on this same store with these same options (:mod:`.head_start`), blocks already fetched,
        else a new one.  While it serves, a file's size is asked of the store once (:meth:`size`)."""
        def fetch(path: str, start: int, end: int) -> bytes:
            return self.retry(f"reading bytes {start}-{end} of {self.url(path)}",
                              lambda: self.fs.cat_file(path, start=start, end=end), self.url(path))

        def size_of(path: str) -> int:
            return self.asked_size(path, self.url(path))
        cache = head_start.take(self.fs)
        if cache is not None and not cache.adopt(fetch, size_of, budget=budget, threads=threads):
            cache.close()
            cache = None
        self.cache = cache or BlockCache(fetch, size_of, budget=budget, threads=threads)
        return self.cache

    def url(self, path: str) -> str:
        """``path`` as a URL (``s3://bucket/key``): what a retry's one WARNING is keyed by."""
        try:
            return str(self.fs.unstrip_protocol(path))
        except Exception:  # noqa: BLE001 - any filesystem without the method: the path names it too
            return path

    def fresh(self, path: str) -> None:
        """Drop what the filesystem cached about ``path`` (and its listing)."""
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - not every filesystem caches
            pass

    def raise_if_no_bucket(self, root: str, what: str) -> None:
        if missing := self.cloud.bucket_error(self.fs, root, what):
            raise missing

    # -- metadata ------------------------------------------------------
    def probe(self, path: str, method: str, root: str, what: str) -> bool:
        """Only "not found" means no: any other failure (a 403, a timeout) raises StorageError."""
        self.fresh(path)

        def probe() -> bool:
            try:
                return bool(getattr(self.fs, method)(path))
            except FileNotFoundError:
                return False
        found = self.retry(what, probe, self.url(path))
        if not found:
            self.raise_if_no_bucket(root, what)
        return found

    def exists(self, path: str, root: str, what: str) -> bool:
        return self.probe(path, "exists", root, what)

    def is_dir(self, path: str, root: str, what: str) -> bool:
        return self.probe(path, "isdir", root, what)

    def size(self, path: str, where: str) -> int:
        """The object's size; while a read-through cache serves, the one answer it got for this file
        (each reader thread checks a data file's length: one request, not one per thread)."""
        if self.cache is not None:
            return self.cache.size(path)
        return self.asked_size(path, where)

    def asked_size(self, path: str, where: str) -> int:
        """The object's size, asked of the store now."""
        self.fresh(path)
        return int(self.retry(f"size of {where}", lambda: self.fs.size(path), self.url(path)))

    def listdir(self, path: str, root: str, what: str) -> list[str]:
        self.fresh(path)

        def ls() -> list[str]:
            try:
                return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)]
            except FileNotFoundError:
                return []
        names = self.retry(what, ls, self.url(path))
        if not names:
            self.raise_if_no_bucket(root, what)
        return sorted(set(names))

    def listing(self, root: str, url: str) -> list[tuple[str, int, str]]:
        """(name, size, change stamp) of the files directly under ``root`` (or of the file itself).  Asked
        as "what is it?" first: for a file (a data file's stamp, journaled as it lands) that one request
        answers; a directory is then listed."""
        self.fresh(root)

        def look() -> dict[str, Any] | None:
            try:
                return self.fs.info(root)
            except FileNotFoundError:
                return None
        info = self.retry(f"checking {url}", look, url)
        if info is None:
            self.raise_if_no_bucket(root, f"checking {url}")
            infos = [self.retry(f"checking {url}", lambda: self.fs.info(root), url)]  # fails as it did before
        elif info.get("type", "file") == "directory":
            infos = self.retry(f"listing {url}", lambda: self.fs.ls(root, detail=True), url)
        else:
            infos = [info]
        return sorted((str(i["name"]).rstrip("/").rsplit("/", 1)[-1], int(i.get("size") or 0), change_stamp(i))
                      for i in infos if i.get("type", "file") == "file")

    # -- reads ---------------------------------------------------------
    def read_bytes(self, path: str, what: str, start: int | None, end: int | None) -> bytes:
        if self.cache is not None and start is not None and end is not None:
            return self.cache.read(path, start, end)
        return self.retry(what, lambda: self.fs.cat_file(path, start=start, end=end), self.url(path))

    def prefetch(self, path: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Nothing to hint: remote reads are requests of their own."""

    def read_parts(self, path: str, what: str, start: int, parts: Sequence[torch.Tensor], truncated: str) -> None:
        """One ranged request for the whole span, copied into the parts."""
        n = sum(p.numel() for p in parts)
        if self.cache is not None:
            data = self.cache.read(path, start, start + n)
        else:
            data = self.retry(what, lambda: self.fs.cat_file(path, start=start, end=start + n), self.url(path))
        if len(data) != n:
            raise CorruptCheckpoint(truncated)
        flat = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        for p in parts:
            p.numpy()[:] = flat[pos:pos + p.numel()]
            pos += p.numel()

    def download(self, path: str, what: str, local_path: str) -> None:
        self.retry(what, lambda: self.fs.get_file(path, local_path), self.url(path))

    # -- writes --------------------------------------------------------
    def write_stream(self, path: str, what: str, produce: Callable[[BinaryIO], T], *, fsync: bool, direct: bool,
                     root: str) -> T:
        """Streamed; ``fsync`` and ``direct`` mean nothing here.  Each attempt starts from scratch; a failed
        one is discarded (its multipart upload aborted), never completed."""
        def remote() -> T:
            f = PartUploads(self.fs, path, depth=self.upload_depth) \
                if self.is_object_store and hasattr(self.fs, "call_s3") else self.fs.open(path, "wb")
            try:
                result = produce(f)
                f.close()  # completes the upload: the object appears whole, or not at all
            except BaseException:
                self.discard(f, what)
                raise
            return result
        self.cloud.reach(self.fs, root, what)
        return self.retry(what, remote, self.url(path))

    def discard(self, f: Any, what: str) -> None:
        """Throw away a write that failed: abort its multipart upload (so that no uploaded part stays
        behind, stored and billed), retried like any request, and mark the file closed so that neither
        ``close`` nor garbage collection completes it.  A failure to abort is logged, not raised: the
        write's own failure is what the caller must see."""
        upload = getattr(f, "mpu", None)  # s3fs's multipart upload in progress
        bucket, key = getattr(f, "bucket", None), getattr(f, "key", None)
        if upload is None and callable(getattr(f, "discard", None)):
            try:
                f.discard()  # gcsfs cancels its resumable upload; others drop their buffer
            except Exception:  # noqa: BLE001 - best effort: the write's own failure is what matters
                pass
        try:
            f.closed = True
        except AttributeError:  # a file whose ``closed`` is read-only (io.BytesIO): nothing completes it
            pass
        if not upload or not bucket or not key:
            return
        f.mpu = None
        try:
            self.retry(f"aborting the failed upload of {what.removeprefix('writing ')}",
                       lambda: self.fs.abort_mpu(bucket, key, upload["UploadId"]), self.url(f"{bucket}/{key}"))
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("could not abort the multipart upload %s of %s (%s); its parts stay stored until a "
                        "bucket lifecycle rule (AbortIncompleteMultipartUpload) or an abort removes them",
                        upload.get("UploadId"), self.url(f"{bucket}/{key}"), exc)

    def put_atomic(self, path: str, what: str, data: bytes, root: str) -> None:
        self.cloud.reach(self.fs, root, what)
        self.retry(what, lambda: self.fs.pipe_file(path, data), self.url(path))
        self.fresh(path)

    def replace(self, src: str, dst: str, what: str) -> None:
        """A server-side copy, which replaces the old object only once complete; then the source is removed."""
        self.retry(what, lambda: self.fs.mv(src, dst), self.url(dst))

    def makedirs(self, path: str) -> None:
        if not self.is_object_store:  # object stores have no directories to create
            self.retry(f"creating {path}", lambda: self.fs.makedirs(path, exist_ok=True), self.url(path))

    def sync_dir(self, path: str) -> None:
        """Nothing to sync: a remote write is durable once it returns."""

    # -- deletes -------------------------------------------------------
    def delete(self, paths: Iterable[str], what: str) -> None:
        paths = list(paths)

        def rm() -> None:
            try:
                self.fs.rm(paths)
            except FileNotFoundError:
                pass
        self.retry(what, rm)
        for p in paths:
            self.fresh(p)

    def delete_tree(self, path: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
        self.retry(f"deleting {path}", rm, self.url(path))

    def remove_empty_dir(self, path: str) -> bool:
        """Object stores have no empty directories; a filesystem's is removed when nothing is in it."""
        if self.listdir(path, path, f"listing {path}"):
            return False
        if not self.is_object_store:
            self.delete_tree(path)
        return True

    def tree_bytes(self, path: str) -> int:
        try:
            return int(self.retry(f"sizing {path}", lambda: self.fs.du(path, total=True), self.url(path)))
        except FileNotFoundError:
            return 0

    def free_bytes(self, path: str) -> int:
        return sys.maxsize
        self.fresh(path)
