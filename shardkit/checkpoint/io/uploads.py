"""A write-only S3 object as a file: parts of 8 MiB uploaded while the next one fills.

s3fs's own file uploads one part at a time and only when its buffer (50 MiB
by default) is full: the writer waits for every part, and a file of 40 MB is
one PUT sent after all of it was produced.  :class:`PartUploads` sends each
``part`` bytes as soon as they are written, ``depth`` parts in flight, and the
writer keeps producing meanwhile, so a stream of data files moves at the speed
of a parallel copy.  A file smaller than one part is a single ``PutObject``.

Memory: the part being filled plus ``depth`` parts in flight.  ``close``
completes the upload (the object appears whole, or not at all); ``discard``
aborts it so that no uploaded part stays behind, stored and billed.  A failed
part fails the write; the caller's retry layer writes the file again from the
start (as with s3fs's file).
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["PartUploads", "PART_BYTES", "DEPTH"]

log = logging.getLogger(__name__)

PART_BYTES = 8 << 20
DEPTH = 1  # parts in flight per file while the next one fills (a reshard writes several files at once)


class PartUploads:
    """``open(path, "wb")`` on an s3fs filesystem ``fs``, sending parts of ``part`` bytes ``depth`` at a time."""

    def __init__(self, fs: Any, path: str, *, part: int = PART_BYTES, depth: int = DEPTH) -> None:
        self.fs = fs
        self.path = path
        self.bucket, self.key = fs.split_path(path)[:2]
        self.part = part
        self.depth = max(1, depth)
        self.closed = False
        self.upload_id: str | None = None
        self.size = 0
        self.puts = 0  # requests that carried bytes (parts or the one PUT)
        self._buf = bytearray()
        self._sent: deque[Future] = deque()
        self._parts: list[dict[str, Any]] = []
        self._pool: ThreadPoolExecutor | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        while view:
            take = min(len(view), self.part - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.part:
                self._send(self._buf)
                self._buf = bytearray()
        self.size += n
        return n

    def flush(self) -> None:
        """Parts leave as they fill; nothing to flush before ``close``."""

    def _send(self, body: bytearray) -> None:
        if self.upload_id is None:
            answer = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self.upload_id = answer["UploadId"]
            self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="shardkit-upload")
        while len(self._sent) >= self.depth:  # bounded memory: wait for the oldest part in flight
            self._sent.popleft().result()
        number = len(self._parts) + 1
        self._parts.append({"PartNumber": number})
        assert self._pool is not None
        self._sent.append(self._pool.submit(self._upload, number, body))  # the caller starts a new buffer

    def _upload(self, number: int, body: bytearray) -> None:
        answer = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                 PartNumber=number, Body=body)
        self._parts[number - 1]["ETag"] = answer["ETag"]
        self.puts += 1

    def close(self) -> None:
        """Send what is left and complete the upload: the object appears whole."""
        if self.closed:
            return
        try:
            if self.upload_id is None:
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=bytes(self._buf))
                self.puts += 1
            else:
                if self._buf:
                    self._send(self._buf)
                    self._buf = bytearray()
                while self._sent:
                    self._sent.popleft().result()
                self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                                UploadId=self.upload_id, MultipartUpload={"Parts": self._parts})
                self.upload_id = None
        finally:
            self._stop()
        self.closed = True
        try:
            self.fs.invalidate_cache(self.path)
        except Exception:  # noqa: BLE001 - not every filesystem caches
            pass

    def discard(self) -> None:
        """Abandon the write: parts not sent are dropped, and an upload begun is aborted (logged, not
        raised, when that fails: the write's own failure is what the caller must see)."""
        self._buf = bytearray()
        self._stop()
        self.closed = True
        upload, self.upload_id = self.upload_id, None
        if upload is None:
            return
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("could not abort the multipart upload %s of s3://%s/%s (%s); its parts stay stored until "
                        "a bucket lifecycle rule (AbortIncompleteMultipartUpload) or an abort removes them",
                        upload, self.bucket, self.key, exc)

    def _stop(self) -> None:
        """Wait for the parts in flight (their requests end within the client's timeouts), cancel the rest."""
        pool, self._pool = self._pool, None
        if pool is not None:
            for future in self._sent:
                future.cancel()
            self._sent.clear()
            pool.shutdown(wait=True)

    def __enter__(self) -> "PartUploads":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.discard()
