"""Node-local files written whole and read whole: the hot tier's copies (``training/hot/flat.py``).

A directory is published the way a committed checkpoint must appear: every file written and fsynced in a
staging directory beside the target (``.<name>.partial-<pid>-<random>``, what a killed writer leaves is
recognisable by it), the last file given being the commit file, the staging directory fsynced, then one
``rename`` into place -- refused when the target already holds anything, so nothing committed is replaced
-- and the parent fsynced.

A file is read by mapping it (:func:`map_file`): its page-cache pages become a read-only tensor, so the
reader checks and copies bytes that were never copied into a buffer of its own -- a fresh buffer the size of
the file would cost a page fault per 4 KiB, about twice the read itself.  Files published here are written
once and never truncated (only removed, which leaves a mapping valid), so a mapping cannot lose its pages.
"""

from __future__ import annotations

import mmap
import os
import queue
import shutil
import threading
import uuid
import warnings
from typing import Any, Sequence

import torch

from shardkit.checkpoint.io.local_disk import disk_full, fsync_directory, is_disk_full
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CorruptCheckpoint, StorageError

__all__ = ["publish_directory", "read_whole", "map_file", "release_in_background", "Releaser", "RELEASER",
           "remove_files"]


def _write_file(path: str, pieces: Sequence[Any]) -> None:
    """``pieces`` (buffers) back to back into a new file at ``path``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            while len(view):
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_directory(path: str, files: Sequence[tuple[str, Sequence[Any]]]) -> None:
    """Create directory ``path`` holding ``files`` (name, buffers), the last one the commit file, atomically
    (see the module docstring).  Raises :class:`~shardkit.errors.StorageError` naming ``path`` when the disk
    refuses or ``path`` already holds anything (a full disk: the ``CheckpointOSError`` every write raises for
    it, errno kept); nothing is left behind but what was there."""
    parent, base = os.path.split(os.path.abspath(path))
    staging = os.path.join(parent, f"{Storage.temporary_name_prefix(base)}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(staging)
        try:
            for name, pieces in files:
                _write_file(os.path.join(staging, name), pieces)
            fsync_directory(staging)
            os.rename(staging, path)  # fails on a non-empty target: a committed directory is never replaced
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_directory(parent)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full(exc, f"writing {path}", path) from exc
        raise StorageError(f"cannot write {path}: {exc}") from exc


def read_whole(path: str) -> bytes:
    """The bytes of a small file (a manifest).  Raises ``OSError`` as ``open`` does."""
    with open(path, "rb") as f:
        return f.read()


def map_file(path: str, size: int) -> torch.Tensor:
    """The file at ``path``, which must be exactly ``size`` bytes long, as a read-only ``uint8`` tensor over
    its mapped pages (populated up front; the tensor keeps the mapping alive).  Never write to it.  Raises
    :class:`~shardkit.errors.CorruptCheckpoint` naming the file when its size differs or it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            found = os.fstat(fd).st_size
            if found != size:
                raise CorruptCheckpoint(f"{path} holds {found} bytes; {size} were written")
            if size == 0:
                return torch.empty(0, dtype=torch.uint8)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read {path}: {exc}") from None
    with warnings.catch_warnings():  # read-only by design: torch warns that it cannot enforce it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)


class Releaser:
    """One long-lived daemon thread that drops what it is handed, in order.

    Why not a thread per call: ``Thread.start`` waits until the new thread has
    been scheduled, which on a busy machine (more ranks than cores) costs the
    caller up to tens of ms -- the very wait handing the work away was meant to
    save.  The thread is started on first use.  A forked child starts afresh
    (:meth:`reset`, registered with ``os.register_at_fork``): the parent's thread
    does not exist there, and a lock another thread held at the fork would stay
    held in the child forever.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def drain(self) -> None:
        while True:
            held = self.queue.get()
            held.clear()
            del held

    def hand(self, held: list[Any]) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self.drain, name="shardkit-release", daemon=True)
                self.thread.start()
        self.queue.put(held)


RELEASER = Releaser()  # the process's one release thread and its queue
os.register_at_fork(after_in_child=RELEASER.reset)


def release_in_background(held: list[Any]) -> None:
    """Drop ``held`` (tensors over mapped files or large buffers; the caller keeps no other reference) on a
    background thread: unmapping tens of MB costs tens of ms (the page tables torn down, with the GIL
    released), which a recovery that has copied the bytes out need not wait for."""
    if held:
        RELEASER.hand(held)


def remove_files(path: str, names: Sequence[str]) -> list[str]:
    """Remove ``names`` from directory ``path`` in order, then the directory when nothing else is left; the
    names left there (not ours) are returned."""
    for name in names:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
    left = sorted(os.listdir(path))
    if not left:
        os.rmdir(path)
    return left
