"""The disk ends of a directory move (``transfer.py``): a source directory read as one byte stream, and
that stream written back as files into a fresh staging directory that becomes the target in one rename.

Why a stream: the transport moves a checkpoint directory in rounds of bounded size, and a round may end
in the middle of a file or span several small ones.  Both ends agree on the stream's order -- the
listing exchanged before any byte moves, every file sorted by name with the commit file last -- so a
round is just "the next ``n`` bytes" and neither end needs per-file bookkeeping on the wire.

Why a staging directory: nothing already at the target is touched before the copy is complete.  The
files land in a hidden sibling directory (its name starts with what
:meth:`~shardkit.checkpoint.io.storage.Storage.temporary_name_prefix` gives, so a killed move's leftovers are
recognisable), every data file is fsynced, the commit file is written last through a temporary name,
and only then does one ``rename`` make the target appear.  A kill at any moment leaves either no target
or a complete one; ``rename`` never replaces a non-empty directory, so a target that appeared meanwhile
is refused instead of overwritten.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from shardkit.checkpoint.io.local_disk import fsync_directory
from shardkit.checkpoint.io.names import check_name
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import CheckpointExists, CheckpointNotFound, StorageError, UnsafeCheckpoint

__all__ = ["list_directory", "check_target", "OutgoingFiles", "IncomingFiles"]


def list_directory(directory: str, commit_last: str) -> list[tuple[str, int]]:
    """``(relative name, size)`` of every regular file under ``directory`` (subfolders included), sorted
    by name with ``commit_last`` moved to the end: the order both ends of a move stream the bytes in.

    Raises :class:`~shardkit.errors.CheckpointNotFound` for a directory that is missing or holds no
    ``commit_last`` (not a committed checkpoint: nothing worth moving), and
    :class:`~shardkit.errors.UnsafeCheckpoint` for an entry that is not a plain file or not a plain
    name (a receiver must never be asked to write outside its target).
    """
    if not os.path.isdir(directory):
        raise CheckpointNotFound(f"source directory {directory} does not exist or is not a directory")

    def fail(exc: OSError) -> None:
        raise exc

    found = []
    for parent, _, names in os.walk(directory, onerror=fail):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeCheckpoint(f"{path} in source directory {directory} is not a regular file "
                                       f"(a link or special file); a checkpoint holds plain files only")
            found.append((check_name(relative, f"source directory {directory}"), st.st_size))
    if not any(name == commit_last for name, _ in found):
        raise CheckpointNotFound(f"source directory {directory} holds no {commit_last}: it is not a committed "
                                 f"checkpoint (empty, or its writer never finished), so there is nothing to move")
    return sorted(found, key=lambda entry: (entry[0] == commit_last, entry[0]))


def check_target(target_dir: str, commit_last: str) -> None:
    """Refuse a target that already holds anything: a committed copy (its ``commit_last``), or files
    without one -- someone else's directory, or not ours to decide about."""
    if os.path.exists(os.path.join(target_dir, commit_last)):
        raise CheckpointExists(f"target directory {target_dir} already holds a committed copy ({commit_last}); "
                               f"refusing to overwrite it: remove it first or move into another directory")
    if os.path.lexists(target_dir) and (not os.path.isdir(target_dir) or os.listdir(target_dir)):
        raise CheckpointExists(f"target directory {target_dir} already exists and is not an empty directory "
                               f"(no {commit_last}: a partial or foreign directory); refusing to write into it: "
                               f"remove it first or move into another directory")


class OutgoingFiles:
    """A listed source directory read as one byte stream, in listing order, into caller-given buffers."""

    def __init__(self, directory: str, files: list[tuple[str, int]]) -> None:
        self.directory = directory
        self.files = files
        self._index = 0      # the file the stream is in
        self._done = 0       # bytes of it already read
        self._handle = None

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next ``len(view)`` bytes of the stream.  A file that vanished or shrank
        since it was listed raises :class:`~shardkit.errors.StorageError` naming it."""
        filled = 0
        while filled < len(view):
            name, size = self.files[self._index]
            if self._done == size:
                self._next_file()
                continue
            path = os.path.join(self.directory, name)
            try:
                if self._handle is None:
                    self._handle = open(path, "rb", buffering=0)
                got = self._handle.readinto(view[filled:filled + min(size - self._done, len(view) - filled)])
            except OSError as exc:
                raise StorageError(f"cannot read {path} (listed with {size} bytes): {exc}") from exc
            if not got:
                raise StorageError(f"{path} was listed with {size} bytes but ends after {self._done}: it changed "
                                   f"while being moved")
            filled += got
            self._done += got

    def _next_file(self) -> None:
        self.close()
        self._index += 1
        self._done = 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class IncomingFiles:
    """A byte stream written back as the listed files, into a fresh staging directory beside
    ``target_dir`` that :meth:`publish` renames into place once every file is whole."""

    def __init__(self, target_dir: str, commit_last: str) -> None:
        self.target_dir = os.path.abspath(target_dir)
        self.commit_last = commit_last
        self.files: list[tuple[str, int]] = []
        parent, base = os.path.split(self.target_dir)
        os.makedirs(parent, exist_ok=True)
        self.staging = tempfile.mkdtemp(prefix=f"{Storage.temporary_name_prefix(base)}{os.getpid()}-", dir=parent)
        os.chmod(self.staging, 0o755)  # mkdtemp's 0o700 would follow the copy into place
        self._index = 0
        self._done = 0
        self._fd: int | None = None

    def expect(self, files: list[tuple[str, int]]) -> None:
        """The source's listing: the files, in stream order, that the bytes to come make up.  It came from
        another rank, so its names are checked like any name read from a checkpoint."""
        for name, _ in files:
            check_name(name, f"the listing sent for {self.target_dir}")
        if not files or files[-1][0] != self.commit_last:
            raise UnsafeCheckpoint(f"the listing sent for {self.target_dir} does not end with {self.commit_last}, "
                                   f"so the copy could never be committed; refusing it")
        self.files = files

    def _path(self, index: int) -> str:
        """Where file ``index`` is written while it arrives; the commit file under a temporary name."""
        name = self.files[index][0]
        if name == self.commit_last:
            head, tail = os.path.split(name)
            name = os.path.join(head, f"{Storage.temporary_name_prefix(tail)}{os.getpid()}")
        return os.path.join(self.staging, name)

    def write(self, view: memoryview) -> None:
        """Append ``view`` to the stream: each file is created when its first byte arrives (or when the
        stream passes it, if empty) and fsynced and closed when its last byte is written."""
        written = 0
        while written < len(view) or self._pending_empty_file():
            name, size = self.files[self._index]
            if self._fd is None:
                path = self._path(self._index)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            n = min(size - self._done, len(view) - written)
            while n:
                step = os.write(self._fd, view[written:written + n])
                written, self._done, n = written + step, self._done + step, n - step
            if self._done == size:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
                self._index += 1
                self._done = 0

    def _pending_empty_file(self) -> bool:
        return self._index < len(self.files) and self.files[self._index][1] == 0

    def finish(self) -> None:
        """After the last byte: put the commit file in place (temporary name, fsynced, renamed over) and
        fsync every directory of the staging tree, so the staging directory is complete on disk."""
        self.write(memoryview(b""))
        if self._index != len(self.files):
            name, size = self.files[self._index]
            raise StorageError(f"the stream into {self.target_dir} ended inside {name} ({self._done} of {size} "
                               f"bytes)")
        os.replace(self._path(len(self.files) - 1), os.path.join(self.staging, self.commit_last))
        for parent, _, _ in sorted(os.walk(self.staging), key=lambda entry: -len(entry[0])):
            fsync_directory(parent)

    def publish(self) -> None:
        """Make the complete staging directory the target in one ``rename``; refused (the staging
        directory left to :meth:`discard`) when the target appeared and is not empty."""
        try:
            os.rename(self.staging, self.target_dir)
        except OSError as exc:
            raise CheckpointExists(f"target directory {self.target_dir} appeared during the move and is not "
                                   f"empty; it was left as it is and the copy discarded ({exc})") from exc
        fsync_directory(os.path.dirname(self.target_dir))

    def discard(self) -> None:
        """Remove the staging directory (ours alone) after a failure; the target was never touched."""
        self.close()
        shutil.rmtree(self.staging, ignore_errors=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
