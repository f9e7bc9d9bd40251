"""The block cache of a migration's source reads: aligned blocks fetched once each, bytes exactly the file's,
its memory within the budget (plus one block per reading thread), read-ahead that stops at the budget,
and a failed read-ahead that the read needing the block repeats and reports."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardkit.checkpoint.io.read_cache import BlockCache

BLOCK = 1 << 16


class Store:
    """Files in memory, every ranged fetch counted, at most ``inflight`` seen at once."""

    def __init__(self, files: dict[str, bytes], fail: set[tuple[str, int]] = frozenset()) -> None:
        self.files = files
        self.fetches: list[tuple[str, int, int]] = []
        self.fail = set(fail)
        self.lock = threading.Lock()

    def fetch(self, path: str, start: int, end: int) -> bytes:
        with self.lock:
            self.fetches.append((path, start, end))
            if (path, start) in self.fail:
                self.fail.discard((path, start))
                raise OSError(f"connection reset reading {path} at {start}")
        return self.files[path][start:end]

    def size(self, path: str) -> int:
        return len(self.files[path])


def _files() -> dict[str, bytes]:
    rng = random.Random(0)
    return {f"f{i}": rng.randbytes(n) for i, n in enumerate((10 * BLOCK + 123, 3 * BLOCK, 500))}


def test_interleaved_readers_get_the_files_bytes_with_each_block_fetched_once():
    files = _files()
    store = Store(files)
    cache = BlockCache(store.fetch, store.size, budget=16 * BLOCK, block=BLOCK, threads=3)
    # three readers, each a third of every file in 7 KiB reads, interleaved like the ranks of a reshard
    reads = []
    for path, data in files.items():
        third = -(-len(data) // 3)
        for r in range(3):
            lo, hi = r * third, min(len(data), (r + 1) * third)
            reads.append([(path, a, min(hi, a + 7000)) for a in range(lo, hi, 7000)])

    def reader(n: int) -> list[bool]:
        return [cache.read(p, a, b) == files[p][a:b] for rs in reads[n::3] for p, a, b in rs]
    with ThreadPoolExecutor(3) as pool:
        assert all(all(ok) for ok in pool.map(reader, range(3)))
    cache.close()
    blocks = sorted({(p, a) for p, a, _ in store.fetches})
    assert len(store.fetches) == len(blocks) == sum(-(-len(d) // BLOCK) for d in files.values())
    assert all(b - a == BLOCK or b == len(files[p]) for p, a, b in store.fetches)
    assert cache.peak <= 16 * BLOCK + 3 * BLOCK


def test_memory_stays_within_the_budget_when_the_readers_need_more_than_it():
    files = {"big": random.Random(1).randbytes(40 * BLOCK)}
    store = Store(files)
    cache = BlockCache(store.fetch, store.size, budget=4 * BLOCK, block=BLOCK, threads=4)
    rng = random.Random(2)
    spans = [(a, a + rng.randrange(1, 3 * BLOCK)) for a in (rng.randrange(0, 40 * BLOCK) for _ in range(300))]

    def reader(n: int) -> bool:
        return all(cache.read("big", a, b) == files["big"][a:b] for a, b in spans[n::4])
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(reader, range(4)))
    cache.close()
    assert cache.peak <= 4 * BLOCK + 4 * 3 * BLOCK  # the budget, plus the blocks four reads may span


def test_a_read_past_the_end_gets_the_bytes_there_are():
    store = Store({"f": b"x" * (BLOCK + 10)})
    cache = BlockCache(store.fetch, store.size, budget=8 * BLOCK, block=BLOCK)
    assert cache.read("f", BLOCK, BLOCK + 100) == b"x" * 10  # the caller sees a short answer: truncated
    assert cache.read("f", BLOCK + 50, BLOCK + 100) == b""
    cache.close()


def test_a_failed_read_ahead_is_fetched_again_by_the_read_that_needs_it_and_a_failed_read_raises():
    files = {"f": bytes(range(256)) * (4 * BLOCK // 256)}
    store = Store(files, fail={("f", BLOCK)})  # read-ahead of block 1 fails once
    cache = BlockCache(store.fetch, store.size, budget=8 * BLOCK, block=BLOCK, threads=1, ahead=1)
    assert cache.read("f", 0, 10) == files["f"][:10]
    assert cache.read("f", BLOCK, BLOCK + 10) == files["f"][BLOCK:BLOCK + 10]
    assert [a for _, a, _ in store.fetches].count(BLOCK) == 2
    store.fail.add(("f", 3 * BLOCK))
    cache.ahead = 0
    with pytest.raises(OSError, match="connection reset"):
        cache.read("f", 3 * BLOCK, 3 * BLOCK + 1)
    cache.close()


def test_blocks_fetched_first_are_served_without_a_second_fetch_after_the_cache_is_taken_over():
    files = _files()
    head = Store(files)
    cache = BlockCache(head.fetch, head.size, budget=4 * BLOCK, block=BLOCK, threads=2)
    cache.know_sizes({p: len(b) for p, b in files.items()})
    assert cache.fetch_first([("f0", k) for k in range(10)]) == 4  # as many as the budget holds
    engine = Store(files)
    assert cache.adopt(engine.fetch, engine.size, budget=4 * BLOCK, threads=2, block=2 * BLOCK) is False
    assert cache.adopt(engine.fetch, engine.size, budget=4 * BLOCK, threads=2, block=BLOCK) is True
    assert cache.read("f0", 0, 4 * BLOCK) == files["f0"][:4 * BLOCK]
    # blocks 0-3 were fetched once each, by the fetch in place when their turn came (a block still queued
    # when the cache was taken over is fetched by the engine's, with its retries)
    first = sorted(s for _, s, _ in head.fetches + engine.fetches if s < 4 * BLOCK)
    assert first == [k * BLOCK for k in range(4)] and head.fetches
    cache.read("f0", 4 * BLOCK, 5 * BLOCK)  # the engine's own fetch (and read-ahead) from then on
    assert ("f0", 4 * BLOCK, 5 * BLOCK) in engine.fetches
    assert all(s < 4 * BLOCK for _, s, _ in head.fetches)
    cache.close()


def test_a_wrong_guess_gives_way_to_the_blocks_read_and_to_their_read_ahead():
    files = _files()
    store = Store(files)
    cache = BlockCache(store.fetch, store.size, budget=4 * BLOCK, block=BLOCK, threads=2, ahead=2)
    cache.know_sizes({p: len(b) for p, b in files.items()})
    assert cache.fetch_first([("f0", k) for k in range(4)]) == 4  # the budget full of guesses
    for _ in range(200):
        with cache._cond:
            if all(b.done.is_set() for b in cache._blocks.values()):
                break
        threading.Event().wait(0.01)
    assert cache.read("f1", 0, 10) == files["f1"][:10]
    for _ in range(200):  # the read-ahead of f1's blocks 1 and 2 took the place of unused guesses
        if {("f1", BLOCK), ("f1", 2 * BLOCK)} <= {(p, s) for p, s, _ in store.fetches}:
            break
        threading.Event().wait(0.01)
    assert {("f1", BLOCK), ("f1", 2 * BLOCK)} <= {(p, s) for p, s, _ in store.fetches}
    assert cache.peak <= cache.budget
    cache.close()
