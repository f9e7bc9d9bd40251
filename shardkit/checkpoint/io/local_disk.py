"""The byte work of :class:`~shardkit.checkpoint.io.storage.Storage` on a local disk.

Local disks are special-cased for speed and durability:

* reads ``pread`` straight into the target tensor's memory (no copy), and the
  OS is asked to start reading ahead of a load (``posix_fadvise``);
* writes go out buffered (or ``O_DIRECT``, see ``direct_io.py``) from tensor
  memory with no copy, fsynced when the caller wants the data durable;
* a commit is a temporary file + fsync + ``os.replace`` + directory fsync, so
  readers see either the old file or the new one, even after a power loss;
* a full disk (``ENOSPC``, or a quota: ``EDQUOT``) is not worth retrying: the file being written is
  removed and :func:`disk_full` raises ``CheckpointOSError`` (a ``CheckpointError`` that is also the
  ``OSError``, with its errno) naming the file, the filesystem's free space and what to do; a save
  shares it with every rank, which then removes its own new files, so nothing is committed and no
  partial file is left.

Paths handed in are already checked by the front; ``retry`` is the front's
bounded retry layer (``retry(what, fn)``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import uuid
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, Sequence, TypeVar

from shardkit.checkpoint.io.direct_io import open_direct
from shardkit.checkpoint.io.read_ahead import give_hints
from shardkit.errors import CheckpointError, CheckpointNotFound, CheckpointOSError, CorruptCheckpoint

if TYPE_CHECKING:
    import torch

__all__ = ["LocalDisk", "fsync_directory", "disk_full", "is_disk_full", "error_from_message"]

_FULL = (errno.ENOSPC, errno.EDQUOT)

T = TypeVar("T")
Retry = Callable[[str, Callable[[], Any]], Any]


def fsync_directory(directory: str) -> None:
    """fsync ``directory`` so that new entries in it survive a power loss (best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the filesystem (or the user's quota on it) has no room left."""
    return isinstance(exc, OSError) and exc.errno in _FULL


def disk_full(exc: OSError, what: str, path: str) -> CheckpointOSError:
    """The one error of a full disk: ``what`` failed, the errno kept, where the space ran out and how much
    the filesystem has left, and what to do."""
    directory = os.path.dirname(path) or "."
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        st = os.statvfs(directory)
        room = f"; {st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes free there"
    except OSError:
        room = ""
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    quota = "the disk quota is exhausted" if exc.errno == errno.EDQUOT else "no space left on device"
    error = CheckpointOSError(f"{what} failed: {quota} ({name}) on the filesystem of {directory}{room}; the "
                              f"partial file was removed. Free space there (or raise the quota), or save to "
                              f"another location")
    error.errno, error.strerror, error.filename = exc.errno, exc.strerror, path
    return error


def error_from_message(text: str) -> CheckpointError:
    """The error for a failure another rank reported only in words (a directory move's outcome): a
    ``CheckpointOSError`` with its errno when they say the disk was full (``[Errno 28]``, ``(ENOSPC)``), so
    ``except OSError`` and ``exc.errno`` work on every rank alike; else a ``CheckpointError``."""
    for code in _FULL:
        if f"[Errno {code}]" in text or f"({errno.errorcode[code]})" in text:
            error = CheckpointOSError(text)
            error.errno = code
            return error
    return CheckpointError(text)


def _remove(path: str) -> None:
    """Remove what a failed write left at ``path`` (nothing there is fine)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def change_stamp(st: os.stat_result) -> str:
    """What changes when a local file is rewritten: inode and ctime too, so that a file replaced by
    rename, or rewritten within one mtime tick, still differs."""
    return f"ino={st.st_ino},mtime_ns={st.st_mtime_ns},ctime_ns={st.st_ctime_ns}"


def _close_held(held: dict[str, int]) -> None:
    while held:
        os.close(held.popitem()[1])


def _preadv_all(fd: int, start: int, parts: Sequence[torch.Tensor], truncated: str) -> None:
    """Fill ``parts`` (flat uint8 tensors) with the bytes of ``fd`` from ``start``: ``preadv`` until all landed."""
    views = [memoryview(p.numpy()).cast("B") for p in parts]
    pos, i, off = start, 0, 0
    while i < len(views):
        got = os.preadv(fd, [views[i][off:]] + views[i + 1:], pos)
        if got == 0:
            raise CorruptCheckpoint(truncated)
        pos += got
        while got and i < len(views):
            left = len(views[i]) - off
            if got >= left:
                got -= left
                i, off = i + 1, 0
            else:
                off += got
                got = 0


_held = threading.local()  # .fds: {path: descriptor} of this thread's reads inside LocalDisk.files_held_open()


class LocalDisk:
    """A local filesystem: what the policy questions answer there, and how bytes move."""

    # The answers to Storage's policy questions (see its properties for what each one means).
    fsync_worthwhile = True
    reads_in_place = True
    rereads_from_cache = True
    parallel_requests_help = False
    small_reads_cheap = True
    maps_files = True
    paths_are_os_paths = True

    def __init__(self, retry: Retry) -> None:
        self.retry = retry

    # -- metadata ------------------------------------------------------
    def exists(self, path: str, root: str, what: str) -> bool:
        return os.path.exists(path)

    def is_dir(self, path: str, root: str, what: str) -> bool:
        return os.path.isdir(path)

    def size(self, path: str, where: str) -> int:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointNotFound(f"{where} is missing; the checkpoint is incomplete") from None

    def listdir(self, path: str, root: str, what: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def listing(self, root: str, url: str) -> list[tuple[str, int, str]]:
        """(name, size, change stamp) of the files directly under ``root`` (or of the file itself)."""
        if not os.path.isdir(root):
            st = os.stat(root)
            return [(os.path.basename(root), st.st_size, change_stamp(st))]
        out = []
        with os.scandir(root) as entries:
            for e in entries:
                if e.is_file():
                    st = e.stat()
                    out.append((e.name, st.st_size, change_stamp(st)))
        return sorted(out)

    # -- reads ---------------------------------------------------------
    def read_bytes(self, path: str, what: str, start: int | None, end: int | None) -> bytes:
        def local() -> bytes:
            with open(path, "rb") as f:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(end - (start or 0))
        return self.retry(what, local)

    def prefetch(self, path: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Ask the kernel to read ``[start, end)`` ranges of ``path`` now (a hint; never fails).  A load's data
        is hinted on this process's read-ahead thread, a header by the caller, which reads it next
        (:mod:`~shardkit.checkpoint.io.read_ahead` says why)."""
        self.prefetch_files([(path, ranges)])

    def prefetch_files(self, hints: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> None:
        """:meth:`prefetch` of ``(path, ranges)`` pairs, in order: the small ones here, the rest handed to the
        hinting thread at once (one wake-up for a whole load's data, not one per file)."""
        give_hints(hints)

    def read_parts(self, path: str, what: str, start: int, parts: Sequence[torch.Tensor], truncated: str) -> None:
        """One ``preadv`` loop straight into the parts' memory (through the file held open, inside
        :meth:`files_held_open`)."""
        def local() -> None:
            held = getattr(_held, "fds", None)
            if held is None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    _preadv_all(fd, start, parts, truncated)
                finally:
                    os.close(fd)
                return
            fd = held.get(path)
            if fd is None:
                _close_held(held)  # a run's reads go file after file: one open at a time
                fd = held[path] = os.open(path, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            try:
                _preadv_all(fd, start, parts, truncated)
            except OSError:
                _close_held(held)  # a retry opens the file afresh
                raise
        self.retry(what, local)

    @staticmethod
    @contextlib.contextmanager
    def files_held_open() -> Iterator[None]:
        """This thread's :meth:`read_parts` calls inside keep their file open from one call to the next.

        Why: the kernel's read-ahead state lives with the open file.  Reads
        in steps through a descriptor each (open, ``preadv``, close) restart
        it at every step, so a cold read waits for the disk step by step;
        through one descriptor, marked sequential, the kernel reads ahead of
        the steps while they are checksummed (a cold 150 MB file read in 2
        MiB steps, each checksummed: 0.20 s with a descriptor per step,
        0.14-0.16 s with one).  One file is held at a time (the next file's
        first read closes it), and none once the block is left, so no
        descriptor outlives the reads that opened it."""
        if getattr(_held, "fds", None) is not None:  # nested: the outer block holds and closes
            yield
            return
        _held.fds = {}
        try:
            yield
        finally:
            held, _held.fds = _held.fds, None
            _close_held(held)

    def download(self, path: str, what: str, local_path: str) -> None:
        self.retry(what, lambda: shutil.copyfile(path, local_path))

    # -- writes --------------------------------------------------------
    def write_stream(self, path: str, what: str, produce: Callable[[BinaryIO], T], *, fsync: bool, direct: bool,
                     root: str) -> T:
        def local() -> T:
            try:
                return write()
            except BaseException as exc:
                _remove(path)  # a new file: half of it is worth nothing (and a retry starts over)
                if is_disk_full(exc):
                    raise disk_full(exc, what, path) from exc  # type: ignore[arg-type]
                raise

        def write() -> T:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            raw = open_direct(path) if direct else None
            if raw is not None:
                try:
                    result = produce(raw)  # type: ignore[arg-type]
                    raw.close(fsync=fsync)
                    return result
                except OSError as exc:
                    raw.abort()
                    if exc.errno != errno.EINVAL:  # EINVAL: O_DIRECT accepted at open, refused on write
                        raise
                except BaseException:
                    raw.abort()
                    raise
            with open(path, "wb") as f:
                result = produce(f)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            return result
        return self.retry(what, local)

    def put_atomic(self, path: str, what: str, data: bytes, root: str) -> None:
        def local() -> None:
            directory = os.path.dirname(path)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            try:
                os.makedirs(directory, exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as exc:
                if is_disk_full(exc):
                    raise disk_full(exc, what, path) from exc
                raise
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            fsync_directory(directory)
        self.retry(what, local)

    def replace(self, src: str, dst: str, what: str) -> None:
        """A rename: atomic on one filesystem."""
        self.retry(what, lambda: os.replace(src, dst))

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            if is_disk_full(exc):
                raise disk_full(exc, f"creating directory {path}", path) from exc
            raise

    def sync_dir(self, path: str) -> None:
        fsync_directory(path)

    # -- deletes -------------------------------------------------------
    def delete(self, paths: Iterable[str], what: str) -> None:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def delete_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_empty_dir(self, path: str) -> bool:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

    def tree_bytes(self, path: str) -> int:
        total = 0
        for root, _, files in os.walk(path):  # a file removed meanwhile is not counted
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.exists(os.path.join(root, f)))
        return total

    def free_bytes(self, path: str) -> int:
        return shutil.disk_usage(path).free
