"""The block cache under a rerun's plan of reads: its blocks are the needed ranges, joined where they touch
and cut into pieces of at least a block, each fetched once; a byte outside them is fetched as asked and not
held; a plan given once blocks are held changes nothing (a head start's guesses are read as they are)."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

from shardkit.checkpoint.io.read_cache import BlockCache, needed_pieces

BLOCK = 1 << 16


class _Store:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.fetches: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def fetch(self, path: str, start: int, end: int) -> bytes:
        with self.lock:
            self.fetches.append((path, start, end))
        return self.files[path][start:end]

    def size(self, path: str) -> int:
        return len(self.files[path])


def test_needed_ranges_are_joined_where_they_touch_and_cut_into_pieces_of_at_least_a_block():
    ranges = [(100, 200), (200, 300), (250, 260), (5000, 5000 + 3 * BLOCK + 7), (400, 500)]
    pieces = needed_pieces(ranges, BLOCK)
    assert pieces[:2] == [(100, 300), (400, 500)]  # touching and overlapping ranges joined; a gap kept
    long = pieces[2:]
    assert len(long) == 3 and long[0][0] == 5000 and long[-1][1] == 5000 + 3 * BLOCK + 7
    assert all(b - a >= BLOCK for a, b in long) and all(x[1] == y[0] for x, y in zip(long, long[1:]))
    assert needed_pieces([(0, 2 * BLOCK - 1)], BLOCK) == [(0, 2 * BLOCK - 1)]  # under two blocks: one piece


def test_a_planned_cache_fetches_each_needed_piece_once_and_nothing_else():
    data = random.Random(0).randbytes(40 * BLOCK)
    store = _Store({"f": data})
    cache = BlockCache(store.fetch, store.size, budget=16 * BLOCK, block=BLOCK, threads=3)
    needed = [(0, 100), (2 * BLOCK, 9 * BLOCK + 5), (9 * BLOCK + 5, 12 * BLOCK), (20 * BLOCK, 20 * BLOCK + 300)]
    assert cache.plan({"f": needed})
    reads = [(a, min(hi, a + 3000)) for lo, hi in needed for a in range(lo, hi, 3000)]

    def reader(n: int) -> bool:
        return all(cache.read("f", a, b) == data[a:b] for a, b in reads[n::3])
    with ThreadPoolExecutor(3) as pool:
        assert all(pool.map(reader, range(3)))
    assert cache.read("f", 30 * BLOCK, 30 * BLOCK + 10) == data[30 * BLOCK:30 * BLOCK + 10]  # outside: as asked
    cache.close()
    fetched = sorted((a, b) for _, a, b in store.fetches)
    assert fetched == needed_pieces(needed, BLOCK) + [(30 * BLOCK, 30 * BLOCK + 10)]
    assert cache.peak <= 16 * BLOCK + 3 * 2 * BLOCK


def test_a_plan_changes_nothing_once_the_cache_holds_blocks():
    data = bytes(range(256)) * (8 * BLOCK // 256)
    store = _Store({"f": data})
    cache = BlockCache(store.fetch, store.size, budget=8 * BLOCK, block=BLOCK, threads=1, ahead=0)
    assert cache.read("f", 10, 20) == data[10:20]
    assert not cache.plan({"f": [(3 * BLOCK, 5 * BLOCK)]})
    assert cache.read("f", 3 * BLOCK, 3 * BLOCK + 1) == data[3 * BLOCK:3 * BLOCK + 1]
    cache.close()
    assert sorted((a, b) for _, a, b in store.fetches) == [(0, BLOCK), (3 * BLOCK, 4 * BLOCK)]  # aligned blocks
