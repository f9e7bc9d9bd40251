"""A conversion's first source blocks, fetched while the ``shardkit`` command is still starting.

A ``shardkit reshard``/``convert`` process spends its first second or more
importing its engine (torch alone: 1.2 s on our VMs) before it asks the source
for anything, while a plain copy has its first bytes by then.  So the command,
before it imports the engine, calls :func:`begin`: this opens the source's
filesystem exactly as :class:`~shardkit.checkpoint.io.storage.Storage` will
(same options, same timeouts), and on a thread lists the source and starts
fetching its first blocks into a :class:`~shardkit.checkpoint.io.read_cache.BlockCache`
-- the files in name order (a checkpoint's data files before its manifest,
a model's ``-00001-of-`` first), from byte 0, as many blocks as the
conversion's cache budget holds.  The engine's read-through cache, once it
exists, takes this cache over (:func:`take`, from ``remote.py``) when it reads
the same store with the same options; the blocks fetched or in flight are
served from then on as if its own read-ahead had fetched them.

What it guarantees: nothing but reads of the source, bounded by the same
memory budget the conversion's cache has; every byte served is checked by the
reader against its crc32c as any other (a source rewritten meanwhile fails its
check, never passes); a block nothing uses is the first dropped; any failure
here is only logged (DEBUG) and leaves the engine to make its own requests and
report its own errors.  Not started for a local source (the kernel's page cache
and readahead do this job) nor under torchrun (each process reads its own share).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

from shardkit.checkpoint.io.clouds import CloudProfile
from shardkit.checkpoint.io.read_cache import BLOCK_BYTES, BlockCache

__all__ = ["begin", "take", "drop", "first_blocks"]

log = logging.getLogger(__name__)

DATA_FILE_BYTES = 1 << 20  # files this large are what a conversion reads in bulk; smaller ones are metadata
_LOCAL = ("file", "local", "memory")


class _HeadStart:
    def __init__(self, fs: Any, root: str, cache: BlockCache) -> None:
        self.fs = fs
        self.root = root
        self.cache = cache
        self.listed = threading.Event()


_current: _HeadStart | None = None
_lock = threading.Lock()


def begin(url: str, storage_options: Mapping[str, Any] | None, *, budget: int, threads: int) -> bool:
    """Open ``url``'s filesystem here and start fetching its first blocks on a thread; whether it started.

    ``budget``: the conversion's block-cache budget (bytes); ``threads``: its read-ahead threads.  Never
    raises: a source this cannot open is the engine's to report."""
    global _current
    try:
        import fsspec

        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol in _LOCAL:
            return False
        cloud = CloudProfile.for_url(protocol, storage_options or {})
        fs, root = fsspec.core.url_to_fs(url, **cloud.options)
        cloud.tune(fs)
        if hasattr(fs, "call_s3"):  # s3fs: its client made here, before the engine's imports (no import races)
            fs.connect()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.debug("no head start for %s: %s", url, exc)
        return False
    cache = BlockCache(lambda path, start, end: fs.cat_file(path, start=start, end=end),
                       lambda path: int(fs.size(path)), budget=budget, threads=threads)
    head = _HeadStart(fs, root.rstrip("/") or root, cache)
    with _lock:
        if _current is not None:
            _current.cache.close()
        _current = head
    threading.Thread(target=_start, args=(head,), name="shardkit-head-start", daemon=True).start()
    return True


def _start(head: _HeadStart) -> None:
    try:
        found = head.fs.find(head.root, detail=True)
        sizes = {str(path): int(info.get("size") or 0) for path, info in found.items()
                 if info.get("type", "file") == "file"}
        head.cache.know_sizes(sizes)
        started = head.cache.fetch_first(first_blocks(sizes, head.cache.block, head.cache.budget))
        log.debug("head start of %s: %d block(s) of %d files on their way", head.root, started, len(sizes))
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        log.debug("head start of %s stopped: %s", head.root, exc)
    finally:
        head.listed.set()


def first_blocks(sizes: Mapping[str, int], block: int = BLOCK_BYTES,
                 budget: int | None = None) -> list[tuple[str, int]]:
    """(path, block number) of the blocks a conversion is likely to read first, in order: the files of at
    least :data:`DATA_FILE_BYTES` in name order, each from byte 0, as many as ``budget`` bytes hold."""
    out: list[tuple[str, int]] = []
    room = budget if budget is not None else sum(sizes.values())
    for path in sorted(p for p, n in sizes.items() if n >= DATA_FILE_BYTES):
        for k in range(-(-sizes[path] // block)):
            length = min(block, sizes[path] - k * block)
            if length > room:
                return out
            out.append((path, k))
            room -= length
    return out


def take(fs: Any) -> BlockCache | None:
    """The head start's cache, once, for an engine that reads through ``fs``: only when ``fs`` is the
    same kind of filesystem with the same options (same store, same credentials); else ``None`` (a
    head start for another store is closed).  Waits for its listing (a request begun before this one)."""
    global _current
    with _lock:
        head, _current = _current, None
    if head is None:
        return None
    same = type(fs) is type(head.fs) and getattr(fs, "storage_options", None) == head.fs.storage_options
    if not same:
        head.cache.close()
        return None
    head.listed.wait(timeout=max(1.0, _timeout(fs)))
    return head.cache


def drop() -> None:
    """Close a head start nothing took (the command ended, or read elsewhere)."""
    global _current
    with _lock:
        head, _current = _current, None
    if head is not None:
        head.cache.close()


def _timeout(fs: Any) -> float:
    """The client's read timeout where it says one (the listing cannot take longer), else 8 s."""
    config = (getattr(fs, "config_kwargs", None) or {}) if fs is not None else {}
    return float(config.get("read_timeout") or 8.0)
