"""Reads of an object store served from large blocks, each fetched once: the read half of a migration.

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
one block per reading thread (under a plan, below, one piece: under two blocks):
read-ahead stops at the budget, and room is made by dropping first the blocks
every byte of which has been served (a conversion reads each source byte once,
give or take the checksum blocks two neighbouring boxes share, which is why a
spent block stays while room allows), then the least recently used ones; a
byte read after its block went is fetched again, which is slower, never wrong.

A rerun of an interrupted conversion needs only the source bytes of the outputs it
still writes, which the aligned blocks mix with those of the outputs already
finished.  Given those bytes (:meth:`BlockCache.plan`, before any block is
held), the cache's blocks become the needed runs instead: the ranges merged
where they overlap or touch, each run cut into pieces of at least ``block``
bytes (a shorter run is one piece), read ahead in the same way; a byte outside
them (a data file's header) is fetched as asked and not held.  So the requests
are as large as the needed bytes allow and no byte is fetched that no
remaining output needs.

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

import bisect
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

__all__ = ["BlockCache", "BLOCK_BYTES", "needed_pieces", "merge_ranges"]

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
        self._blocks: OrderedDict[tuple[str, int], _Block] = OrderedDict()  # keyed by (path, first byte)
        self._sizes: dict[str, int] = {}
        self._size_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._plan: dict[str, list[tuple[int, int]]] | None = None  # path -> its blocks, when planned
        self.held = 0
        self.peak = 0  # the most bytes held at once: what the memory bound promises
        self.fetches = 0

    # -- reading -----------------------------------------------------------------------------------------
    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (fewer at the end of the file)."""
        end = min(end, self._size(path))
        if start >= end:
            return b""
        out, pos, last = [], start, None
        while pos < end:
            span = self._span(path, pos)
            if span is None:  # outside a plan's runs: fetched as asked, never held
                stop = min(end, self._next_start(path, pos))
                out.append(self._fetch(path, pos, stop))
                with self._cond:
                    self.fetches += 1
                pos = stop
                continue
            first, past = span
            blk = self._get(path, first, past - first)
            a, b = pos - first, min(end, past) - first
            out.append(blk.data[a:b])
            self._served(path, first, blk, a, b)
            pos, last = min(end, past), first
        if last is not None:
            self._read_ahead(path, last)
        return out[0] if len(out) == 1 else b"".join(out)

    def plan(self, needed: Mapping[str, Iterable[tuple[int, int]]]) -> bool:
        """From now on the blocks are the runs of the byte ranges ``needed`` (path -> ``(start, end)``
        ranges; a file not named has none): :func:`needed_pieces` of each file, read ahead in file order;
        bytes outside them are fetched as asked and not held.  Only while no block is held or on its way:
        False, changing nothing, when one is (a head start's guesses, which are then read as they are)."""
        pieces = {path: needed_pieces(ranges, self.block) for path, ranges in needed.items()}
        with self._cond:
            if self._blocks or self._closed:
                return False
            self._plan = {path: runs for path, runs in pieces.items() if runs}
        return True

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

    def _span(self, path: str, pos: int) -> tuple[int, int] | None:
        """``[first, past)`` of the block that holds byte ``pos`` of ``path`` (size known): the aligned one,
        or under a plan the piece that holds it (``None`` when none does)."""
        if self._plan is None:
            first = pos // self.block * self.block
            return first, min(first + self.block, self._sizes[path])
        runs = self._plan.get(path, [])
        i = bisect.bisect_right(runs, (pos, float("inf"))) - 1
        return runs[i] if i >= 0 and pos < runs[i][1] else None

    def _next_start(self, path: str, pos: int) -> int:
        """Under a plan, the first byte after ``pos`` that a piece of ``path`` holds (the file's size when
        none does)."""
        runs = (self._plan or {}).get(path, [])
        i = bisect.bisect_right(runs, (pos, float("inf")))
        return runs[i][0] if i < len(runs) else self._sizes[path]

    def _after(self, path: str, first: int, count: int) -> list[tuple[int, int]]:
        """The ``count`` blocks of ``path`` after the one that starts at byte ``first`` (fewer at the end)."""
        if self._plan is None:
            size = self._sizes[path]
            return [(a, min(a + self.block, size)) for a in range(first + self.block, size, self.block)[:count]]
        runs = self._plan.get(path, [])
        i = bisect.bisect_right(runs, (first, float("inf")))
        return runs[i:i + count]

    def _get(self, path: str, first: int, length: int) -> _Block:
        """The block of ``length`` bytes at byte ``first`` of ``path``, fetched on this thread unless it is
        held or on its way."""
        key = (path, first)
        while True:
            with self._cond:
                blk = self._blocks.get(key)
                if blk is not None and blk.length != length:
                    # claimed under the layout before a plan by a read that had found its span first: not
                    # this block (it still arrives for that read); this one is fetched in its own length
                    self._drop(key, blk)
                    blk = None
                mine = blk is None
                if mine:
                    blk = self._claim(key, length, ahead=False)
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

    def _claim(self, key: tuple[str, int], length: int, ahead: bool, guess: bool = False) -> _Block:
        """A new block of ``length`` bytes for ``key``, room made for it (under the lock)."""
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
        path, first = key
        try:
            blk.data = self._fetch(path, first, first + blk.length)
            with self._cond:
                self.fetches += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the readers waiting for this block
            blk.error = exc
            with self._cond:
                self._drop(key, blk)
            if blk.ahead:
                log.debug("read-ahead of %s bytes %d+ failed (%s); the read that needs them fetches them again",
                          path, first, exc)
        finally:
            blk.done.set()

    def _served(self, path: str, first: int, blk: _Block, a: int, b: int) -> None:
        """Note bytes ``[a, b)`` of the block as served; once all of them were, nothing needs it again."""
        with self._cond:
            blk.guess = False
            blk.served = merge_ranges([*blk.served, (a, b)])
            if blk.served == [(0, blk.length)] and not blk.spent and self._blocks.get((path, first)) is blk:
                blk.spent = True
                self._blocks.move_to_end((path, first), last=False)

    def _read_ahead(self, path: str, first: int) -> None:
        """Start fetching the ``ahead`` blocks after the one at byte ``first`` that are neither held nor on
        their way, while they fit the budget."""
        if self.ahead <= 0:
            return
        with self._cond:
            if self._closed:
                return
            for a, b in self._after(path, first, self.ahead):
                if (path, a) in self._blocks:
                    continue
                self._make_room(b - a, spent_only=True)
                if self.held + b - a > self.budget:
                    return
                self._start((path, a), b - a)

    def _start(self, key: tuple[str, int], length: int, guess: bool = False) -> None:
        """Claim block ``key`` and fetch it on the read-ahead threads (under the lock)."""
        blk = self._claim(key, length, ahead=True, guess=guess)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardkit-readahead")
        blk.future = self._pool.submit(self._load, key, blk)

    def fetch_first(self, blocks: Iterable[tuple[str, int]]) -> int:
        """Start fetching ``blocks`` ((path, aligned block number), sizes known) on the read-ahead threads
        before any read asks for them, in that order, while they fit the budget; how many were started
        (none under a plan, whose blocks are not the aligned ones).  Until a read uses one, such a block is
        the first to go when room is needed."""
        started = 0
        with self._cond:
            for path, k in blocks:
                size = self._sizes[path]
                length = min(self.block, size - k * self.block)
                if self._closed or self._plan is not None or length <= 0 or (path, k * self.block) in self._blocks:
                    continue
                if self.held + length > self.budget:
                    break
                self._start((path, k * self.block), length, guess=True)
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


def needed_pieces(ranges: Iterable[tuple[int, int]], block: int) -> list[tuple[int, int]]:
    """The blocks of a plan (:meth:`BlockCache.plan`): ``ranges`` (``(start, end)``) merged where they
    overlap or touch, each run cut into as many pieces of at least ``block`` bytes as it holds (a shorter
    run is one piece) -- requests as large as the needed bytes allow, none of a byte not needed."""
    pieces = []
    for a, b in merge_ranges(r for r in ranges if r[1] > r[0]):
        count = max(1, (b - a) // block)
        step = (b - a) // count
        pieces.extend((a + i * step, b if i == count - 1 else a + (i + 1) * step) for i in range(count))
    return pieces


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` ranges, sorted, with overlapping or touching ones merged (the reads of a file's
    spans, a plan's runs, the bytes a block has served)."""
    runs: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if runs and a <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        else:
            runs.append((a, b))
    return runs
