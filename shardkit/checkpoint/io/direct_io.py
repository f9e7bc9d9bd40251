"""Local data-file writes that bypass the page cache (``O_DIRECT``).

Why: a buffered write must first get a fresh page-cache page for every 4 KiB
it writes.  On VMs that hand idle memory back to the host (ours: after ~2 s)
each such page costs a host page fault, capping buffered writes at 0.3-0.6
GB/s while the disk takes 1.5 GB/s; on any machine the page cache then holds a
second copy of the checkpoint.  ``O_DIRECT`` sends the bytes from a small,
reused, page-aligned buffer straight to the device.

How: :class:`DirectFile` is a write-only file object.  Pieces of any size and
alignment are copied into a per-thread 8 MiB ``mmap`` buffer (page aligned,
reused across files and saves, so its memory stays warm) and written in whole
4 KiB-aligned blocks; the last block is zero-padded and the file truncated to
its true size.  Durability is unchanged: ``close(fsync=True)`` still fsyncs
(``O_DIRECT`` alone does not flush a device's write cache).

Filesystems without ``O_DIRECT`` (tmpfs, some network filesystems) make
:func:`open_direct` return ``None``; callers then write buffered.

Failures: a write, the padded last block or the fsync may raise ``OSError``
(``ENOSPC`` on a full disk, often only at the last block or the fsync).  The
file object closes its descriptor and leaves the rest to its caller,
``LocalDisk.write_stream``: ``EINVAL`` (``O_DIRECT`` accepted at open,
refused on write) retries the file buffered; anything else removes the file,
and a full disk becomes one ``CheckpointOSError`` naming it (``local_disk.py``).
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

__all__ = ["ALIGN", "DirectFile", "open_direct", "staging_buffer"]

ALIGN = 4096
BUFFER_BYTES = 8 << 20
_local = threading.local()


def staging_buffer() -> mmap.mmap:
    """This thread's page-aligned buffer that O_DIRECT writes are staged in (made on first use, kept)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        # private: an anonymous mmap is shared by default, so a process forked after this thread wrote would
        # stage its bytes in the very pages its parent and siblings stage theirs in (copies on write instead)
        buf = _local.buf = mmap.mmap(-1, BUFFER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return buf


class DirectFile:
    """Sequential writes to a new file through an aligned buffer and ``O_DIRECT``."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = staging_buffer()
        self._view = memoryview(self._buf)
        self._fill = 0
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        pos, n = 0, len(src)
        while pos < n:
            take = min(BUFFER_BYTES - self._fill, n - pos)
            self._view[self._fill:self._fill + take] = src[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == BUFFER_BYTES:
                self._drain(BUFFER_BYTES)
        self.size += n
        return n

    def _drain(self, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            done += os.write(self._fd, self._view[done:nbytes])
        self._fill = 0

    def flush(self) -> None:  # whole blocks only; the tail waits for close()
        pass

    def fileno(self) -> int:
        return self._fd

    def close(self, fsync: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._fill:
                padded = -(-self._fill // ALIGN) * ALIGN
                self._view[self._fill:padded] = bytes(padded - self._fill)
                self._drain(padded)
            os.ftruncate(self._fd, self.size)
            if fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)


def open_direct(path: str) -> DirectFile | None:
    """A :class:`DirectFile` for a new file at ``path``, or ``None`` where ``O_DIRECT`` is unavailable."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        return None
    return DirectFile(fd)
