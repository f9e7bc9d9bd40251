"""Work in parallel within bounds: a thread pool map that fails fast, and a byte budget that
keeps the data in flight under a cap (threads release the GIL in file, zstd and crc calls)."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, Iterator, Sequence, TypeVar

__all__ = ["DEFAULT_IO_THREADS", "parallel_map", "ByteBudget"]

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_IO_THREADS = max(2, min(8, os.cpu_count() or 2))


def parallel_map(fn: Callable[[T], R], items: Sequence[T], workers: int = DEFAULT_IO_THREADS) -> list[R]:
    """``[fn(x) for x in items]`` on a thread pool; the first exception cancels the rest and is raised."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="shardkit-io") as pool:
        futures = [pool.submit(fn, x) for x in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in futures:
            if fut.done() and fut.exception() is not None:
                for other in futures:
                    other.cancel()
                raise fut.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


class ByteBudget:
    """Blocks ``take(n)`` while more than ``limit`` bytes are taken (a single oversize take is allowed alone).

    Parallel ranged reads from object stores keep many requests in flight for
    throughput; this caps the bytes they hold at once, so memory stays bounded.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def take(self, n: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._used == 0 or self._used + n <= self._limit)
            self._used += n
        try:
            yield
        finally:
            with self._cond:
                self._used -= n
                self._cond.notify_all()
