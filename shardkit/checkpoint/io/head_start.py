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
conversion's cache budget holds, unless the command is the rerun of an
interrupted one: when the caller names the output's resume journal
(``journal``) and it lists a record, the blocks worth fetching are the ones the
outputs not yet finished need, which only the conversion knows once it has
checked the journal, so none is guessed (the journal is listed beside the
source, so a first run waits for neither).  The engine's read-through cache, once it
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

__all__ = ["begin", "take", "drop", "first_blocks", "guessed"]

log = logging.getLogger(__name__)

DATA_FILE_BYTES = 1 << 20  # files this large are what a conversion reads in bulk; smaller ones are metadata
_LOCAL = ("file", "local", "memory")


class _HeadStart:
    def __init__(self, fs: Any, root: str, cache: BlockCache) -> None:
        self.fs = fs
        self.root = root
        self.cache = cache
        self.listed = threading.Event()
        self.guessed = 0  # blocks fetched before the conversion asked for any


def _open(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """``url``'s filesystem and path, opened as :class:`~shardkit.checkpoint.io.storage.Storage` opens it."""
    import fsspec

    protocol = url.split("://", 1)[0] if "://" in url else "file"
    cloud = CloudProfile.for_url(protocol, storage_options or {})
    fs, root = fsspec.core.url_to_fs(url, **cloud.options)
    cloud.tune(fs)
    return fs, root


_current: _HeadStart | None = None
_lock = threading.Lock()


def begin(url: str, storage_options: Mapping[str, Any] | None, *, budget: int, threads: int,
          journal: str | None = None, journal_options: Mapping[str, Any] | None = None) -> bool:
    """Open ``url``'s filesystem here and start fetching its first blocks on a thread; whether it started.

    ``budget``: the conversion's block-cache budget (bytes); ``threads``: its read-ahead threads;
    ``journal``: the URL of the output's resume journal (opened with ``journal_options``), listed beside the
    source: when it holds a record the run resumes, and no block is guessed.  Never raises: a source this
    cannot open is the engine's to report."""
    global _current
    try:
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol in _LOCAL:
            return False
        fs, root = _open(url, storage_options)
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
    same = journal is not None and dict(journal_options or {}) == dict(storage_options or {}) \
        and journal.split("://", 1)[0] == url.split("://", 1)[0]
    resumes = _Journal(journal, journal_options, fs if same else None) if journal is not None else None
    threading.Thread(target=_start, args=(head, resumes), name="shardkit-head-start", daemon=True).start()
    return True


class _Journal:
    """Whether the output's resume journal holds a record, asked on a thread of its own (beside the source's
    listing); a journal that cannot be listed counts as none (the run then starts as a first run does)."""

    def __init__(self, url: str, options: Mapping[str, Any] | None, fs: Any) -> None:
        self.url, self.options, self.fs = url, options, fs
        self.holds = False
        self.thread = threading.Thread(target=self._list, name="shardkit-head-start-journal", daemon=True)
        self.thread.start()

    def _list(self) -> None:
        import fsspec

        try:
            if self.fs is not None:
                fs, path = self.fs, fsspec.core.strip_protocol(self.url)
            else:
                fs, path = _open(self.url, self.options)
            if hasattr(fs, "call_s3"):  # s3fs: one request (its ls of a missing folder asks its parent too)
                bucket, key, _ = fs.split_path(path)
                found = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{key.rstrip('/')}/", MaxKeys=1)
                self.holds = bool(found.get("KeyCount") or found.get("Contents"))
            else:
                self.holds = bool(fs.ls(path, detail=False))
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            log.debug("head start: could not list %s (%s)", self.url, exc)

    def resumes(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return self.holds


def _start(head: _HeadStart, journal: _Journal | None = None) -> None:
    try:
        found = head.fs.find(head.root, detail=True)
        sizes = {str(path): int(info.get("size") or 0) for path, info in found.items()
                 if info.get("type", "file") == "file"}
        head.cache.know_sizes(sizes)
        if journal is not None and journal.resumes(_timeout(head.fs)):
            log.debug("head start of %s: a rerun (%s holds records): no block guessed", head.root, journal.url)
            return
        head.guessed = head.cache.fetch_first(first_blocks(sizes, head.cache.block, head.cache.budget))
        log.debug("head start of %s: %d block(s) of %d files on their way", head.root, head.guessed, len(sizes))
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


def guessed() -> bool:
    """Whether the head start nothing took yet fetched blocks of its own guess (waits for its listing, as
    :func:`take` does): none when DST's journal holds a record, since a rerun plans its reads once it knows
    its outputs left, and a guessed block would be one of a finished output's."""
    with _lock:
        head = _current
    if head is None:
        return False
    head.listed.wait(timeout=max(1.0, _timeout(head.fs)))
    return head.guessed > 0


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
