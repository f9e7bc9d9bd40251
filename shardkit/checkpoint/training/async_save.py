"""Host staging for ``async_save``: one reused buffer, one background writer, one private group.

Why this shape:

* **Flat host memory.**  The state must be copied before training changes it,
  but the copy lands in a :class:`StagingPool` buffer that is kept and reused:
  the second and later saves of the same state allocate nothing (a fresh
  allocation costs a page fault per page; a reused one runs at memcpy speed).  The buffer grows only if the state grows.
* **One save in flight.**  A new save waits for the previous one, so the
  buffer is never overwritten while it is being uploaded.
* **Its own process group.**  The background thread gathers chunk records and
  commits through a gloo group created for it; gloo aborts when two threads run
  collectives on one group, and the training thread owns the default group.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from shardkit.checkpoint.formats.base import WriteChunk
from shardkit.checkpoint.formats.codec import Compression, as_bytes
from shardkit.checkpoint.formats.native.writer import DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_BYTES
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.tree import to_json_value
from shardkit.checkpoint.training.save import plan_save, save_options, write_and_commit

__all__ = ["async_save", "StagingPool", "BackgroundSaver", "background_saver"]

_ALIGN = 64


class StagingPool:
    """A grow-only host buffer that staged chunks are copied into."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def stage(self, groups: list[list[WriteChunk]]) -> list[list[WriteChunk]]:
        """Copy every chunk's data into the pool; return chunks that point at the copies."""
        sizes = [-(-c.nbytes // _ALIGN) * _ALIGN for g in groups for c in g]
        total = sum(sizes)
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None  # let the old one go before taking the new one
            self._buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        out: list[list[WriteChunk]] = []
        pos = 0
        with torch.no_grad():
            for group in groups:
                staged_group = []
                for chunk in group:
                    dst = self._buffer[pos:pos + chunk.nbytes]
                    src = chunk.materialize()
                    dst.copy_(as_bytes(src))
                    staged = dst.view(chunk.dtype).view(chunk.shape) if chunk.shape else dst.view(chunk.dtype)[0]
                    staged_group.append(replace(chunk, data=staged))
                    pos += -(-chunk.nbytes // _ALIGN) * _ALIGN
                out.append(staged_group)
        return out

    def release(self) -> None:
        self._buffer = None


class BackgroundSaver:
    """The per-process async save machinery (see the module docstring)."""

    def __init__(self) -> None:
        self.pool = StagingPool()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-async-save")
        self._pending: Future | None = None
        self._group: tuple[Any, Any] | None = None  # (default group it was made under, private group)
        self._lock = threading.Lock()

    def _private_group(self) -> Any:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        world = dist.group.WORLD
        if self._group is None or self._group[0] is not world:  # first use, or the default group was re-created
            self._group = (world, dist.new_group(backend="gloo"))  # collective: every rank's first async_save
        return self._group[1]

    def wait(self) -> None:
        """Block until the save in flight (if any) has finished; its errors stay in its future."""
        pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except BaseException:  # noqa: BLE001 - reported through that save's own future
                pass

    def submit(self, state_dict: dict[str, Any], storage: Storage, *, compression: Compression | None,
               meta: Mapping[str, Any] | None, overwrite: bool, fsync: bool, chunk_bytes: int, block_bytes: int,
               io_threads: int, process_group: Any = None, direct_io: bool = True,
               keys: tuple[Sequence[str] | None, Sequence[str] | None] = (None, None),
               column_strips: str = "cut") -> Future:
        with self._lock:
            self.wait()
            group = process_group if process_group is not None else self._private_group()
            dist = Dist(group)
            plan, error = None, None
            try:
                plan = plan_save(state_dict, dist, chunk_bytes=chunk_bytes, io_threads=io_threads, keys=keys,
                                 compression=compression)
                plan.groups = self.pool.stage(plan.groups)
                plan.values = dict(plan.values)
                storage.makedirs()
            except Exception as exc:  # noqa: BLE001 - the background step reports it on every rank
                error = exc
            meta_copy = dict(meta) if meta else None
            future = self._executor.submit(write_and_commit, storage, plan, error, dist, compression=compression,
                                           block_bytes=block_bytes, fsync=fsync, io_threads=io_threads,
                                           meta=meta_copy, overwrite=overwrite, direct_io=direct_io,
                                           column_strips=column_strips)
            self._pending = future
            return future


_saver: BackgroundSaver | None = None
_saver_lock = threading.Lock()


def background_saver() -> BackgroundSaver:
    global _saver
    with _saver_lock:
        if _saver is None:
            _saver = BackgroundSaver()
        return _saver


def async_save(state_dict: dict[str, Any], url: str, *, compression: Any = None,
               storage_options: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
               overwrite: bool = True, fsync: bool = True, direct_io: bool = True,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, block_bytes: int = DEFAULT_BLOCK_BYTES,
               io_threads: int = DEFAULT_IO_THREADS, process_group: Any = None,
               only: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
               column_strips: str = "cut") -> Future:
    """Like :func:`save`, but return once the state is copied to host memory.

    The upload and commit run on a background thread with its own gloo process
    group (never the training thread's): ``process_group`` if given (it must
    not be used by anything else while a save runs), else one created on the
    first call (a collective).  Staging buffers are reused from save to save,
    so host memory stays flat; a new ``async_save`` first waits for the
    previous one.  The returned future raises what the save raised.
    """
    comp = save_options(compression, chunk_bytes, block_bytes, column_strips)
    meta = to_json_value(dict(meta), "meta") if meta else None
    return background_saver().submit(state_dict, Storage(url, storage_options), compression=comp, meta=meta,
                                     overwrite=overwrite, fsync=fsync, chunk_bytes=chunk_bytes,
                                     block_bytes=block_bytes, io_threads=io_threads, process_group=process_group,
                                     direct_io=direct_io, keys=(only, exclude), column_strips=column_strips)
