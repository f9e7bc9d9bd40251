"""Work in parallel within bounds: a thread pool map that fails fast, and a byte budget that
keeps the data in flight under a cap (threads release the GIL in file, zstd and crc calls).

The map's threads come from one pool per process, made on first use and kept: starting a pool's threads
for every call cost a save or a load of a small state a large part of its time (1-2 ms per thread on a
busy machine, several threads per call, plus joining them).  The pool grows only when every thread it has
is busy (``concurrent.futures``' pool miscounts its idle threads and keeps starting new ones), is forgotten
in a forked child (its threads stay in the parent), and is stopped and joined at exit, after the program's
threads -- and shardkit's background saves (:func:`shardkit.held_groups.finish_before_exit`) -- finished.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import queue
import threading
from typing import Callable, Generic, Iterator, Sequence, TypeVar

__all__ = ["DEFAULT_IO_THREADS", "POOL_THREADS", "parallel_map", "shutdown_io_pool", "ByteBudget", "PerProcess"]

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_IO_THREADS = max(2, min(8, os.cpu_count() or 2))
# Threads the shared pool may hold, over every caller (a load's object-store reads ask for 16, and a
# background save's may overlap them); more helpers than that wait in its queue, and the callers work too.
POOL_THREADS = 64


class _Helper:
    """One helper task of a :func:`parallel_map` call: runs once, unless cancelled before it started."""

    __slots__ = ("_run", "_state", "_lock", "_done", "_pool")

    def __init__(self, run: Callable[[], None], pool: "_Pool") -> None:
        self._run, self._state, self._pool = run, "queued", pool
        self._lock, self._done = threading.Lock(), threading.Event()

    def start(self) -> bool:
        """Whether it is to run (it was not cancelled); the pool counts it busy from here."""
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "running"
            self._pool.count(queued=-1, busy=1)
            return True

    def run(self) -> None:
        try:
            self._run()  # never raises: parallel_map's runner keeps its items' exceptions
        finally:
            self._pool.count(busy=-1)
            self._done.set()

    def cancel_or_wait(self) -> None:
        """Cancel it if it has not started, else wait until it ended."""
        with self._lock:
            if self._state == "queued":
                self._state = "cancelled"
                self._pool.count(queued=-1)
                return
        self._done.wait()


class _Pool:
    """Daemon threads taking helpers from one queue.  A new thread starts only when the threads it has are
    all running or promised to helpers still queued; a cancelled helper frees its promise at once."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[_Helper | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._queued = 0  # helpers queued and not cancelled
        self._busy = 0  # helpers running
        self._closed = False

    def count(self, queued: int = 0, busy: int = 0) -> None:
        with self._lock:
            self._queued += queued
            self._busy += busy

    def submit(self, run: Callable[[], None]) -> _Helper | None:
        """Queue a helper running ``run``; ``None`` once the pool was shut down."""
        with self._lock:
            if self._closed:
                return None
            if len(self._threads) - self._busy - self._queued <= 0 and len(self._threads) < POOL_THREADS:
                thread = threading.Thread(target=self._work, name=f"shardkit-io_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._queued += 1
            helper = _Helper(run, self)
            self._tasks.put(helper)
        return helper

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if task.start():
                task.run()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._tasks.put(None)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()


class PerProcess(Generic[T]):
    """One object per process, made by ``make`` on first use and kept; forgotten in a forked child, whose
    parent's threads (and the locks they may have held) do not exist there."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._value: T | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value

    def take(self) -> T | None:
        """The object, if one was made, no longer kept: the next :meth:`get` makes a new one."""
        with self._lock:
            value, self._value = self._value, None
            return value

    def _forget(self) -> None:
        self._value, self._lock = None, threading.Lock()


_pool: PerProcess[_Pool] = PerProcess(_Pool)


def shutdown_io_pool() -> None:
    """Stop and join the shared pool's threads; the next :func:`parallel_map` makes a new pool.  Runs at exit."""
    pool = _pool.take()
    if pool is not None:
        pool.shutdown()


atexit.register(shutdown_io_pool)


def parallel_map(fn: Callable[[T], R], items: Sequence[T], workers: int = DEFAULT_IO_THREADS) -> list[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` threads; the first exception stops the rest (items not
    yet started are not run) and is raised -- the lowest item's, once the running ones ended.

    The calling thread works through the items too (in a context of its own, as a pool thread would), with
    ``workers - 1`` helpers from the shared pool; helpers that had not started when the items ran out are
    cancelled, never waited for, so a nested call (``fn`` calling this again) or many callers at once cannot
    wait on each other for pool threads.  Once the pool was shut down (exit), the caller does every item.
    """
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    results: list[R | None] = [None] * len(items)
    errors: dict[int, BaseException] = {}
    taken = [0]
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                i = taken[0]
                if i >= len(items) or errors:
                    return
                taken[0] = i + 1
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # noqa: BLE001 - raised by the caller below
                with lock:
                    errors[i] = exc
                return

    pool = _pool.get()
    helpers = [helper for helper in (pool.submit(run) for _ in range(min(workers, len(items)) - 1)) if helper]
    contextvars.Context().run(run)
    for helper in helpers:
        helper.cancel_or_wait()
    if errors:
        raise errors[min(errors)]
    return results  # type: ignore[return-value]


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
