"""A conversion's reads of an object store through one block cache: :func:`read_through`.

Every box a conversion reads -- the engine's :class:`~shardkit.checkpoint.offline.fetch.Fetcher` and the
byte passthrough alike -- is served from 8 MiB blocks, each fetched once with one ranged GET and read ahead
of need (the one a head start began, when there is one: :mod:`shardkit.checkpoint.io.head_start`); a
rerun of the byte passthrough has it fetch only the bytes of the outputs left (:func:`plan_reads`).  Kept
apart from the engine so that a conversion that never imports torch reads the same way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping

from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.offline.options import cache_budget

__all__ = ["read_through", "plan_reads"]


@contextlib.contextmanager
def read_through(source: Any, budget: int, threads: int) -> Iterator[int]:
    """While open, ``source``'s ranged reads of an object store come from a block cache of
    :func:`cache_budget` bytes read ahead on ``threads`` threads; yields the bytes set aside for it
    (0 on a local disk, where the kernel's page cache and readahead do this job)."""
    storage = getattr(source, "storage", None)
    files = getattr(storage, "files", None)
    if not isinstance(storage, Storage) or storage.is_local or not callable(getattr(files, "read_through", None)):
        yield 0
        return
    cache = files.read_through(cache_budget(budget), threads)
    try:
        yield cache.budget
    finally:
        files.cache = None
        cache.close()


def plan_reads(storage: Storage, needed: Mapping[str, Iterable[tuple[int, int]]]) -> bool:
    """Have the block cache that :func:`read_through` opened on ``storage`` fetch only ``needed`` (file name ->
    byte ranges) from now on, in runs of at least a block where the needed bytes run that long
    (:meth:`~shardkit.checkpoint.io.read_cache.BlockCache.plan`); whether it does (not on a local disk,
    nor once the cache holds blocks: a head start's, read as they are)."""
    cache = getattr(storage.files, "cache", None)
    if cache is None:
        return False
    return bool(cache.plan({storage.read_path(name): ranges for name, ranges in needed.items()}))
