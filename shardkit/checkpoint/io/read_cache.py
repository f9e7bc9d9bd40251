"""Reads of an object store served from large aligned blocks, each fetched once: the read half of a migration.

An offline conversion asks its source for one output chunk at a time, and a
native reader turns each box into ranged reads of the stored chunks it
overlaps -- many reads of a few hundred KiB to a few MiB, each a request of
its own (a smoke reshard of 4.4 MB made 138 GETs).  On an object store every
request costs a round trip, so the conversion ran at a fraction of a copy's
speed.  :class:`BlockCache` answers those reads from blocks of ``block`` bytes
(8 MiB: aligned ``[k·block, (k+1)·block)`` spans of a file, the last one
shorter), each fetched with one ranged GET and shared by every reader thread
(the output ranks of a reshard read neighbouring row ranges of the same
tensors), and fetches the blocks after the one just used ahead of need on
``threads`` threads, so requests stay in flight while the writers work.

Memory: blocks held, fetched or in flight never exceed ``budget`` by more than
one block per reading thread: read-ahead stops at the budget, and room is made
by dropping first the blocks every byte of which has been served (a conversion
reads each source byte once, give or take the checksum blocks two neighbouring
boxes share, which is why a spent block stays while room allows), then the
least recently used ones; a byte read after its block went is fetched again,
which is slower, never wrong.

A head start (``head_start.py``) may fill a cache before the conversion exists
(:meth:`BlockCache.fetch_first`: the blocks it guesses come first, fetched
while the command is still importing its engine), and the conversion then takes
it over (:meth:`BlockCache.adopt`: its own fetch, with its retries, from then
on).  A guessed block no read has used yet goes before any other when room is
needed, so a wrong guess costs requests, never the memory bound or the
read-ahead of the blocks that are needed.

Nothing here checks bytes: the reader that asked verifies every span against
its crc32c as before, so a block that a cache served is checked exactly like
one a request fetched.  A read that asks past the end of the file gets the
bytes there are (the caller's check for a truncated file sees a short answer).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

__all__ = ["BlockCache", "BLOCK_BYTES"]

log = logging.getLogger(__name__)

BLOCK_BYTES = 8 << 20  # the request size of a plain parallel copy: S3's multipart guidance


class _Closed(Exception):
    """A block that read-ahead will never fetch: the cache was closed."""


@dataclass(eq=False)
class _Block:
    length: int
    ahead: bool  # fetched by read-ahead (a failure there is retried by the read that needs it)
    done: threading.Event = field(default_factory=threading.Event)
    data: bytes = b""
    error: BaseException | None = None
    served: list[tuple[int, int]] = field(default_factory=list)  # byte ranges handed out, merged
    spent: bool = False  # every byte served: the first to go when room is needed
    guess: bool = False  # fetched by a head start and not used yet: dropped before any other unspent block
    future: Future | None = None


class BlockCache:
    """``read(path, start, end)`` from blocks of ``block`` bytes fetched by ``fetch(path, start, end)``.

    ``size_of(path)`` is asked once per file (reads are clipped to it and
    read-ahead stops there).  Thread-safe; :meth:`close` stops read-ahead."""

    def __init__(self, fetch: Callable[[str, int, int], bytes], size_of: Callable[[str], int], *,
                 budget: int, block: int = BLOCK_BYTES, threads: int = 4, ahead: int | None = None) -> None:
        self.block = max(1, min(block, budget // 2 or 1))
        self.budget = budget
        self.threads = max(1, threads)
        self.ahead = self.threads if ahead is None else ahead
        self._fetch = fetch
        self._size_of = size_of
        self._cond = threading.Condition()
        self._blocks: OrderedDict[tuple[str, int], _Block] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._size_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.held = 0
        self.peak = 0  # the most bytes held at once: what the memory bound promises
        self.fetches = 0

    # -- reading -----------------------------------------------------------------------------------------
    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (fewer at the end of the file)."""
        end = min(end, self._size(path))
        if start >= end:
            return b""
        first, last = start // self.block, (end - 1) // self.block
        out = []
        for k in range(first, last + 1):
            blk = self._get(path, k)
            a, b = max(start, k * self.block) - k * self.block, min(end, (k + 1) * self.block) - k * self.block
            out.append(blk.data[a:b])
            self._served(path, k, blk, a, b)
        self._read_ahead(path, last)
        return out[0] if len(out) == 1 else b"".join(out)

    def size(self, path: str) -> int:
        """The size of ``path``, asked of the store once while this cache serves it (the readers' checks of
        a file's length ask here too, instead of a request each)."""
        return self._size(path)

    def know_sizes(self, sizes: dict[str, int]) -> None:
        """Sizes already listed (a head start's listing): not asked again."""
        with self._size_lock:
            self._sizes.update(sizes)

    def _size(self, path: str) -> int:
        """The size of ``path``, asked once however many threads start on it together."""
        size = self._sizes.get(path)
        if size is None:
            with self._size_lock:
                size = self._sizes.get(path)
                if size is None:
                    size = self._sizes[path] = int(self._size_of(path))
        return size

    def _get(self, path: str, k: int) -> _Block:
        """Block ``k`` of ``path``, fetched on this thread unless it is held or on its way."""
        key = (path, k)
        while True:
            with self._cond:
                blk = self._blocks.get(key)
                mine = blk is None
                if mine:
                    blk = self._claim(key, ahead=False)
                else:
                    self._blocks.move_to_end(key)
                    blk.guess = False
            if mine:
                self._load(key, blk)
            blk.done.wait()
            if blk.error is None:
                return blk
            if not blk.ahead:
                raise blk.error
            # read-ahead failed or was cancelled: fetch it here, where a failure is reported

    def _claim(self, key: tuple[str, int], ahead: bool, guess: bool = False) -> _Block:
        """A new block for ``key``, room made for it (under the lock)."""
        length = min(self.block, self._sizes[key[0]] - key[1] * self.block)
        self._make_room(length)
        blk = self._blocks[key] = _Block(length, ahead, guess=guess)
        self.held += length
        self.peak = max(self.peak, self.held)
        return blk

    def _make_room(self, length: int, spent_only: bool = False) -> None:
        """Drop spent blocks, then guessed ones no read used, then (unless ``spent_only``) the least
        recently used fetched ones, until ``length`` more bytes fit the budget (spent blocks are kept at
        the front of the order)."""
        for droppable in (lambda b: b.spent, lambda b: b.guess and b.done.is_set(),
                          lambda b: not spent_only and b.done.is_set()):
            for key, blk in list(self._blocks.items()):
                if self.held + length <= self.budget:
                    return
                if droppable(blk):
                    self._drop(key, blk)

    def _drop(self, key: tuple[str, int], blk: _Block) -> None:
        if self._blocks.get(key) is blk:
            del self._blocks[key]
            self.held -= blk.length

    def _load(self, key: tuple[str, int], blk: _Block) -> None:
        path, k = key
        try:
            blk.data = self._fetch(path, k * self.block, k * self.block + blk.length)
            with self._cond:
                self.fetches += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the readers waiting for this block
            blk.error = exc
            with self._cond:
                self._drop(key, blk)
            if blk.ahead:
                log.debug("read-ahead of %s bytes %d+ failed (%s); the read that needs them fetches them again",
                          path, k * self.block, exc)
        finally:
            blk.done.set()

    def _served(self, path: str, k: int, blk: _Block, a: int, b: int) -> None:
        """Note bytes ``[a, b)`` of the block as served; once all of them were, nothing needs it again."""
        with self._cond:
            blk.guess = False
            blk.served = _merged(blk.served, a, b)
            if blk.served == [(0, blk.length)] and not blk.spent and self._blocks.get((path, k)) is blk:
                blk.spent = True
                self._blocks.move_to_end((path, k), last=False)

    def _read_ahead(self, path: str, k: int) -> None:
        """Start fetching the ``ahead`` blocks after block ``k`` that are neither held nor on their way,
        while they fit the budget."""
        if self.ahead <= 0:
            return
        size = self._sizes[path]
        with self._cond:
            if self._closed:
                return
            for j in range(k + 1, k + 1 + self.ahead):
                key = (path, j)
                if j * self.block >= size:
                    return
                if key in self._blocks:
                    continue
                length = min(self.block, size - j * self.block)
                self._make_room(length, spent_only=True)
                if self.held + length > self.budget:
                    return
                self._start(key, length)

    def _start(self, key: tuple[str, int], length: int, guess: bool = False) -> None:
        """Claim block ``key`` and fetch it on the read-ahead threads (under the lock)."""
        blk = self._claim(key, ahead=True, guess=guess)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardkit-readahead")
        blk.future = self._pool.submit(self._load, key, blk)

    def fetch_first(self, blocks: Iterable[tuple[str, int]]) -> int:
        """Start fetching ``blocks`` ((path, block number), sizes known) on the read-ahead threads before
        any read asks for them, in that order, while they fit the budget; how many were started.  Until
        a read uses one, such a block is the first to go when room is needed."""
        started = 0
        with self._cond:
            for path, k in blocks:
                size = self._sizes[path]
                length = min(self.block, size - k * self.block)
                if self._closed or length <= 0 or (path, k) in self._blocks:
                    continue
                if self.held + length > self.budget:
                    break
                self._start((path, k), length, guess=True)
                started += 1
        return started

    def adopt(self, fetch: Callable[[str, int, int], bytes], size_of: Callable[[str], int], *, budget: int,
              threads: int, block: int = BLOCK_BYTES) -> bool:
        """Carry on as the cache of the conversion that takes this one over: its ``fetch`` (with its
        retries) and ``size_of`` from now on, its ``budget`` and ``threads`` for what follows (the blocks
        in flight finish on the threads they started on).  False, changing nothing, when its block size
        would differ (the conversion then starts a cache of its own)."""
        if max(1, min(block, budget // 2 or 1)) != self.block:
            return False
        with self._cond:
            if self._closed:
                return False
            self._fetch, self._size_of = fetch, size_of
            self.budget, self.threads, self.ahead = budget, max(1, threads), max(1, threads)
            self._make_room(0, spent_only=True)  # a smaller budget: guessed blocks beyond it go first
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # the blocks already on their way still arrive
        return True

    def close(self) -> None:
        """Stop read-ahead (blocks not started are released to any reader waiting for them) and let go of
        every block."""
        with self._cond:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        with self._cond:
            for key, blk in list(self._blocks.items()):
                if blk.future is not None and blk.future.cancelled():
                    blk.error = _Closed(key[0])
                    blk.done.set()
            self._blocks.clear()
            self.held = 0


def _merged(ranges: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """Sorted disjoint ``ranges`` with ``[a, b)`` added (touching ranges joined)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if hi < a or lo > b:
            out.append((lo, hi))
        else:
            a, b = min(a, lo), max(b, hi)
    out.append((a, b))
    return sorted(out)
