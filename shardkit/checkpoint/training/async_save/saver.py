"""``async_save``: copy the state to host memory, then write and commit in the background.

Why this shape:

* **Writing off the training process.**  By default a long-lived writer
  process per training process (:mod:`~shardkit.checkpoint.training.async_save.writer_process`)
  checksums, compresses and writes the staged bytes, so that work does not
  compete with the training step for the GIL; ``writer="thread"`` writes from
  a thread of this process instead (and a ``memory://`` URL, which only this
  process can see, always does).
* **Flat host memory.**  The state is copied into a reused
  :class:`~shardkit.checkpoint.training.async_save.host_buffers.StagingPool` buffer (shared
  memory for the writer process), so repeated saves allocate nothing.
* **A repeat save only copies.**  While the state keeps its structure, the
  planning and staging layout of the last save are reused
  (:mod:`~shardkit.checkpoint.training.async_save.repeat_copy`): the call blocks for
  the copy, one pass over the tensors and one small all-reduce.
* **One save in flight.**  A new save waits for the previous one, so the
  buffer is never overwritten while it is being written.
* **Its own process group.**  A background thread gathers chunk records and
  commits through a gloo group created for it; gloo aborts when two threads run
  collectives on one group, and the training thread owns the default group.
  That group is destroyed when the interpreter exits, before it finalizes
  (:mod:`shardkit.held_groups` says why), or when the default group it was
  made under is replaced.
"""

from __future__ import annotations

import contextvars
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from shardkit.checkpoint.formats.native import DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_BYTES
from shardkit.checkpoint.io.concurrency import DEFAULT_IO_THREADS, PerProcess
from shardkit.checkpoint.io.deadline import Deadline, deadline_for, with_step
from shardkit.checkpoint.io.dist import Dist
from shardkit.checkpoint.io.retries import with_retries
from shardkit.checkpoint.io.storage import Storage
from shardkit.checkpoint.state.dcp_stateful import stateful_to_state_dict
from shardkit.checkpoint.training.async_save.host_buffers import StagingPool
from shardkit.checkpoint.training.async_save.repeat_copy import RepeatStaging
from shardkit.checkpoint.training.async_save.writer_process import WriterProcess, writer_options
from shardkit.checkpoint.training.checkpoint_id import checkpoint_url
from shardkit.checkpoint.training.save import write_and_commit
from shardkit.checkpoint.training.save_options import SaveOptions
from shardkit.errors import ConfigurationError
from shardkit.held_groups import GroupRef, finish_before_exit, release_at_exit

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["async_save", "BackgroundSaver", "background_saver", "WRITERS"]

WRITERS = ("process", "thread")


class BackgroundSaver:
    """The per-process async save machinery (see the module docstring)."""

    def __init__(self) -> None:
        self.pools = {"thread": StagingPool(), "process": StagingPool(shared=True)}
        self.writer_process = WriterProcess()
        self.staging = RepeatStaging()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-async-save")
        self._pending: Future | None = None
        self._group: tuple[GroupRef, Any] | None = None  # (default group it was made under, private group)
        self._lock = threading.Lock()
        self._owner = os.getpid()  # a forked copy of this object must not touch the parent's group
        release_at_exit(self.release_group)
        finish_before_exit(self.wait)  # a script that ends during its last save still commits it

    def _private_group(self) -> Any:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        world = dist.group.WORLD
        if self._group is None or not self._group[0].refers_to(world):  # first use, or a new default group
            self._destroy_group()
            self._group = (GroupRef(world), dist.new_group(backend="gloo"))  # collective: every rank's first save
        return self._group[1]

    def release_group(self) -> None:
        """Destroy the private group (the next save makes a new one).  Runs at exit, after the program's
        threads -- this saver's included -- were joined, so no save is in flight (see
        :mod:`shardkit.held_groups`)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            self._pending = None  # a failed save's traceback holds the group through its frames
            self._destroy_group()

    def _destroy_group(self) -> None:
        import torch.distributed as dist

        found, self._group = self._group, None
        if found is None:
            return
        try:  # still registered when the program never destroyed its default group
            dist.destroy_process_group(found[1])
        except (ValueError, RuntimeError):
            pass  # gone with its default group already: dropping the reference above frees it

    def wait(self) -> None:
        """Block until the save in flight (if any) has finished; its errors stay in its future."""
        pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except BaseException:  # noqa: BLE001 - reported through that save's own future
                pass

    def run(self, job: Callable[[Any], Any]) -> Future:
        """Run ``job(group)`` on the background thread, after the save in flight, with the private group (made
        now on first use: a collective): work that writes and talks to the other ranks while training goes on,
        such as a hot-tier save, without ever overlapping a background save on the same group."""
        with self._lock:
            self.wait()
            group = self._private_group()
            # the job's collectives keep the deadline of the operation that started it
            self._pending = self._executor.submit(contextvars.copy_context().run, job, group)
            return self._pending

    def submit(self, state_dict: dict[str, Any], storage: Storage, options: SaveOptions, *,
               process_group: ProcessGroup | None = None, writer: str = "process",
               child_options: Mapping[str, Any] | None = None, deadline: Deadline | None = None) -> Future:
        """Plan and stage on this thread, write and commit in the background; ``child_options``: the
        storage options the writer process rebuilds the storage from (see :func:`choose_writer`);
        ``deadline``: of every collective, the background ones included."""
        with self._lock:
            self.wait()
            pool = self.pools[writer]
            self.pools["thread" if writer == "process" else "process"].release()  # one buffer at a time
            group = process_group if process_group is not None else self._private_group()
            dist = Dist(group, deadline)
            plan, error = None, None
            try:
                plan = self.staging.plan_and_stage(stateful_to_state_dict(state_dict), dist, pool,
                                                   chunk_bytes=options.chunk_bytes, io_threads=options.io_threads,
                                                   keys=options.keys, compression=options.compression)
                storage.makedirs()
            except Exception as exc:  # noqa: BLE001 - the background step reports it on every rank
                error = exc
            write_files = commit_reports = None
            if writer == "process" and plan is not None:
                commit_reports = lambda reports, plan: self.writer_process.commit(  # noqa: E731
                    storage, dict(child_options or {}), options, plan, reports, dist.world_size)
                write_files = lambda jobs: self.writer_process.write_files(  # noqa: E731
                    storage, dict(child_options or {}), jobs, pool, writer=dist.rank, options=options)

            def write_in_background() -> None:
                pool.wait_copied()
                write_and_commit(storage, plan, error, dist, options, write_files=write_files,
                                 commit_reports=commit_reports)

            self._pending = self._executor.submit(write_in_background)
            return self._pending


_saver: PerProcess[BackgroundSaver] = PerProcess(BackgroundSaver)  # a forked child starts its own


def background_saver() -> BackgroundSaver:
    return _saver.get()


def choose_writer(writer: str | None, storage: Storage,
                  storage_options: Mapping[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """``writer`` checked against the storage (``None``: the writer process where it can reach the storage),
    and for the writer process the storage options as the JSON it receives (others are refused)."""
    if writer is not None and writer not in WRITERS:
        raise ConfigurationError(f"writer must be one of {', '.join(WRITERS)} (or None), got {writer!r}")
    if writer == "process" and storage.in_this_process:
        raise ConfigurationError(f"async_save(writer='process') cannot write to {storage.url}: a memory:// "
                                 f"filesystem lives in this process only; pass writer='thread'")
    if writer == "thread" or storage.in_this_process:
        return "thread", None
    return "process", writer_options(storage, storage_options)


def async_save(state_dict: dict[str, Any], url: str | None = None, *,
               checkpoint_id: str | os.PathLike | None = None, compression: Any = None,
               storage_options: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
               overwrite: bool = True, fsync: bool = True, direct_io: bool = True,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, block_bytes: int = DEFAULT_BLOCK_BYTES,
               io_threads: int = DEFAULT_IO_THREADS, process_group: Any = None,
               only: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
               column_strips: str = "cut", writer: str | None = None, digests: bool | str = False,
               reuse_from: str | None = None, timeout: float | timedelta | None = None,
               retries: int | None = None) -> Future:
    """Like :func:`save`, but return once the state is copied to host memory.

    ``writer``: ``"process"`` (the default wherever it can reach the storage)
    checksums, compresses and writes in a long-lived child process fed
    through shared memory, so none of it competes with training for the GIL;
    ``"thread"`` does it on a thread of this process (``memory://`` URLs always
    do).  The commit runs on a background thread with its own gloo process
    group (never the training thread's): ``process_group`` if given (it must
    not be used by anything else while a save runs), else one created on the
    first call (a collective).  Staging buffers are reused from save to save,
    so host memory stays flat; a new ``async_save`` first waits for the
    previous one.  The returned future raises what the save raised.
    ``checkpoint_id``: DCP's keyword for ``url`` (give one of them).  A top-level ``Stateful`` value (torch's
    protocol) is saved as its ``state_dict()``, called before this returns, as DCP's ``async_save`` calls it.
    ``digests``/``reuse_from``: as for :func:`save` (the hashing runs in the background).
    ``timeout``: as for :func:`save`, for the collectives of the background write and commit too: a rank that
    died or froze makes the future raise :class:`~shardkit.errors.CheckpointTimeout` on the others.
    """
    url = checkpoint_url(url, checkpoint_id, "async_save")
    options = SaveOptions.checked(compression=compression, meta=meta, overwrite=overwrite, fsync=fsync,
                                  direct_io=direct_io, chunk_bytes=chunk_bytes, block_bytes=block_bytes,
                                  io_threads=io_threads, column_strips=column_strips, digests=digests,
                                  reuse_from=reuse_from, only=only, exclude=exclude)
    storage_options = with_retries(storage_options, retries)
    deadline = with_step(deadline_for("async save", url, timeout), options.meta)
    storage = Storage(url, storage_options)
    mode, child_options = choose_writer(writer, storage, storage_options)
    return background_saver().submit(state_dict, storage, options, process_group=process_group, writer=mode,
                                     child_options=child_options, deadline=deadline)
