"""A thread-pool map for offline writers that an interrupt (Ctrl-C) stops at once.

Why not :func:`~shardkit.checkpoint.io.concurrency.parallel_map`: a signal
reaches only the main thread, and leaving a ``ThreadPoolExecutor`` block waits
for every worker to finish its item -- a whole data file, which on an object
store at a few MB/s is many seconds (``reshard`` to S3 took 17 s to stop).
Here the main thread, interrupted, tells the workers to stop (each checks
``stop`` between chunks and abandons its file, which is never journaled, so a
rerun writes it again) and raises at once, without waiting for them.  Any
other failure still waits for the workers, so that their partial files are
removed before the caller sees the error.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

__all__ = ["Stopped", "stoppable_map"]

T = TypeVar("T")
R = TypeVar("R")


class Stopped(Exception):
    """Raised in a worker that saw the stop request: its item is abandoned, not failed."""


def stoppable_map(fn: Callable[[T, threading.Event], R], items: Sequence[T], workers: int) -> list[R]:
    """``[fn(x, stop) for x in items]`` on ``workers`` threads; the first exception cancels the rest and is
    raised (after the running items ended), and a ``KeyboardInterrupt`` sets ``stop`` and is raised at once."""
    items = list(items)
    stop = threading.Event()
    if workers <= 1 or len(items) <= 1:
        return [fn(x, stop) for x in items]  # on this thread: an interrupt lands in fn itself
    pool = ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="shardkit-write")
    futures = [pool.submit(fn, x, stop) for x in items]
    interrupted = False
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                stop.set()
                raise future.exception()  # type: ignore[misc]
        return [future.result() for future in futures]
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        stop.set()
        pool.shutdown(wait=not interrupted, cancel_futures=True)
