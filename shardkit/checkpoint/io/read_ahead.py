"""Read-ahead hints on a local disk: the kernel asked to start reading what a load will read next.

Why a thread: a ``POSIX_FADV_WILLNEED`` returns once the kernel has allocated the page cache pages for
what it will read (up to the read-ahead window) and queued the reads -- about 2.5 ms per 8 MiB on these
VMs, which a cold load's planning waited for.  So hints of more than :data:`INLINE_HINT_BYTES` (a load's
data; not a header, which its caller reads next) go to one daemon thread per process, handed over in one
queue put per load, and the caller goes on at once.  A hint never fails: one that cannot be given is
dropped.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Sequence

from shardkit.checkpoint.io.concurrency import PerProcess

__all__ = ["INLINE_HINT_BYTES", "ReadAheadThread", "give_hints", "hint", "read_ahead_thread"]

INLINE_HINT_BYTES = 1 << 20  # hints up to this size are given by the caller itself

Hints = Sequence[tuple[str, Sequence[tuple[int, int]]]]


def hint(path: str, ranges: Sequence[tuple[int, int]]) -> None:
    """``POSIX_FADV_WILLNEED`` for each ``(start, end)`` range of ``path``; errors ignored (a hint)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        for start, end in ranges:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


class ReadAheadThread:
    """One daemon thread per process that gives the kernel read-ahead hints handed to it, in order: a
    hint is a few system calls, so one thread keeps up, and handing one over costs the caller a queue put
    (starting a thread per hint cost 1-20 ms: the caller waits for the new thread to be scheduled)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[tuple[str, list[tuple[int, int]]]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="shardkit-read-ahead", daemon=True).start()

    def put(self, hints: Hints) -> None:
        """Hand over ``(path, ranges)`` hints, given in order: one put however many files (each put wakes the
        thread, and on a busy machine the wake-up can take the caller's core for a while)."""
        self._queue.put([(path, list(ranges)) for path, ranges in hints])

    def _run(self) -> None:
        while True:
            for path, ranges in self._queue.get():
                try:
                    hint(path, ranges)
                except Exception:  # noqa: BLE001 - a hint that failed is a hint not given; the thread serves the next
                    pass


read_ahead_thread: PerProcess[ReadAheadThread] = PerProcess(ReadAheadThread)


def give_hints(hints: Hints) -> None:
    """``(path, ranges)`` hints, in order: the small ones here, the rest handed to the read-ahead thread at once
    (one wake-up for a whole load's data, not one per file).  Nothing where the OS has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return
    later = []
    for path, ranges in hints:
        if sum(end - start for start, end in ranges) <= INLINE_HINT_BYTES:
            hint(path, ranges)
        else:
            later.append((path, ranges))
    if later:
        read_ahead_thread.get().put(later)
